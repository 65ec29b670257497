"""Slurm jobs: which job this process belongs to, and requeueing it (why not Lightning's own: docs/reliability.md).

    sbatch train.sbatch --config CONFIG   # a script running srun python -m ...; then: scancel --signal=USR1 <job id>
"""

import os
import signal
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
    """`scontrol requeue <job id>`: (whether Slurm took it, why not). The requeue cancels this job's step, which sends
    SIGTERM to every process of it, scontrol too: it ignores SIGTERM, or it may die (-15) before it says it was taken
    (seen in CI, 2026-12-06: the job requeued, the line said the requeue failed)."""
    try:
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
    except OSError as error:  # no scontrol on the compute node's PATH
        return False, str(error)
    return result.returncode == 0, f"exit {result.returncode}: {result.stderr.strip()}"
