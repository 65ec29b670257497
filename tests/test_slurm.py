"""slurm/train.sbatch on a real two-node Slurm (tests/slurm_cluster.py): multi-node training (sharded: fsdp2),
preemption, requeue, resume (of a run on shards).

    bash .ci/install_slurm.sh && python -m pytest tests/test_slurm.py --durations=0

Every job is the project's own script with command-line overrides only: the quickstart config shrunk onto tiny data,
CPU, gloo, `sbatch --gpus-per-node=0` on a cluster that has no GPUs.
"""

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from classifier_engine.data.make_shards import main as make_shards

import slurm_cluster
from conftest import ENGINE_TESTS, REPO, callback, read_scalars, skip_if_deleted, tiny_args

skip_if_deleted("slurm")

SCRIPT = str(REPO / "slurm" / "train.sbatch")
TWO_NODES = ["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1"]
ONE_NODE = ["--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1"]
TWO_TASKS = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1"]
# 3 epochs of 5 steps (40 images over 2 ranks, batch 4), validation only after the last: long enough to be signalled
# while training, and val/acc1 is logged exactly once. The ranks agree on signals every 2 steps (default 10).
EPOCHS = ["--trainer.max_epochs=3", "--trainer.check_val_every_n_epoch=3", "--data.batch_size=4",
          "--last_checkpoint.check_every_n_steps=2"]
JOB_TIMEOUT = 900  # only reached on failure; a loaded 2-core machine needed up to 155 s for the preempted job


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = slurm_cluster.unavailable_reason()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the Slurm tests ({reason}); .ci/run installs Slurm with .ci/install_slurm.sh")
        pytest.skip(reason)
    cluster = slurm_cluster.start(tmp_path_factory.mktemp("slurm"))
    yield cluster
    slurm_cluster.stop(cluster)


def final_state(path: Path) -> dict:
    """Step, epoch, network weights and momentum of a checkpoint file, or of <root>'s version_0/last.ckpt."""
    checkpoint = torch.load(path if path.is_file() else path / "lightning_logs" / "version_0" / "checkpoints" /
                            "last.ckpt", map_location="cpu", weights_only=True)
    momentum = checkpoint["optimizer_states"][0]["state"]
    return {"step": checkpoint["global_step"], "epoch": checkpoint["epoch"],
            "weights": {k: v for k, v in checkpoint["state_dict"].items() if k.startswith("network.")},
            "momentum": {k: v["momentum_buffer"] for k, v in momentum.items()}}


def assert_same_training(resumed: dict, reference: dict, tolerance: float = 1e-6) -> None:
    assert resumed["step"] == reference["step"] and resumed["epoch"] == reference["epoch"]
    for part in ("weights", "momentum"):
        a, b = resumed[part], reference[part]
        floats = [k for k in b if b[k].is_floating_point()]
        diff = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in floats) ** 0.5
        norm = sum(float(b[k].double().pow(2).sum()) for k in floats) ** 0.5
        assert a.keys() == b.keys() and diff <= tolerance * norm, f"{part}: relative difference {diff / norm:.3e}"


def submit(slurm, sbatch_options: list[str], log: Path, args: list[str]) -> int:
    # tests/ importable in the job (stop_callbacks); sbatch exports the submitting environment to it
    path = os.pathsep.join(p for p in (str(ENGINE_TESTS), os.environ.get("PYTHONPATH", "")) if p)
    return slurm.sbatch(*sbatch_options, f"--output={log}", SCRIPT, *args, cwd=REPO, env={"PYTHONPATH": path})


def wait_for_file(path: Path, slurm, job_id: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        state = slurm.job(job_id).get("JobState")
        if state not in ("PENDING", "CONFIGURING", "RUNNING"):
            pytest.fail(f"job {job_id} ended ({state}) before writing {path}")
        if time.monotonic() > deadline:
            pytest.fail(f"{path} not written within {timeout:.0f} s")
        time.sleep(0.2)


def global_step(checkpoint: Path) -> int:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["global_step"]


@dataclass
class Job:
    id: int
    log: Path
    root: Path  # trainer.default_root_dir

    def text(self) -> str:
        # errors="replace": a progress bar cut mid-character by the requeue leaves a partial UTF-8 sequence
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def run_dir(self) -> Path:
        return self.root / "lightning_logs" / f"slurm-{self.id}"


@pytest.fixture(scope="module")
def jobs(slurm, tiny_root, tmp_path_factory) -> dict[str, Job]:
    """All jobs submitted at once, so imports, requeue delay and scheduling of one overlap the others' work.

    Each node offers 4 CPUs and every task takes one, so all of them run side by side.
    """
    out = tmp_path_factory.mktemp("jobs")
    # The two training jobs read the tiny images as shards (classifier_engine.ShardDataModule): its loader state is
    # the one a requeue must carry; the folder module's resumes are tested in test_resume.py. They train sharded
    # (fsdp2: the gather of its one-file checkpoint at the signal, the scatter at the resume); ddp is the same to
    # Slurm (the same cluster environment and launch) and is tested on every other multi-process path.
    assert make_shards(["--source", str(tiny_root), "--out", str(out / "shards"), "--shard-size", "8"]) == 0
    shards = [*EPOCHS, "--data.class_path=classifier_engine.data.ShardDataModule",
              f"--data.init_args.shards={out / 'shards'}",
              "--config", str(REPO / "configs" / "fsdp.yaml")]
    specs = {
        "uninterrupted": (TWO_NODES, tiny_args(None, out / "uninterrupted", *shards)),
        # Held as step 7 (epoch 1) starts until the signal has arrived: it cannot finish before the test signals it.
        "preempted": (TWO_NODES, tiny_args(None, out / "preempted", *shards, "--trainer.enable_progress_bar=true",
                                           callback("stop_callbacks.HoldUntilSignalled", step=7,
                                                    marker=str(out / "preempted.held")))),
        # Two tasks on the node, but the user pins the Trainer to one device: two independent rank-0 runs, unless
        # stopped.
        "mismatch": (TWO_TASKS, tiny_args(tiny_root, out / "mismatch", "--trainer.devices=1")),
        "no_data": (ONE_NODE, tiny_args(out / "no-such-dir", out / "no_data")),
    }
    submitted = {}
    for name, (options, args) in specs.items():
        log = out / f"{name}.out"
        submitted[name] = Job(submit(slurm, options, log, args), log, out / name)
    return submitted


@pytest.mark.slurm
@pytest.mark.slow
def test_preempted_job_checkpoints_requeues_and_resumes_to_the_weights_of_an_uninterrupted_job(slurm, jobs):
    job = jobs["preempted"]
    # Mid-training: epoch 0 is done, rank 0 is held at step 7 of 15 until the signal reaches it.
    wait_for_file(job.root.parent / "preempted.held", slurm, job.id, timeout=JOB_TIMEOUT)
    slurm.command("scancel", "--signal=USR1", str(job.id))
    record = slurm.wait_until_done(job.id, JOB_TIMEOUT)
    text = job.text()
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", text
    assert record["Restarts"] == "1", text

    run_dir = job.run_dir()
    last = run_dir / "checkpoints" / "last.ckpt"
    assert re.search(rf"Slurm job {job.id}: SIGUSR1 at epoch \d, global step \d+; saved {re.escape(str(last))}; "
                     "requeued, it resumes there", text), text
    assert f"job {job.id} restart 1:" in text, "the script's header of the requeued run is missing"
    assert f"Slurm job {job.id} (restart 1): resuming from {last}" in text, text
    assert f"Restored all states from the checkpoint at {last}" in text, text
    saved_at = int(re.search(r"SIGUSR1 at epoch \d, global step (\d+)", text).group(1))
    assert 5 < saved_at < 15, "the signal should have landed in epoch 1 or 2, after a whole batch"

    # The requeued run wrote into the same run dir and ended with the uninterrupted job's weights.
    assert sorted(p.name for p in (job.root / "lightning_logs").iterdir()) == [run_dir.name]
    reference = jobs["uninterrupted"]
    assert slurm.wait_until_done(reference.id, JOB_TIMEOUT)["JobState"] == "COMPLETED", reference.text()
    assert_same_training(final_state(last), final_state(reference.run_dir() / "checkpoints" / "last.ckpt"))
    logged = {tag: {step for step, _ in values} for tag, values in read_scalars(run_dir).items()}
    expected = {tag: {step for step, _ in values} for tag, values in read_scalars(reference.run_dir()).items()}
    assert logged["val/acc1"] == expected["val/acc1"]
    # Same curve steps; only the preempted step's own train metrics are missing (the run stopped at its end).
    assert expected["train/loss"] - logged["train/loss"] <= {saved_at - 1}
    assert logged["train/loss"] <= expected["train/loss"]


@pytest.mark.slurm
@pytest.mark.slow
def test_two_node_job_trains_one_sharded_run_over_both_nodes(slurm, jobs):
    job = jobs["uninterrupted"]
    record = slurm.wait_until_done(job.id, JOB_TIMEOUT)
    log = job.text()
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", log
    assert record["NodeList"] == "n[1-2]" and record["Restarts"] == "0"
    assert "Starting with 2 processes" in log and "distributed_backend=gloo" in log
    for rank, node in ((0, "n1"), (1, "n2")):
        assert f"Slurm job {job.id}: task {rank} of 2 on node {node}" in log
        assert f"GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/2" in log
    # One writer: one run dir, pinned to the job, with one config and one checkpoint set.
    run_dir = job.run_dir()
    assert [p.name for p in (job.root / "lightning_logs").iterdir()] == [run_dir.name]
    assert sorted(p.name for p in run_dir.glob("*.yaml")) == ["config.yaml", "hparams.yaml", "plan.yaml"]
    assert "  strategy: fsdp2\n" in (run_dir / "config.yaml").read_text()
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert len(checkpoints) == 2 and "last.ckpt" in checkpoints, checkpoints
    assert not list(job.root.rglob("hpc_ckpt_*.ckpt"))
    assert len(read_scalars(run_dir)["val/acc1"]) == 1


@pytest.mark.slurm
@pytest.mark.slow
def test_task_count_not_matching_devices_x_nodes_stops_at_start_up(slurm, jobs):
    job = jobs["mismatch"]
    record = slurm.wait_until_done(job.id, JOB_TIMEOUT)
    log = job.text()
    assert record["JobState"] == "FAILED" and record["ExitCode"] != "0:0", log
    assert "srun started 2 processes but the Trainer expects 1" in log, log
    assert "Starting with" not in log  # stopped before any rendezvous


@pytest.mark.slurm
@pytest.mark.slow
def test_missing_data_root_fails_fast_with_the_data_module_error(slurm, jobs):
    job = jobs["no_data"]
    record = slurm.wait_until_done(job.id, JOB_TIMEOUT)
    log = job.text()
    assert record["JobState"] == "FAILED" and record["ExitCode"] != "0:0", log
    assert re.search(r"error: data root \S*no-such-dir does not exist", log), log
    assert "Traceback" not in log
    assert "Starting with" not in log


@pytest.mark.slurm
@pytest.mark.slow
def test_sweep_sbatch_runs_a_study_whose_trials_are_job_steps(slurm, tmp_path):
    """slurm/sweep.sbatch as the README submits it: a worker per array task, each trial an `srun` step."""
    import optuna

    root, log = tmp_path / "runs", tmp_path / "sweep-%a.out"
    args = ["--config", "configs/sweep/quickstart.yaml", f"--trainer.default_root_dir={root}", "--sweep.n_trials=1",
            "--trainer.max_epochs=1", "--trainer.limit_train_batches=2"]
    job_id = slurm.sbatch("--array=0", *ONE_NODE, f"--output={log}", str(REPO / "slurm" / "sweep.sbatch"), *args,
                          cwd=REPO)
    record = slurm.wait_until_done(f"{job_id}_0", JOB_TIMEOUT)
    text = (tmp_path / "sweep-0.out").read_text(errors="replace")
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", text
    assert "--sweep.launcher=srun --kill-on-bad-exit=1 --trainer.num_nodes=1 --trainer.devices=1" in text
    assert text.strip().splitlines()[-1].startswith("best trial 0: val/acc1 "), text[-2000:]
    journal = optuna.storages.journal.JournalFileBackend(str(root / "sweeps" / "quickstart" / "journal.log"))
    trial = optuna.load_study(study_name="quickstart", storage=optuna.storages.JournalStorage(journal)).trials[0]
    assert trial.state.name == "COMPLETE"
    fit_log = (Path(trial.user_attrs["run_dir"]) / "fit.log").read_text()
    assert f"Slurm job {job_id}_0: task 0 of 1 on node n1, run dir {trial.user_attrs['run_dir']}" in fit_log
