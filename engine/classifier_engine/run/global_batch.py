"""--global_batch_size N: every optimizer step takes the same N samples at any world size, so a run stopped on 8 GPUs
continues exactly on 4 or 16 (docs/reliability.md#resuming-on-another-number-of-gpus).

    python -m classifier_engine fit --config CONFIG --global_batch_size 1024 --ckpt_path last
"""

import math
import os
from typing import Optional

import lightning as L
import torch
from jsonargparse import Namespace
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from classifier_engine.compat.resume_batches import continue_epoch_at_batch
from classifier_engine.errors import ConfigError
from classifier_engine.run.slurm import slurm_job_id
from classifier_engine.strategies.sync_batchnorm import GlooSyncBatchNorm

FLAG = "--global_batch_size"


def planned_world_size(trainer: Namespace) -> int:
    """The processes the Trainer will run: the launcher's (srun, torchrun), else devices x num_nodes; dp is one."""
    if trainer.get("strategy") == "dp":
        return 1
    if slurm_job_id() is not None:  # Lightning's own detection, in its order
        return int(os.environ["SLURM_NTASKS"])
    if TorchElasticEnvironment.detect():
        return int(os.environ["WORLD_SIZE"])
    devices, nodes = trainer.get("devices", "auto"), int(trainer.get("num_nodes") or 1)
    text = str(devices).replace(" ", "").strip("[],")
    if isinstance(devices, (list, tuple)) or "," in text:
        return len([index for index in text.split(",") if index]) * nodes
    if text.isdigit():
        return int(text) * nodes
    # "auto" and -1: every GPU there is; one process on CPU (Lightning's count for both)
    gpus = trainer.get("accelerator") not in ("cpu", "mps") and torch.cuda.is_available()
    return (torch.cuda.device_count() if gpus else 1) * nodes


def split_global_batch(global_batch: int, world_size: int, largest: int) -> tuple[int, int]:
    """(per-process batch, accumulation) with batch x world_size x accumulation = global_batch, the batch at most
    `largest` (the data module's batch_size: what fits) and as large as divides."""
    if global_batch % world_size:
        below, above = global_batch - global_batch % world_size, global_batch + world_size - global_batch % world_size
        raise ConfigError(f"{FLAG} {global_batch} does not split over {world_size} processes: choose a multiple of "
                          f"{world_size} ({below or above} or {above})")
    per_process = global_batch // world_size
    accumulation = next(a for a in range(math.ceil(per_process / largest), per_process + 1) if per_process % a == 0)
    return per_process // accumulation, accumulation


def apply_global_batch(config: Namespace, explicit: Namespace) -> Optional[str]:
    """A fit's config set for its global batch (in place): the data module's (and a linked model's) batch_size is
    the per-process batch, trainer.accumulate_grad_batches the rest; the line that says so. None without one."""
    global_batch = config.get("global_batch_size")
    if global_batch is None:
        return None
    data = config.data.get("init_args") if isinstance(config.get("data"), Namespace) else None
    if data is None or data.get("batch_size") is None:
        name = config.data.get("class_path") if isinstance(config.get("data"), Namespace) else config.get("data")
        raise ConfigError(f"{FLAG} sets the data module's per-process batch_size, and {name} has none: give its "
                          "__init__ a batch_size argument (used by its train_dataloader), or drop " + FLAG)
    world_size, largest = planned_world_size(config.trainer), data.batch_size
    batch, accumulation = split_global_batch(global_batch, world_size, largest)
    data.batch_size = batch
    model = config.model.get("init_args") if isinstance(config.get("model"), Namespace) else None
    if model is not None and "batch_size" in model:  # the link from data.batch_size (an LR scaled by the batch)
        model.batch_size = batch
    config.trainer.accumulate_grad_batches = accumulation
    processes = f"{world_size} process{'es' if world_size > 1 else ''}"
    # A given accumulation (a run's own config.yaml holds the one it ran with) gives way: the global batch decides.
    given = explicit.get("trainer.accumulate_grad_batches")
    replaced = f"; trainer.accumulate_grad_batches {given} given, not used" if given not in (None, accumulation) else ""
    return (f"global batch {global_batch}: {batch} per process x {processes} x {accumulation} accumulated "
            f"(data.batch_size {largest} at most){replaced}")


class GlobalBatch(Callback):
    """Checks that the run trains the global batch it was planned for, and continues a resumed epoch at the batch
    index of this run's batches (the saving run may have had others)."""

    def __init__(self, size: int, world_size: int, sync_batchnorm: bool = False):
        self.size, self.world_size, self.sync_batchnorm = size, world_size, sync_batchnorm

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.world_size != self.world_size:
            raise ConfigError(f"{FLAG}: planned for {self.world_size} processes, the Trainer runs "
                              f"{trainer.world_size}; give trainer.devices and trainer.num_nodes as numbers")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loader = trainer.train_dataloader
        sampler = getattr(loader, "sampler", None)
        if getattr(sampler, "global_batch", None) != self.size:
            raise ConfigError(f"{FLAG} needs the engine's training order (a map-style data set in a plain DataLoader, "
                              f"or an image data module's); the train loader here is {type(loader).__name__} with "
                              f"{type(sampler).__name__}: drop {FLAG}")
        batch, accumulation = loader.batch_size, trainer.accumulate_grad_batches
        if batch * trainer.world_size * accumulation != self.size:
            raise ConfigError(f"{FLAG} {self.size}: the train loader's batch_size is {batch}, expected "
                              f"{self.size // (trainer.world_size * accumulation)}: build it with the data module's "
                              "batch_size")
        position = sampler.resumed_position(trainer.current_epoch)
        if position:
            continue_epoch_at_batch(trainer, position // (batch * trainer.world_size))
        if not self.sync_batchnorm and per_device_batchnorm(pl_module):
            rank_zero_warn(f"{FLAG}: this model's BatchNorm layers normalise over each process's {batch} images, a "
                           "number that changes with the world size: samples and steps are the same at any world size, "
                           "the statistics are not (--trainer.sync_batchnorm=true normalises over "
                           f"{batch * trainer.world_size})")


def per_device_batchnorm(module: nn.Module) -> bool:
    """Whether any BatchNorm layer of `module` normalises over its own process's batch alone."""
    batchnorms = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    return any(isinstance(m, batchnorms) and not isinstance(m, GlooSyncBatchNorm) for m in module.modules())


def global_batch_of(trainer: Optional[L.Trainer]) -> Optional[int]:
    """The run's --global_batch_size, for the samplers (None: the world size's own batches)."""
    return next((c.size for c in getattr(trainer, "callbacks", ()) if isinstance(c, GlobalBatch)), None)
