"""Slurm jobs: which job this process belongs to, and requeueing it.

    sbatch slurm/train.sbatch --config configs/quickstart.yaml   # then: scancel --signal=USR1 <job id>

Inside a Slurm job (Lightning's SLURMEnvironment: launched by srun, job name not bash/interactive) a run writes to
<default_root_dir>/lightning_logs/slurm-<job id>/, which a requeued job (same id) finds again: project.engine.run.resume picks the
job's own newest checkpoint there. On SIGUSR1 (`#SBATCH --signal=SIGUSR1@90`, or `scancel --signal=USR1`) every
rank saves last.ckpt at the next agreed batch end, then the job requeues itself (project.engine.run.last_checkpoint
calls `requeue`). Lightning's own auto-requeue is switched off (`SLURMEnvironment(auto_requeue=False)`): it saves
from inside the signal handler, and a signal that reached one rank while the other waited in a DDP collective
deadlocked both here (Lightning #21406).
"""

import os
import subprocess
from typing import Optional

from lightning.fabric.plugins.environments import SLURMEnvironment


def slurm_job_id() -> Optional[str]:
    """The id a requeued job keeps (`<array id>_<task id>` for array tasks), or None outside a Slurm training job."""
    env = os.environ
    if "SLURM_JOB_ID" not in env or not SLURMEnvironment.detect():
        return None
    if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env["SLURM_JOB_ID"]


def slurm_restart_count() -> int:
    """How often Slurm requeued this job (0 on its first run)."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0"))


def cluster_environment() -> Optional[SLURMEnvironment]:
    """The cluster environment plugin of a Slurm job, with Lightning's own signal-handler requeue off; else None."""
    return SLURMEnvironment(auto_requeue=False) if slurm_job_id() is not None else None


def task_line(job_id: str, run_dir: object) -> str:
    """Where this task runs: the log then shows how the ranks were spread over the nodes."""
    env = os.environ
    return (f"Slurm job {job_id}: task {env.get('SLURM_PROCID', '?')} of {env.get('SLURM_NTASKS', '?')} "
            f"on node {env.get('SLURMD_NODENAME', '?')}, run dir {run_dir}")


def requeue(job_id: str) -> tuple[bool, str]:
    """`scontrol requeue <job id>`: (True, "") when Slurm took it, else (False, why)."""
    try:
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    except OSError as error:  # no scontrol on the compute node's PATH
        return False, str(error)
    if result.returncode != 0:
        return False, f"exit {result.returncode}: {result.stderr.strip()}"
    return True, ""
