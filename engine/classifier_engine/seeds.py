"""Every random draw of a run derives from the run seed and *where* it happens, never from how far a process got.

    python -m classifier_engine fit --config CONFIG --seed_everything 7    # the run seed

Which draw takes which seed: docs/how-it-works.md#seeds.
"""

import lightning as L
import torch

_MASK = (1 << 64) - 1


def _mix(*values: int) -> int:
    """A 63-bit hash of the values (splitmix64 rounds): nearby inputs give unrelated seeds."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & _MASK)) & _MASK
        state = z = (state + 0x9E3779B97F4A7C15) & _MASK
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        state = z ^ (z >> 31)
    return state >> 1  # torch generators take seeds below 2**63


def sample_seed(run_seed: int, epoch: int, index: int, repeat: int = 0) -> int:
    """Seed of one image's augmentation; `repeat` tells apart the copies of repeated augmentation (ra_reps)."""
    return _mix(1, run_seed, epoch, index, repeat)


def batch_seed(run_seed: int, epoch: int, batch_index: int) -> int:
    """Seed of one training batch's draws (MixUp/CutMix): the same on every rank at the same batch index."""
    return _mix(2, run_seed, epoch, batch_index)


def step_seed(run_seed: int, epoch: int, batch_index: int, rank: int) -> int:
    """Seed of the model's random stream for one training batch (each micro-batch its own) on one rank."""
    return _mix(3, run_seed, epoch, batch_index, rank)


def order_seed(run_seed: int, epoch: int) -> int:
    """Seed of one epoch's training order (the shuffle shared by all ranks)."""
    return _mix(4, run_seed, epoch)


class StepSeed(L.Callback):
    """Seeds torch's CPU (and CUDA) generator with step_seed(seed, epoch, batch, rank) at every training batch start."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        seed = step_seed(self.seed, trainer.current_epoch, batch_idx, trainer.global_rank)
        torch.default_generator.manual_seed(seed)
        if pl_module.device.type == "cuda":
            torch.cuda.manual_seed(seed)
