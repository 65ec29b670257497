"""Which checkpoint wins, and which run dir a run writes into: each row of README "Resume" (run/resume.py),
in-process.

    python -m pytest tests/test_which_checkpoint.py
"""

import multiprocessing
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from jsonargparse import Namespace

from classifier_engine.errors import CheckpointError
from classifier_engine.plan.make import plan_run


def write_checkpoint(path: Path, step: int, *, epoch: int = 0, mtime: float | None = None,
                     saved_at: float | None = None, batches: int | None = None) -> Path:
    """A small but complete Lightning-format checkpoint (the keys classifier_engine.run.resume checks, real tensors);
    `batches`: the training batches done, as Lightning's fit loop records them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    progress = {"total": {"ready": batches, "started": batches, "processed": batches, "completed": batches}}
    torch.save({"state_dict": {"network.w": torch.full((2,), float(step))}, "epoch": epoch, "global_step": step,
                "hyper_parameters": {"arch": "resnet18", "num_classes": 3},
                **({"saved_at": saved_at} if saved_at is not None else {}),
                **({"loops": {"fit_loop": {"epoch_loop.batch_progress": progress}}} if batches is not None else {})},
               path)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def fit_config(root: Path, ckpt_path=None, logger=None) -> Namespace:
    return Namespace(trainer=Namespace(default_root_dir=str(root), logger=logger), ckpt_path=ckpt_path,
                     checkpoint=Namespace(dirpath=None))


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    for name in [n for n in os.environ if n.startswith(("SLURM_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(name)


def test_without_ckpt_path_a_new_run_gets_the_next_version(tmp_path):
    (tmp_path / "lightning_logs" / "version_0").mkdir(parents=True)
    (tmp_path / "lightning_logs" / "version_4").mkdir()
    config = fit_config(tmp_path)
    plan = plan_run("fit", config)
    assert plan.ckpt_path is None and plan.fresh and plan.run_dir == tmp_path / "lightning_logs" / "version_5"
    assert config.trainer.logger.init_args.version == 5


def test_last_is_the_newest_checkpoint_of_any_run_and_continues_in_that_run(tmp_path):
    logs = tmp_path / "lightning_logs"
    write_checkpoint(logs / "version_0" / "checkpoints" / "last.ckpt", 5, mtime=time.time() - 100)
    newest = write_checkpoint(logs / "version_1" / "checkpoints" / "last.ckpt", 7)
    write_checkpoint(logs / "version_1" / "checkpoints" / "epoch000-val_acc1=0.5000.ckpt", 5, mtime=time.time() - 50)
    config = fit_config(tmp_path, "last")
    plan = plan_run("fit", config)
    assert plan.ckpt_path == newest and config.ckpt_path == str(newest)
    assert plan.run_dir == logs / "version_1" and not plan.fresh
    assert config.trainer.logger.init_args.version == 1
    assert plan.reason == f"--ckpt_path last: resuming from {newest}"


def test_last_goes_by_what_the_checkpoints_record_never_by_file_times(tmp_path):
    # cp -r resets every mtime: here the copy left the older best newer than last.ckpt, and the older run newest.
    logs, now = tmp_path / "lightning_logs", time.time()
    write_checkpoint(logs / "version_0" / "checkpoints" / "last.ckpt", 90, epoch=8, saved_at=now - 3600, mtime=now)
    checkpoints = logs / "version_1" / "checkpoints"
    last = write_checkpoint(checkpoints / "last.ckpt", 6, epoch=2, saved_at=now - 60, mtime=now - 100)
    write_checkpoint(checkpoints / "epoch001-val_acc1=0.7000.ckpt", 3, epoch=1, saved_at=now - 120, mtime=now - 10)
    assert plan_run("fit", fit_config(tmp_path, "last")).ckpt_path == last
    # a run's own checkpoints by their progress, whatever their clocks say (a requeue on another node)
    at_epoch_end = write_checkpoint(checkpoints / "epoch002-val_acc1=0.8000.ckpt", 6, epoch=2, saved_at=now - 30)
    further = write_checkpoint(checkpoints / "last.ckpt", 7, epoch=3, saved_at=now - 200)
    assert plan_run("fit", fit_config(tmp_path, "last")).ckpt_path == further
    further.unlink()
    write_checkpoint(checkpoints / "last.ckpt", 6, epoch=2, saved_at=now - 40)  # a tie: last.ckpt, saved after
    assert plan_run("fit", fit_config(tmp_path, "last")).ckpt_path == last != at_epoch_end


def test_last_among_checkpoints_older_than_saved_at_goes_by_steps_epochs_then_batches_never_by_file_times(tmp_path):
    logs, now = tmp_path / "lightning_logs", time.time()  # (written before checkpoints recorded when they were saved)
    furthest = write_checkpoint(logs / "version_0" / "checkpoints" / "epoch003-val_acc1=0.6000.ckpt", 8, epoch=3,
                                batches=32, mtime=now - 3600)
    write_checkpoint(logs / "version_1" / "checkpoints" / "last.ckpt", 6, epoch=3, batches=24, mtime=now)
    assert plan_run("fit", fit_config(tmp_path, "last")).ckpt_path == furthest
    # A stop between two optimizer steps (gradient accumulation): the same step and epoch, 3 batches further.
    ahead = write_checkpoint(logs / "version_1" / "checkpoints" / "last.ckpt", 8, epoch=3, batches=35, mtime=now - 7200)
    write_checkpoint(logs / "version_0" / "checkpoints" / "last.ckpt", 8, epoch=3, batches=32, mtime=now)
    assert plan_run("fit", fit_config(tmp_path, "last")).ckpt_path == ahead


def test_last_skips_a_truncated_or_crafted_newest_checkpoint_and_says_why(tmp_path):
    checkpoints = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    good = write_checkpoint(checkpoints / "epoch002-val_acc1=0.9000.ckpt", 12, mtime=time.time() - 60)
    truncated = write_checkpoint(checkpoints / "last.ckpt", 15, mtime=time.time() - 10)
    truncated.write_bytes(truncated.read_bytes()[:100])
    crafted = checkpoints / "crafted.ckpt"
    torch.save({"state_dict": {}, "epoch": 0, "global_step": 99, "payload": Path("/etc/passwd")}, crafted)
    (checkpoints / ".last.ckpt.12345.partial").write_bytes(b"half a save")  # a killed save's temp file
    plan = plan_run("fit", fit_config(tmp_path, "last"))
    assert plan.ckpt_path == good
    reasons = dict(plan.skipped)
    assert set(reasons) == {truncated, crafted}
    assert "is not a complete checkpoint (100 bytes" in reasons[truncated]
    assert "is not a trusted checkpoint" in reasons[crafted]
    assert f"skipped {truncated}" in plan.reason


def test_last_with_nothing_to_resume_starts_a_new_run(tmp_path):
    config = fit_config(tmp_path, "last")
    plan = plan_run("fit", config)
    assert plan.ckpt_path is None and config.ckpt_path is None and plan.fresh
    assert "no loadable checkpoint under" in plan.reason and plan.run_dir.name == "version_0"


def test_an_explicit_file_continues_its_own_run_or_starts_a_new_one_outside_the_root(tmp_path):
    inside = write_checkpoint(tmp_path / "lightning_logs" / "version_3" / "checkpoints" / "last.ckpt", 4)
    plan = plan_run("fit", fit_config(tmp_path, str(inside)))
    assert plan.run_dir == inside.parent.parent and not plan.fresh
    elsewhere = write_checkpoint(tmp_path / "downloads" / "resnet.ckpt", 4)
    plan = plan_run("fit", fit_config(tmp_path, str(elsewhere)))
    assert plan.ckpt_path == elsewhere and plan.fresh and plan.run_dir.name == "version_4"


def test_an_explicit_file_that_does_not_load_stops_the_run(tmp_path):
    jpeg = tmp_path / "photo.jpg"
    jpeg.write_bytes(b"\xff\xd8\xff\xe0" + bytes(200))
    with pytest.raises(CheckpointError, match=r"photo.jpg is not a (complete|) ?checkpoint"):
        plan_run("fit", fit_config(tmp_path, str(jpeg)))
    with pytest.raises(CheckpointError, match=r"nowhere.ckpt does not exist"):
        plan_run("validate", fit_config(tmp_path, str(tmp_path / "nowhere.ckpt")))


def test_a_torchrun_restart_resumes_as_last(tmp_path, monkeypatch):
    newest = write_checkpoint(tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt", 3)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert plan_run("fit", fit_config(tmp_path)).ckpt_path is None  # the first attempt starts afresh
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    plan = plan_run("fit", fit_config(tmp_path))
    assert plan.ckpt_path == newest and plan.reason.startswith("torchrun restart 1: resuming from")


def test_validate_with_last_and_no_checkpoint_is_an_error_not_random_weights(tmp_path):
    with pytest.raises(CheckpointError, match="--ckpt_path last: no loadable checkpoint under"):
        plan_run("validate", fit_config(tmp_path, "last"))


@pytest.mark.parametrize("logger", [
    Namespace(class_path="lightning.pytorch.loggers.WandbLogger", init_args=Namespace(project="x")), False])
def test_with_a_logger_that_writes_elsewhere_or_none_the_checkpoints_still_go_to_the_planned_run_dir(tmp_path, logger,
                                                                                                       monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # online, W&B's server must answer at start-up
    config = fit_config(tmp_path, logger=logger)
    plan = plan_run("fit", config)
    assert config.trainer.logger is logger  # left as configured
    assert plan.run_dir == tmp_path / "lightning_logs" / "version_0"
    assert config.checkpoint.dirpath is None  # placed at set-up: config.yaml names no run dir (a rerun is new)
    write_checkpoint(plan.run_dir / "checkpoints" / "last.ckpt", 5)
    again = fit_config(tmp_path, "last", logger=logger)
    assert plan_run("fit", again).ckpt_path == plan.run_dir / "checkpoints" / "last.ckpt"


def test_a_tensorboard_logger_with_its_own_save_dir_and_name_is_where_runs_are_found(tmp_path):
    def logger():
        return Namespace(class_path="lightning.pytorch.loggers.TensorBoardLogger",
                         init_args=Namespace(save_dir=str(tmp_path / "tb"), name="exp", version=None))

    first = plan_run("fit", config := fit_config(tmp_path, logger=logger()))
    assert first.run_dir == tmp_path / "tb" / "exp" / "version_0" and config.trainer.logger.init_args.version == 0
    newest = write_checkpoint(first.run_dir / "checkpoints" / "last.ckpt", 3)
    resumed = plan_run("fit", fit_config(tmp_path, "last", logger=logger()))
    assert resumed.ckpt_path == newest and resumed.run_dir == first.run_dir


def test_a_remote_root_the_cli_did_not_mirror_is_refused_in_one_line(tmp_path):
    from classifier_engine.errors import ConfigError

    # s3:// roots reach the plan as their node-local mirror (run/remote_runs.py); another scheme is one line
    with pytest.raises(ConfigError, match="trainer.default_root_dir gs://bucket/runs: runs write to a local or "
                                          "mounted filesystem, or to s3://bucket/prefix"):
        plan_run("fit", fit_config("gs://bucket/runs"))


def test_a_torchrun_restart_prefers_its_runs_newer_checkpoint_over_the_given_one(tmp_path, monkeypatch):
    checkpoints = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    given = write_checkpoint(checkpoints / "epoch010-val_acc1=0.5000.ckpt", 10, mtime=time.time() - 100)
    newer = write_checkpoint(checkpoints / "last.ckpt", 17)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert plan_run("fit", fit_config(tmp_path, str(given))).ckpt_path == given  # the first attempt: as given
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert plan_run("fit", fit_config(tmp_path, str(given))).ckpt_path == newer


def _start_and_hold(root: Path, barrier, results, release) -> None:
    barrier.wait()  # all at the same moment
    config = fit_config(root)
    plan = plan_run("fit", config, claim_run_dir=True)
    results.put((plan.run_dir.name, config.trainer.logger.init_args.version, os.getpid()))
    release.wait(60)  # holding the lock until every run has claimed
    plan.lock.release()


def test_fits_started_at_the_same_moment_each_claim_their_own_version_dir(tmp_path):
    (tmp_path / "lightning_logs" / "version_0").mkdir(parents=True)
    context = multiprocessing.get_context("fork")
    barrier, results, release = context.Barrier(4), context.Queue(), context.Event()
    runs = [context.Process(target=_start_and_hold, args=(tmp_path, barrier, results, release)) for _ in range(4)]
    for run in runs:
        run.start()
    try:
        claimed = sorted(results.get(timeout=300) for _ in runs)
        assert [name for name, _, _ in claimed] == ["version_1", "version_2", "version_3", "version_4"]
        for name, version, pid in claimed:
            assert name == f"version_{version}"  # the logger is pinned to the dir it claimed
            assert (tmp_path / "lightning_logs" / name / ".lock").read_text().startswith(f"pid {pid} ")
    finally:
        release.set()
        for run in runs:
            run.join(60)
    assert [run.exitcode for run in runs] == [0, 0, 0, 0]


def test_a_rerun_of_a_run_without_file_loggers_from_its_config_yaml_is_a_new_run(tiny_root, tmp_path):
    from conftest import cli_main, tiny_args

    short = ["--trainer.logger=false", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1"]
    first = cli_main(["fit", *tiny_args(tiny_root, tmp_path, *short)])
    run = tmp_path / "lightning_logs" / "version_0"
    assert first.started.run_dir == run and (run / "checkpoints" / "last.ckpt").is_file()
    cli_main(["fit", f"--config={run / 'config.yaml'}", "--trainer.max_epochs=1"])  # no --ckpt_path: a new run
    assert (tmp_path / "lightning_logs" / "version_1" / "checkpoints" / "last.ckpt").is_file()
    assert sorted(p.name for p in run.glob("config*.yaml")) == ["config.yaml"]  # the first run's, untouched


@pytest.mark.slow  # three short fits: ~20 s
def test_a_resume_under_a_relative_root_or_in_a_cp_r_copy_keeps_the_earlier_best_and_one_best_file(tiny_root, tmp_path,
                                                                                                     monkeypatch,
                                                                                                     recwarn):
    from conftest import cli_main, tiny_args

    monkeypatch.chdir(tmp_path)  # default_root_dir relative, as configs/quickstart.yaml has it
    short = ["--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1"]
    first = cli_main(["fit", *tiny_args(tiny_root, Path("runs"), *short)])
    earlier = first.trainer.checkpoint_callback.best_model_score
    original = tmp_path / "runs" / "lightning_logs" / "version_0" / "checkpoints"
    resumed = cli_main(["fit", *tiny_args(tiny_root, Path("runs"), *short, "--trainer.max_epochs=2"),
                        "--ckpt_path=last"])
    before = sorted(p.name for p in original.glob("*.ckpt"))
    # The run dir copied as `cp -r` does (new mtimes) and continued there: its checkpoints' records name the original.
    shutil.copytree(tmp_path / "runs", tmp_path / "copy", copy_function=shutil.copy)
    copied = cli_main(["fit", *tiny_args(tiny_root, Path("copy"), *short, "--trainer.max_epochs=3"),
                       "--ckpt_path=last"])
    assert sorted(p.name for p in original.glob("*.ckpt")) == before  # the copy's run never touches the original
    assert not [w for w in recwarn if "dirpath has changed" in str(w.message)]
    copy = tmp_path / "copy" / original.relative_to(tmp_path / "runs")
    for run, checkpoints in ((resumed, original), (copied, copy)):
        best = run.trainer.checkpoint_callback
        assert best.best_model_score >= earlier and Path(best.best_model_path).parent == checkpoints.resolve()
        kept = [p.name for p in checkpoints.glob("*.ckpt")]
        assert sorted(kept) == sorted(["last.ckpt", Path(best.best_model_path).name])  # one best, the best


def test_validate_and_predict_from_a_runs_config_yaml_write_their_own_records_not_into_the_run(tiny_root, tmp_path,
                                                                                                recwarn):
    from conftest import cli_main, read_scalars, tiny_args

    cli_main(["fit", *tiny_args(tiny_root, tmp_path, "--trainer.limit_train_batches=2")])
    run = tmp_path / "lightning_logs" / "version_0"
    files = sorted(p.relative_to(run) for p in run.rglob("*"))
    steps = {tag: [step for step, _ in values] for tag, values in read_scalars(run).items()}
    evaluation = [f"--config={run / 'config.yaml'}", f"--ckpt_path={run / 'checkpoints' / 'last.ckpt'}"]
    cli_main(["validate", *evaluation])  # the saved config names this run's logger
    cli_main(["predict", *evaluation])
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == files
    assert {tag: [step for step, _ in values] for tag, values in read_scalars(run).items()} == steps
    assert "val/acc1" in read_scalars(tmp_path / "lightning_logs" / "version_1")  # the validation's own
    assert (tmp_path / "lightning_logs" / "version_2" / "predictions.csv").is_file()
    assert not [w for w in recwarn if "dirpath has changed" in str(w.message)]  # the fit's bookkeeping stays the fit's


def test_a_requeued_job_resumes_from_its_own_newest_checkpoint_not_ckpt_path_nor_another_jobs(tmp_path, monkeypatch):
    """The rule behind a requeued job's resume, in-process: the env vars are the ones srun sets in a task."""
    for name in [name for name in os.environ if name.startswith("SLURM_")]:
        monkeypatch.delenv(name)  # the test itself may run inside a Slurm job
    given = write_checkpoint(tmp_path / "old" / "last.ckpt", step=1)
    other_job = write_checkpoint(tmp_path / "lightning_logs" / "slurm-6" / "checkpoints" / "last.ckpt", step=9)
    for name, value in {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train"}.items():
        monkeypatch.setenv(name, value)

    def plan(restarts: int):
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restarts))
        config = Namespace(trainer=Namespace(default_root_dir=str(tmp_path), logger=None), ckpt_path=str(given))
        return plan_run("fit", config), config

    this_job = tmp_path / "lightning_logs" / "slurm-7"
    first, config = plan(0)  # the first run: --ckpt_path as given, written into the job's own dir
    assert first.ckpt_path == given and first.run_dir == this_job
    assert config.trainer.logger.init_args.version == "slurm-7"
    older = write_checkpoint(this_job / "checkpoints" / "epoch000-val_acc1=0.5000.ckpt", step=3)
    newest = write_checkpoint(this_job / "checkpoints" / "last.ckpt", step=4)
    os.utime(older, (1, 1))
    requeued, config = plan(1)
    assert requeued.ckpt_path == newest and config.ckpt_path == str(newest)  # not --ckpt_path, not job 6's
    assert requeued.reason == f"Slurm job 7 (restart 1): resuming from {newest} instead of --ckpt_path {given}"
    assert other_job.exists()
