"""--global_batch_size N: every optimizer step takes the same N samples at any world size, so a run stopped on 8 GPUs
continues exactly on 4 or 16 (docs/reliability.md#resuming-on-another-number-of-gpus): the planned world size and N's
split into per-process batch x accumulation (the run plan decides; callbacks/global_batch.py checks at train start).

    python -m classifier_engine fit --config CONFIG --global_batch_size 1024 --ckpt_path last
"""

import math
import os

import torch
from jsonargparse import Namespace
from lightning.fabric.plugins.environments import TorchElasticEnvironment

from classifier_engine.errors import ConfigError
from classifier_engine.run.slurm import slurm_job_id

FLAG = "--global_batch_size"


def planned_world(trainer: Namespace) -> tuple[int, str]:
    """(processes the Trainer runs, how found): the launcher's (srun, torchrun), else devices x num_nodes; dp is one."""
    if trainer.get("strategy") == "dp":
        return 1, "strategy dp: one process drives every device"
    if slurm_job_id() is not None:  # Lightning's own detection, in its order
        return int(os.environ["SLURM_NTASKS"]), f"srun: SLURM_NTASKS of job {slurm_job_id()}"
    if TorchElasticEnvironment.detect():
        if not os.environ.get("WORLD_SIZE", "").isdigit() or int(os.environ["WORLD_SIZE"]) < 1:
            raise ConfigError(f"a torchrun environment (TORCHELASTIC_RUN_ID, RANK, ...) without a WORLD_SIZE (got "
                              f"{os.environ.get('WORLD_SIZE')!r}): start the ranks with torchrun, or set WORLD_SIZE")
        return int(os.environ["WORLD_SIZE"]), "torchrun: WORLD_SIZE"
    devices, nodes = trainer.get("devices", "auto"), int(trainer.get("num_nodes") or 1)
    text = str(devices).replace(" ", "").strip("[],")
    of_nodes = f" x trainer.num_nodes {nodes}"
    if isinstance(devices, (list, tuple)) or "," in text:
        return len([index for index in text.split(",") if index]) * nodes, f"the GPUs trainer.devices lists{of_nodes}"
    if text.isdigit():
        return int(text) * nodes, f"trainer.devices {text}{of_nodes}"
    # "auto" and -1: every GPU there is; one process on CPU (Lightning's count for both)
    gpus = trainer.get("accelerator") not in ("cpu", "mps") and torch.cuda.is_available()
    found = f"{torch.cuda.device_count()} GPUs" if gpus else "one process on the CPU"
    return (torch.cuda.device_count() if gpus else 1) * nodes, f"trainer.devices {devices}: {found}{of_nodes}"


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
