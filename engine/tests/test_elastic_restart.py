"""torchrun: 2 processes train one job; with --max-restarts, a rank killed with -9 mid-epoch, the job restarted,
resumed from last.ckpt, same weights.

    python -m pytest tests/test_elastic_restart.py -q -p no:cacheprovider
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import APP, LIBRARY, QUICKSTART, project_env
from local_services import free_port

CPU_DDP = QUICKSTART.parent / "cpu_ddp.yaml"
STEPS_PER_EPOCH = 6


def torchrun(run_dir: Path, rdzv: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1", *rdzv,
               "-m", APP, "fit", "--config", str(QUICKSTART), "--config", str(CPU_DDP),
               "--trainer.max_epochs=2", f"--trainer.limit_train_batches={STEPS_PER_EPOCH}",
               "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false", "--data.num_workers=0",
               f"--trainer.default_root_dir={run_dir}", "--last_checkpoint.every_n_steps=2",
               "--last_checkpoint.check_every_n_steps=1", "--last_checkpoint.every_minutes=null",
               "--ddp_timeout_minutes=2"]
    return subprocess.Popen(command, cwd=LIBRARY, env=project_env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def worker_of_rank(agent: subprocess.Popen, rank: int) -> int | None:
    for child in Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split():
        try:
            if f"RANK={rank}".encode() in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
                return int(child)
        except FileNotFoundError:
            pass
    return None


def kill_rank_after_first_save(agent: subprocess.Popen, run_dir: Path, timeout: float = 240) -> int:
    """kill -9 rank 1 as soon as the first mid-epoch last.ckpt exists; the step that checkpoint holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and agent.poll() is None:
        found = list(run_dir.glob("lightning_logs/*/checkpoints/last.ckpt"))
        if found:
            step = torch.load(found[0], map_location="cpu", weights_only=True)["global_step"]
            pid = worker_of_rank(agent, 1)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            return step
        time.sleep(0.1)
    raise AssertionError("no last.ckpt before the job ended")


def finish(job: subprocess.Popen, timeout: float = 300) -> str:
    """The job's output once it ends; a job still running after `timeout` is killed with its workers."""
    try:
        return job.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        return job.communicate()[0] + f"\n(killed after {timeout} s)"


def final_weights(run_dir: Path) -> dict:
    (last,) = run_dir.glob("lightning_logs/*/checkpoints/last.ckpt")
    return torch.load(last, map_location="cpu", weights_only=True)


@pytest.mark.slow  # two torchrun jobs of 2 ranks: ~60 s + ~90 s on 2 loaded cores
def test_a_rank_killed_mid_epoch_restarts_resumes_and_ends_with_the_uninterrupted_weights(tmp_path):
    # The rendezvous the README recommends; the default static one restarts too with the fix (checked by hand: the
    # same weights), left out here for CI's time.
    def rdzv() -> list[str]:
        return ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]

    reference = torchrun(tmp_path / "reference", rdzv())
    out = finish(reference)
    assert reference.returncode == 0, out[-3000:]
    # torchrun's 2 processes trained one job, not 2 runs: one version dir, one writer
    assert len(list((tmp_path / "reference" / "lightning_logs").iterdir())) == 1
    assert len(list((tmp_path / "reference").rglob("events.out.tfevents.*"))) == 1

    job = torchrun(tmp_path / "killed", rdzv())
    try:
        step = kill_rank_after_first_save(job, tmp_path / "killed")
    finally:
        out = finish(job)  # unfixed, the restart hangs in gloo's connectFullMesh past the process-group timeout
    assert 0 < step < STEPS_PER_EPOCH  # killed mid-epoch, after a save
    assert job.returncode == 0, out[-3000:]
    assert "torchrun restart 1: resuming from" in out and "Restored all states" in out
    assert "connectFullMesh" not in out
    expected, got = final_weights(tmp_path / "reference"), final_weights(tmp_path / "killed")
    assert got["global_step"] == expected["global_step"] == 2 * STEPS_PER_EPOCH
    for key, value in expected["state_dict"].items():
        assert torch.equal(got["state_dict"][key], value), key
