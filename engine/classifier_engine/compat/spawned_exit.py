"""A rank that Lightning spawned (ddp_spawn) closes its process group at exit, while its interpreter is whole.

Lightning registers that exit handler for NCCL only (lightning.fabric.utilities.distributed._init_dist_connection); a
gloo rank left its group to the interpreter's teardown, where gloo's threads now and then abort the rank ("terminate
called without an active exception", SIGABRT: torch #190489): a ddp_spawn run stopped by SIGTERM exited 1, not 143.
Torchrun's and srun's ranks close theirs in classifier_engine/entry.py close_process_group.
"""

import atexit
import multiprocessing

import lightning as L
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback


class CloseSpawnedGroupAtExit(Callback):
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if multiprocessing.parent_process() is not None and dist.is_available() and dist.is_initialized():
            atexit.unregister(_close)  # once per process, however many runs it holds
            atexit.register(_close)


def _close() -> None:
    # No barrier: the ranks' last collective is behind them (a stop is agreed); a peer that died is the parent's
    # to reap (torch.multiprocessing ends the other ranks).
    if dist.is_initialized():
        dist.destroy_process_group()
