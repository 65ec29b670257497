"""--global_batch_size at train start: the Trainer runs the world size the run plan planned for, and the train loader
takes the plan's batches in the engine's order (a resumed epoch continues at this run's batch index: samplers.py).

    python -m classifier_engine fit --config CONFIG --global_batch_size 1024 --ckpt_path last
"""

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from classifier_engine.errors import ConfigError
from classifier_engine.run.global_batch import FLAG
from classifier_engine.strategies.sync_batchnorm import GlooSyncBatchNorm


class GlobalBatch(Callback):
    """Checks that the run trains the global batch it was planned for."""

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
        if not self.sync_batchnorm and per_device_batchnorm(pl_module):
            rank_zero_warn(f"{FLAG}: this model's BatchNorm layers normalise over each process's {batch} images, a "
                           "number that changes with the world size: samples and steps are the same at any world size, "
                           "the statistics are not (--trainer.sync_batchnorm=true normalises over "
                           f"{batch * trainer.world_size})")


def per_device_batchnorm(module: nn.Module) -> bool:
    """Whether any BatchNorm layer of `module` normalises over its own process's batch alone."""
    batchnorms = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    return any(isinstance(m, batchnorms) and not isinstance(m, GlooSyncBatchNorm) for m in module.modules())
