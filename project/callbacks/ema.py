"""EMA of the network's weights (torchvision's recipe): a callback that owns the averaged copy and its counter.

    python -m project fit ... --trainer.callbacks+=project.callbacks.ema.EMA --trainer.callbacks.decay=0.99998 \
        --trainer.callbacks.every_n_steps=32 --trainer.callbacks.warmup_epochs=5 --trainer.callbacks.adjust_decay=true

Which weights are seen when, and why not EMAWeightAveraging: engine/docs/how-it-works.md#what-a-checkpoint-holds.
"""

import copy
import math
from collections import defaultdict
from collections.abc import Iterator
from typing import Any, Optional

import lightning as L
import torch
from classifier_engine import ConfigError
from classifier_engine.options import NonNegativeFloat, PositiveInt, UnitInterval, check_arguments
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim.swa_utils import get_ema_multi_avg_fn

from project.backbones import NETWORK, HasNetwork


def torchvision_ema_decay(decay: float, images_per_update: int, epochs: float) -> float:
    """The per-update decay torchvision derives from --model-ema-decay (references/classification/train.py):
    adjust = world_size * batch_size * model_ema_steps / epochs; alpha = min(1, (1 - decay) * adjust)."""
    if not 0.0 <= decay <= 1.0 or images_per_update < 1 or epochs <= 0:
        raise ConfigError(f"expected 0 <= decay <= 1, images_per_update >= 1, epochs > 0; got {decay}, "
                          f"{images_per_update}, {epochs}")
    return 1.0 - min(1.0, (1.0 - decay) * images_per_update / epochs)


def averaging_device(device: Optional[str]) -> Optional[torch.device]:
    """The EMA's `device` as a torch.device (None: the model's), refused now if bad, not after the loggers start."""
    if device is None:
        return None
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"EMA.device: expected a torch device (cpu, cuda, cuda:1, ...), got {device!r}; or leave it "
                          "null to keep the average on the model's device") from None
    if parsed.type == "cuda" and (not torch.cuda.is_available() or (parsed.index or 0) >= torch.cuda.device_count()):
        raise ConfigError(f"EMA.device={device}: this machine has {torch.cuda.device_count()} CUDA device(s); use cpu "
                          "or leave it null to keep the average on the model's device")
    return parsed


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _averaged_root(pl_module: L.LightningModule) -> tuple[nn.Module, str]:
    """What is averaged, and its state_dict prefix in the module's: the network, or the whole module without one."""
    return (pl_module.network, NETWORK + ".") if isinstance(pl_module, HasNetwork) else (pl_module, "")


class EMA(L.Callback):
    """Exponential moving average of the network's parameters and buffers (BatchNorm statistics), torchvision-style.

    Args:
        decay: per-update decay, in [0, 1]; with adjust_decay, torchvision's --model-ema-decay (ResNet-50 V2: 0.99998).
        every_n_steps: update every n optimizer steps, >= 1 (torchvision's --model-ema-steps default, and ours: 32).
        warmup_epochs: for this many epochs (>= 0; rounded to optimizer steps as the LR warmup is: give
            model.optim.warmup_epochs) the EMA is a copy of the weights, and its first update after them copies too.
        adjust_decay: derive the per-update decay as torchvision does (torchvision_ema_decay), from the global batch
            (train loader batch x world size x accumulation), every_n_steps and the run's epochs.
        device: where the averaged copy lives (default: the model's; "cpu" saves GPU memory, copies at each update).

    During fit: `average` (the averaged copy), `n_averaged` (its update count, on its device), `update_decay`.
    """

    def __init__(self, decay: UnitInterval = 0.9999, every_n_steps: PositiveInt = 32,
                 warmup_epochs: NonNegativeFloat = 0.0, adjust_decay: bool = False, device: Optional[str] = None):
        # `--trainer.callbacks.decay=2` is refused while parsing; these checks are for a Python caller's values.
        checked = check_arguments(EMA.__init__, locals(), "EMA")
        self.decay, self.every_n_steps = checked["decay"], checked["every_n_steps"]
        self.warmup_epochs, self.adjust_decay = checked["warmup_epochs"], checked["adjust_decay"]
        self.device = averaging_device(device)
        self.average: Optional[nn.Module] = None
        self.n_averaged: Optional[torch.Tensor] = None
        self.update_decay = self.decay
        self._lerp = get_ema_multi_avg_fn(self.decay)  # torch's foreach lerp: one kernel per device and dtype
        self._latest_update_step = 0  # the global step of the last update: checkpointed (state_dict)
        self._warmup_steps = 0
        self._prefix = ""
        self._holds_average = False  # the module holds the averaged weights (and `average` the raw ones)
        self._stash: list[Optional[torch.Tensor]] = []  # while it does: the averages the module's dtype rounded
        self._swapped_for_validation = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if pl_module.device_mesh is not None:  # a ModelParallelStrategy: the weights are shards, not a copyable network
            raise ConfigError("EMA does not average sharded weights (strategy fsdp2): drop the EMA callback from "
                              "trainer.callbacks, or train with strategy ddp")
        root, self._prefix = _averaged_root(pl_module)
        self.average = copy.deepcopy(root).requires_grad_(False)  # at setup: a checkpoint restores into it
        if self.device is not None:
            self.average.to(self.device)
        self.n_averaged = torch.zeros((), dtype=torch.long, device=self.device)
        self._holds_average = self._swapped_for_validation = False
        self._stash = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # configure_model, the precision plugin and the strategy ran after setup: each copy gets the raw tensor's layout
        # and device, and a dtype at least as precise as both (bf16 would drop small increments); values are kept.
        for averaged, current in zip(_tensors(self.average), _tensors(_averaged_root(pl_module)[0]), strict=True):
            device = averaged.device if self.device is not None else current.device
            dtype = torch.promote_types(averaged.dtype, current.dtype)
            if averaged.stride() != current.stride() or averaged.device != device or averaged.dtype != dtype:
                averaged.data = torch.empty_like(current, device=device, dtype=dtype).copy_(averaged.data)
        self.n_averaged = self.n_averaged.to(self.device or pl_module.device)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        steps_per_epoch = max(1, math.ceil(trainer.num_training_batches / trainer.accumulate_grad_batches))
        self._warmup_steps = round(self.warmup_epochs * steps_per_epoch)  # as project.optim rounds the LR warmup
        decay = self.decay
        if self.adjust_decay:
            batch_size = getattr(trainer.train_dataloader, "batch_size", None)
            if not batch_size:
                raise ConfigError("EMA adjust_decay needs the train DataLoader's batch_size (it has none): set "
                                  "adjust_decay=false and pass the per-update decay "
                                  "(project.callbacks.ema.torchvision_ema_decay)")
            images_per_step = batch_size * trainer.world_size * trainer.accumulate_grad_batches
            epochs = trainer.estimated_stepping_batches / steps_per_epoch
            decay = torchvision_ema_decay(self.decay, images_per_step * self.every_n_steps, epochs)
        self.update_decay, self._lerp = decay, get_ema_multi_avg_fn(decay)
        rank_zero_info(f"EMA: decay {decay:.6g} per update, every {self.every_n_steps} steps, a copy of the "
                       f"weights for the first {self._warmup_steps} steps")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step_idx = trainer.global_step - 1  # zero-based index of the optimizer step just taken
        # global_step grows only on optimizer steps: with gradient accumulation most batch ends have none.
        if trainer.global_step > self._latest_update_step and step_idx % self.every_n_steps == 0:
            # A pure function of the step, so a resumed run copies where an uninterrupted one does: during the
            # warmup, and at the first update after it (torchvision resets n_averaged, so that update copies).
            self._update(_averaged_root(pl_module)[0], copy=step_idx - self.every_n_steps < self._warmup_steps)
            self._latest_update_step = trainer.global_step

    @torch.no_grad()
    def _update(self, network: nn.Module, *, copy: bool) -> None:
        groups: dict[tuple, tuple[list, list]] = defaultdict(lambda: ([], []))
        for averaged, current in zip(_tensors(self.average), _tensors(network), strict=True):
            current = current.detach().to(averaged.device, averaged.dtype)
            if copy or not averaged.is_floating_point():  # integer buffers (num_batches_tracked) follow the model
                averaged.copy_(current)
            else:
                groups[(averaged.device, averaged.dtype)][0].append(averaged)
                groups[(averaged.device, averaged.dtype)][1].append(current)
        for averaged_group, current_group in groups.values():
            self._lerp(averaged_group, current_group, None)
        self.n_averaged += 1  # on the device: no host read

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.average is not None and not self._holds_average:
            self._swap(pl_module)
            self._swapped_for_validation = True

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._swapped_for_validation:
            self._swap(pl_module)
            self._swapped_for_validation = False

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A swap, not a copy: a checkpoint written after training keeps the raw weights as current_model_state.
        if self.average is not None and not self._holds_average:
            self._swap(pl_module)

    def _swap(self, pl_module: L.LightningModule) -> None:
        restoring = self._holds_average
        stash = []
        for index, (averaged, current) in enumerate(
                zip(_tensors(self.average), _tensors(_averaged_root(pl_module)[0]), strict=True)):
            held = averaged.data.clone()
            # Swapping back, an average more precise than the module (bf16-true) returns from the stash, unrounded.
            kept = self._stash[index] if restoring else None
            averaged.data.copy_(kept if kept is not None else current.data)
            current.data.copy_(held)
            stash.append(held if not restoring and held.dtype != current.dtype else None)
        self._stash = [] if restoring else stash
        self._holds_average = not restoring

    def state_dict(self) -> dict[str, Any]:
        return {"latest_update_step": self._latest_update_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._latest_update_step = state_dict["latest_update_step"]

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.average is None:
            return  # outside fit: the module's own weights (after a fit with this callback, the averaged ones)
        module_state = checkpoint["state_dict"]
        held = {self._prefix + name: value for name, value in self.average.state_dict().items()}
        # Keys outside the network (if any) are not averaged: both sets carry the module's own.
        if self._holds_average:  # after training: the module holds the average, rounded to its dtype; the stash, whole
            root = _averaged_root(pl_module)[0]
            names = [self._prefix + n for n, _ in (*root.named_parameters(), *root.named_buffers())]
            whole = {name: value for name, value in zip(names, self._stash)
                     if value is not None and name in module_state}
            averaged, raw = {**module_state, **whole}, {**module_state, **held}
        else:
            averaged, raw = {**module_state, **held}, module_state
        checkpoint.update(state_dict=averaged, current_model_state=raw, averaging_state={"n_averaged": self.n_averaged})

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.average is None:
            return  # validate/test/predict: the checkpoint's state_dict already is the averaged weights
        prefix = self._prefix
        averaged = {name[len(prefix):]: value for name, value in checkpoint["state_dict"].items()
                    if name.startswith(prefix)}
        self.average.load_state_dict(averaged)
        if "current_model_state" in checkpoint and "averaging_state" in checkpoint:
            self.n_averaged.copy_(checkpoint["averaging_state"]["n_averaged"])
            # Lightning loaded state_dict (the averaged weights) into the module: put the raw ones back.
            pl_module.load_state_dict(checkpoint["current_model_state"])
        else:
            rank_zero_warn("EMA: the checkpoint holds no averaged weights (it was written without EMA): the average "
                           "starts from its weights")
