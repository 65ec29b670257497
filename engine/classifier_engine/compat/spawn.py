"""ddp_spawn's launcher: the one use of a private launcher class."""

import lightning as L
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher


def spawns_ranks(trainer: L.Trainer) -> bool:
    """The trainer's launcher is ddp_spawn's: in the main process, it only spawns the ranks that train; in a training
    hook, this process is one of them (its trainer came pickled, with that launcher)."""
    return isinstance(trainer.strategy.launcher, _MultiProcessingLauncher)
