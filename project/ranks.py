"""This process's global rank and the number of ranks, as the launcher's environment says, before any process group
exists: the error line names the rank, the run-dir lock and the resume plan need it at start-up. Imports nothing of
the project, so that project.errors can use it.
"""

import os


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
