"""images/s, step time, data-wait share and MFU under perf/ in the logs (docs/how-it-works.md#performance-you-can-see).

    python -m classifier_engine fit --config CONFIG      # on by default; tensorboard --logdir runs/quickstart
"""

import copy
import time
from typing import Any, Optional

import lightning as L
import torch
from lightning.fabric.utilities.throughput import get_available_flops, measure_flops
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from classifier_engine import contract
from classifier_engine.callbacks.data_bound import DataVerdict
from classifier_engine.errors import ConfigError
from classifier_engine.options import PositiveFloat, Probability, check_arguments
from classifier_engine.run.training_steps import after_optimizer_step, is_logging_step

# Dense peak FLOP/s per GPU from NVIDIA's datasheets, by a substring of the device name, the more specific first
# (Lightning's table has the H200's sparse figures and misses the name "NVIDIA H200").
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("h200", {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12}),
    ("h100 pcie", {"fp32": 51.2e12, "tf32": 378e12, "bf16": 756e12, "fp16": 756e12}),
    ("h100", {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12}),
    ("a100", {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}),
    ("l40s", {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362e12, "fp16": 362e12}),
    ("l4", {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12}),
    ("v100", {"fp32": 15.7e12, "fp16": 125e12}),
)
_TORCH_DTYPES = {"fp32": torch.float32, "tf32": "tfloat32", "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str, device: torch.device) -> str:
    """The arithmetic the convolutions run in: "bf16", "fp16", "tf32" (fp32 convs on Ampere+ via cuDNN) or "fp32"."""
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    # cuDNN lets fp32 convolutions use TF32 tensor cores unless the user turned it off (torch's default is on).
    if device.type == "cuda" and torch.backends.cudnn.allow_tf32 and torch.cuda.get_device_capability(device)[0] >= 8:
        return "tf32"
    return "fp32"


def peak_flops(device: torch.device, dtype: str) -> Optional[float]:
    """Dense peak FLOP/s of one device for `dtype`, or None where unknown (CPUs, GPUs missing from both tables)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    for key, peaks in PEAK_FLOPS:
        if key in name:
            return peaks.get(dtype, peaks["fp32"])
    return get_available_flops(device, _TORCH_DTYPES[dtype])


def meta_copy(network: torch.nn.Module) -> torch.nn.Module:
    """A weightless copy of `network` on the meta device, made without copying its weights first."""
    memo = {id(t): torch.nn.Parameter(t.to("meta"), t.requires_grad) for t in network.parameters()}
    memo.update({id(t): t.to("meta") for t in network.buffers()})
    return copy.deepcopy(network, memo)


def train_flops_per_image(network: torch.nn.Module, batch_shape: torch.Size) -> float:
    """FLOPs of one training step (forward + backward) per image, counted on a weightless meta-device copy."""
    meta = meta_copy(network)  # a no-op copy of one already there
    images = torch.empty(batch_shape, device="meta")
    return measure_flops(meta, lambda: meta(images), lambda logits: logits.sum()) / batch_shape[0]


class ThroughputLogger(L.Callback):
    """Logs training speed under perf/ (and to the progress bar); the CLI's `--throughput.*` group."""

    def __init__(self, peak_flops: Optional[PositiveFloat] = None, count_flops: bool = True,
                 data_bound_at: Probability = 0.1):
        """
        Args:
            peak_flops: peak FLOP/s of one device for MFU, > 0; None looks the GPU up in PEAK_FLOPS (no MFU on CPU).
            count_flops: count the model's FLOPs per image once (on a meta-device copy) for tflops and MFU.
            data_bound_at: the share of step time spent waiting for the next batch above which each epoch's end and
                the fit's last line call the run data-bound and name the fix that would help most (data_bound.py).
        """
        super().__init__()
        # `--throughput.peak_flops=-1` is refused while parsing; these checks are for a Python caller's values.
        checked = check_arguments(ThroughputLogger.__init__, locals(), "throughput")
        self.peak_flops, self.count_flops = checked["peak_flops"], checked["count_flops"]
        self.verdict = DataVerdict(checked["data_bound_at"])
        self._step_start = 0.0
        if self.peak_flops is not None and not self.count_flops:
            raise ConfigError(f"throughput.peak_flops={self.peak_flops:g} is for MFU, which needs the FLOP count: "
                              "drop --throughput.peak_flops or set --throughput.count_flops=true")
        self.flops_per_image: Optional[float] = None
        self.windows: list[dict[str, float]] = []  # every logged window, for benchmarks reading the figures back
        self.device_peak_flops = self.peak_flops  # resolved at setup: the argument, else the table
        self._flops_counted = False
        self._meta_network: Optional[torch.nn.Module] = None  # the network as setup found it, weightless
        self._devices = self._world_size = 1
        self._device = torch.device("cpu")
        self._reset_window()

    def _reset_window(self) -> None:
        self._steps = self._images = 0
        self._wait = self._elapsed = 0.0  # elapsed: closed segments (one ends at validation or at an epoch's end)
        self._segment_start = self._last_end = None  # perf_counter() times, once a segment is open

    def _now(self) -> float:
        # CUDA runs asynchronously: only after a synchronize does the host clock include the GPU's work.
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._device, self._world_size = trainer.strategy.root_device, trainer.world_size
        # ddp: one device per process; dp: one process drives all the node's devices.
        self._devices = trainer.num_devices * trainer.num_nodes
        dtype = compute_dtype(str(trainer.precision), self._device)
        self.device_peak_flops = self.peak_flops or peak_flops(self._device, dtype)
        # Copied now, before configure_model may shard it (fsdp2: FLOPs cannot be counted on sharded weights)
        network = contract.exportable(pl_module)
        if self.count_flops and stage == "fit" and network is not pl_module:
            self._meta_network = meta_copy(network)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_end = None  # the first fetch of an epoch starts the loader's workers: not a per-step cost

    def _close_segment(self) -> None:
        if self._segment_start is not None:
            self._elapsed += self._now() - self._segment_start
        self._segment_start = self._last_end = None

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close_segment()
        self.verdict.epoch_end(trainer)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING:  # validation inside fit is no training time
            self._close_segment()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int):
        if self.count_flops and not self._flops_counted:
            self._count_flops(batch)
            self._last_end = None  # the counting is no data wait
        now = self._step_start = time.perf_counter()
        if self._segment_start is None:
            self._segment_start = now
        elif self._last_end is not None:
            self._wait += now - self._last_end
            self.verdict.add(wait=now - self._last_end)

    def _count_flops(self, batch: Any) -> None:
        self._flops_counted = True  # once, whatever happens
        network = self._meta_network
        images = batch[0] if isinstance(batch, (list, tuple)) else batch
        if not isinstance(network, torch.nn.Module) or not isinstance(images, torch.Tensor):
            rank_zero_warn("ThroughputLogger: no `network` module or image batch to count FLOPs on; no tflops/MFU")
            return
        try:
            self.flops_per_image = train_flops_per_image(network, images.shape)
        except Exception as error:  # a custom network with an op the meta device lacks must not stop training
            rank_zero_warn(f"ThroughputLogger: counting FLOPs failed ({error!r}); logging without tflops/MFU")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        images = batch[0] if isinstance(batch, (list, tuple)) else batch
        self._images += len(images)
        self._last_end = time.perf_counter()
        if after_optimizer_step(trainer, batch_idx):
            self._steps += 1
            # Log on the steps Lightning writes its own step metrics, so perf/* lines up with train/loss.
            if is_logging_step(trainer, batch_idx):
                self._log_window(trainer, pl_module)
        # Host time: the device's share shows up at the logging steps' synchronize (the host runs ahead in between).
        self.verdict.add(busy=time.perf_counter() - self._step_start, images=len(images))

    def _log_window(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        open_segment = self._now() - self._segment_start if self._segment_start is not None else 0.0
        elapsed = self._elapsed + open_segment
        if elapsed <= 0 or self._images == 0:
            return
        total = self._images / elapsed * self._world_size  # every rank runs the same steps in lockstep
        metrics = {"perf/images_per_sec": total, "perf/device/images_per_sec": total / self._devices,
                   "perf/step_time": elapsed / self._steps, "perf/data_wait": min(1.0, self._wait / elapsed)}
        if self.flops_per_image is not None:
            device_flops = self.flops_per_image * total / self._devices
            metrics["perf/device/tflops"] = device_flops / 1e12
            if self.device_peak_flops:
                metrics["perf/device/mfu"] = device_flops / self.device_peak_flops
        self.windows.append({**metrics, "steps": self._steps, "images": self._images})
        # Straight to the loggers, as Lightning's ThroughputMonitor does, without self.log's bookkeeping; at the step
        # Lightning writes train/loss at right after this hook (and flushes then): one before global_step here.
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step - 1)
        self._reset_window()
        # The next window starts now: the steps after this one count from here (the sync above included).
        self._segment_start = self._last_end = time.perf_counter()
