"""What started this process: torchrun, srun, Lightning's own ddp launcher, or a person; and whether the count fits.

Read from the environment, before any process group exists (the run-dir lock and the resume plan need the rank at
start-up). `check_process_count` refuses to run when an external launcher started a different number of processes
than the Trainer expects (seen here: `torchrun --nproc_per_node=2` with devices left at auto on CPU ran two
independent rank-0 jobs).
"""

import os
from typing import Optional

from project.errors import LauncherError


def env_global_rank() -> int:
    """This process's global rank as the launcher set it (torchrun RANK, Slurm SLURM_PROCID, Lightning's children
    NODE_RANK/LOCAL_RANK); 0 for a process started by hand, which is where Lightning's ddp launcher starts rank 0."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    env = os.environ
    if "RANK" in env:
        return int(env["RANK"])
    # Inside `srun --pty bash` Lightning's own children inherit SLURM_PROCID=0: only a Slurm *training* step counts.
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env and SLURMEnvironment.detect():
        return int(env["SLURM_PROCID"])
    local, node = int(env.get("LOCAL_RANK", 0)), int(env.get("NODE_RANK", env.get("GROUP_RANK", 0)))
    return local if node == 0 else node * max(1, int(env.get("LOCAL_WORLD_SIZE", 1))) + local


def env_world_size() -> int:
    """The number of ranks the launcher started (1 when unknown, e.g. before Lightning launches its children)."""
    env = os.environ
    for name in ("WORLD_SIZE", "SLURM_STEP_NUM_TASKS"):
        if name in env:
            return int(env[name])
    return 1


def torchelastic_restart() -> Optional[int]:
    """How often torchrun restarted this job's workers (0 on the first attempt), or None outside torchrun."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    return int(env.get("TORCHELASTIC_RESTART_COUNT", 0))


def launched_process_count() -> Optional[tuple[int, str]]:
    """(processes started, launcher) for torchrun/torchelastic or srun, else None (started by hand or by Lightning)."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env and "WORLD_SIZE" in env:
        return int(env["WORLD_SIZE"]), "torchrun"
    # Inside an srun step (not the batch script itself, which runs once per job whatever --ntasks says). Seen on
    # Slurm 22.05: SLURM_STEP_NUM_TASKS exists only in a step; SLURM_PROCID and SLURM_NTASKS exist in the batch script too.
    # DDP under srun takes its world size from SLURM_NTASKS, so there Lightning's own SLURMEnvironment.validate_settings
    # is what catches --ntasks-per-node != devices; this catches the single-device case, which it does not check.
    if "SLURM_STEP_NUM_TASKS" in env and "SLURM_PROCID" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return int(env["SLURM_STEP_NUM_TASKS"]), "srun"
    return None


def check_process_count(world_size: int, num_devices: int, num_nodes: int) -> None:
    """Raise if the launcher's process count differs from devices x nodes (duplicate rank-0 runs, or a hang)."""
    launched = launched_process_count()
    if launched is None:
        return
    count, launcher = launched
    if count != world_size:
        raise LauncherError(
            f"{launcher} started {count} processes but the Trainer expects {world_size} "
            f"(trainer.devices={num_devices} x trainer.num_nodes={num_nodes}). Make them agree: e.g. "
            f"--trainer.devices={max(1, count // max(1, num_nodes))} --trainer.num_nodes={num_nodes} with a distributed "
            f"strategy (--trainer.strategy=ddp), or start {world_size} process(es)."
            + (" Under slurm/train.sbatch, leave --trainer.devices/--trainer.num_nodes out: it sets them from"
               " the allocation (--ntasks-per-node, --nodes)." if launcher == "srun" else "")
        )
