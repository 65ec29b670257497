"""Slurm jobs: one run directory per job, and preemption -> checkpoint -> requeue -> resume.

    sbatch slurm/train.sbatch --config configs/quickstart.yaml   # then: scancel --signal=USR1 <job id>

Inside a Slurm job (Lightning's SLURMEnvironment: launched by srun, job name not bash/interactive) a run writes to
<default_root_dir>/lightning_logs/slurm-<job id>/: TensorBoard events, config.yaml, checkpoints/ and the preemption
checkpoints hpc_ckpt_N.ckpt. A requeued job keeps its id, so it finds the same directory, and no other job can pick up
this one's preemption checkpoint (Lightning resumes from any hpc_ckpt_N.ckpt in default_root_dir, so default_root_dir
is pointed at the run directory too). In `fit`, the newest preemption checkpoint of the job wins over --ckpt_path
(which the requeued job is given again: it is the same command line), and says so.

On SIGUSR1 (`#SBATCH --signal=SIGUSR1@90`, or `scancel --signal=USR1`) RequeueOnSignal saves hpc_ckpt_N.ckpt and
requeues the job. It replaces Lightning's handler, which saves from inside the signal handler with a barrier, wherever
each rank happens to be: seen here (2 nodes, gloo) a signal that reached one rank while the other waited in a DDP
collective deadlocked both, and the job hung instead of requeueing.
"""

import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Optional

import lightning as L
from jsonargparse import Namespace
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from project.run_dir import LOGS, pin_logger_version



def slurm_job_id() -> Optional[str]:
    """The id a requeued job keeps (`<array id>_<task id>` for array tasks), or None outside a Slurm training job."""
    env = os.environ
    if "SLURM_JOB_ID" not in env or not SLURMEnvironment.detect():
        return None
    if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env["SLURM_JOB_ID"]


def job_run_dir(default_root_dir: str | Path, job_id: str) -> Path:
    return Path(default_root_dir) / LOGS / f"slurm-{job_id}"


def preemption_checkpoint(run_dir: Path) -> Optional[Path]:
    """The highest-numbered preemption checkpoint hpc_ckpt_N.ckpt in `run_dir`, if any."""
    numbered = [(number, p) for p in run_dir.glob("hpc_ckpt_*.ckpt") if (number := _hpc_number(p)) is not None]
    return max(numbered)[1] if numbered else None


def _hpc_number(path: Path) -> Optional[int]:
    match = re.fullmatch(r"hpc_ckpt_(\d+)\.ckpt", path.name)
    return int(match.group(1)) if match else None


def pin_run_to_slurm_job(config: Namespace, subcommand: str) -> Optional[Path]:
    """Point the run (logger version, default_root_dir) at the job's run dir and pick the checkpoint to resume from.

    Edits the parsed `config` of `subcommand` in place before anything is instantiated; returns the run dir, or None
    outside Slurm (nothing changed).
    """
    job_id = slurm_job_id()
    if job_id is None:
        return None
    trainer = config.trainer
    root = Path(trainer.default_root_dir or os.getcwd())
    run_dir = job_run_dir(root, job_id)
    pin_logger_version(trainer, root, run_dir.name)
    trainer.default_root_dir = str(run_dir)

    if subcommand == "fit":
        resume = preemption_checkpoint(run_dir)
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        last = run_dir / "checkpoints" / "last.ckpt"
        if resume is None and restarts > 0 and last.is_file():
            # Requeued without a preemption checkpoint (node failure, or killed before it was written).
            resume = last
        if resume is not None:
            given = config.ckpt_path and Path(config.ckpt_path) != resume
            instead = f" instead of --ckpt_path {config.ckpt_path}" if given else ""
            rank_zero_info(f"Slurm job {job_id} (restart {restarts}): resuming from {resume}{instead}")
            config.ckpt_path = str(resume)
    env = os.environ
    # Every task says where it runs: the log then shows how ranks were spread over the nodes.
    print(f"Slurm job {job_id}: task {env.get('SLURM_PROCID', '?')} of {env.get('SLURM_NTASKS', '?')} "
          f"on node {env.get('SLURMD_NODENAME', '?')}, run dir {run_dir}", flush=True)
    return run_dir


class RequeueOnSignal(L.Callback):
    """On SIGUSR1, at the next training batch end and on every rank together: save hpc_ckpt_N.ckpt, requeue, stop.

    The signal handler only sets a flag. Each batch end the ranks agree on it (any rank signalled), so all of them save
    at the same step, through the same collectives, at a batch boundary (as ModelCheckpoint(every_n_train_steps) does),
    which Lightning resumes at the same global step. The cost is one tiny all-reduce per step. Installed in setup(),
    before Lightning sets its handlers: Lightning then leaves SIGUSR1 to this one. Does nothing outside a Slurm job.
    """

    def __init__(self, signum: int = signal.SIGUSR1):
        self.signum = signum
        self._signalled = False
        self._active = False
        self._previous = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or slurm_job_id() is None:
            return
        self._signalled = False
        self._previous = signal.signal(self.signum, self._on_signal)
        self._active = True
        rank_zero_info(f"Slurm job {slurm_job_id()}: on {signal.Signals(self.signum).name} the job checkpoints into "
                       f"{trainer.default_root_dir} and requeues itself")

    def _on_signal(self, signum, frame) -> None:
        self._signalled = True

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if not self._active or not trainer.strategy.reduce_boolean_decision(self._signalled, all=False):
            return
        job_id = slurm_job_id()
        run_dir = Path(trainer.default_root_dir)
        latest = preemption_checkpoint(run_dir)
        # Lightning's naming, so Lightning's own ckpt_path="hpc" finds it too.
        path = run_dir / f"hpc_ckpt_{_hpc_number(latest) + 1 if latest else 1}.ckpt"
        trainer.save_checkpoint(path)
        rank_zero_info(f"Slurm job {job_id}: signalled; saved {path} at global step {trainer.global_step}")
        failed = False
        if trainer.is_global_zero:
            try:
                result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
                failed, why = result.returncode != 0, f"{result.returncode}: {result.stderr.strip()}"
            except OSError as error:  # no scontrol on the compute node's PATH
                failed, why = True, str(error)
            if failed:
                rank_zero_warn(
                    f"scontrol requeue {job_id} failed ({why}); the job was "
                    f"submitted without --requeue or the cluster forbids it. Resume by hand: submit again with "
                    f"--ckpt_path {path}"
                )
            else:
                rank_zero_info(f"Slurm job {job_id}: requeued; it resumes from {path}")
        # Stop here on every rank: Slurm ends this run anyway, and further steps would only be lost.
        raise SystemExit(1 if failed else 0)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._active:
            signal.signal(self.signum, self._previous if self._previous is not None else signal.SIG_DFL)
            self._active = False
