"""Nothing lost, nothing run that should not be: atomic checkpoints (kill -9, full disk), untrusted checkpoints
refused on every load path, explicit flags kept over a checkpoint's, one writer per run dir, bounded hangs.

    python -m pytest tests/test_reliability.py --durations=0
"""

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import lightning as L
import pytest
import torch

from classifier_engine import ImageFolderDataModule
from classifier_engine.errors import CheckpointError, exit_on_user_error, user_message
from classifier_engine.export import main as export_main
from classifier_engine.run.checkpoint_io import AtomicCheckpointIO
from conftest import (
    CONFIGS,
    LIBRARY,
    callback,
    cli_main,
    last_line,
    new_model,
    project_in_process,
    start_project,
    tiny_args,
)
from local_services import free_port

LAST = "lightning_logs/version_0/checkpoints/last.ckpt"


@pytest.fixture(scope="module")
def trained(tiny_root, tmp_path_factory) -> Path:
    """A finished 2-epoch run (in-process): its root holds version_0 with last.ckpt and the best checkpoint."""
    root = tmp_path_factory.mktemp("trained")
    cli_main(["fit", *tiny_args(tiny_root, root, "--trainer.max_epochs=2")])
    return root


# -- atomic saves --------------------------------------------------------------------------------------------------

SAVE_LOOP = """
import sys, torch
from pathlib import Path
from classifier_engine.run.checkpoint_io import AtomicCheckpointIO
io, path = AtomicCheckpointIO(), Path(sys.argv[1])
for version in range(1000):
    io.save_checkpoint({"version": version, "weights": torch.full((24_000_000,), float(version))}, path)  # ~96 MB
    print(version, flush=True)
"""


@pytest.mark.slow  # another process
def test_kill_9_during_a_checkpoint_rewrite_leaves_the_previous_file_whole(tmp_path, tmpfs):
    # $TMPDIR on another filesystem than the run dir (the usual cluster layout) must not matter.
    env = {**os.environ, "TMPDIR": str(tmpfs("300m")), "PYTHONPATH": str(LIBRARY)}
    run = tmp_path / "run"
    run.mkdir()
    path = run / "last.ckpt"
    saver = subprocess.Popen([sys.executable, "-c", SAVE_LOOP, str(path)], env=env, stdout=subprocess.PIPE, text=True)
    assert saver.stdout.readline().strip() == "0"  # one complete save
    deadline = time.monotonic() + 300
    while not [p for p in run.glob(".last.ckpt.*.partial") if p.stat().st_size > 10_000_000]:
        assert time.monotonic() < deadline, "the second save never started writing"
        time.sleep(0.001)
    saver.kill()  # in the middle of rewriting last.ckpt
    saver.wait()
    saved = torch.load(path, weights_only=True)  # the previous checkpoint, whole
    assert saved["version"] in (0, 1) and torch.equal(saved["weights"],
                                                      torch.full((24_000_000,), float(saved["version"])))
    assert sorted(p.name for p in run.glob("*.ckpt")) == ["last.ckpt"]  # nothing partial under a checkpoint name
    AtomicCheckpointIO().save_checkpoint({"version": -1}, path)
    assert sorted(p.name for p in run.iterdir()) == ["last.ckpt"]  # the dead writer's temp file is cleaned up


def test_a_disk_that_fills_during_a_save_keeps_the_previous_checkpoint(tiny_root, tmp_path, tmpfs, capsys):
    # A checkpoint is ~2x the weights (with momentum; resnet18's ~90 MB): the first fits on 2.5x, a second beside it
    # does not. TensorBoard's writer thread may hit the full disk too: Lightning's clean-up then raises its OSError
    # (its flush), and the line is still the checkpoint's.
    weights = sum(t.numel() * t.element_size() for t in new_model(3).state_dict().values())
    disk = tmpfs(f"{(5 * weights // 2 + 32 * 1024) // 1024}k")
    args = tiny_args(tiny_root, disk, "--last_checkpoint.every_n_steps=1", "--trainer.max_epochs=1")
    with pytest.raises(SystemExit) as exited:
        exit_on_user_error(lambda: cli_main(["fit", *args]))
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert exited.value.code == 2 and line.startswith(f"error: no space left on {disk}/lightning_logs/version_0/"
                                                      "checkpoints while saving last.ckpt; the previous last.ckpt "
                                                      "(if any) is intact"), line
    last = disk / LAST
    assert torch.load(last, weights_only=True)["global_step"] == 1
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]


def test_a_ranks_error_note_in_the_temp_folder_never_writes_through_a_link_planted_at_its_name(tmp_path, monkeypatch,
                                                                                                 capsys):
    # Rank 1 of 2 fails with a user error; its note for the others goes to <tmp>/classifier-engine-error-<addr>-<port>-
    # <pid>, a name anyone on the host can guess: a link planted there must not make the line overwrite its target.
    import tempfile

    from classifier_engine import errors
    from classifier_engine.errors import ConfigError, _notes_of_failed_ranks

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(errors, "_rank", (1, 2))  # as record_rank(1, 2) in rank 1's start (an earlier test's, else)
    for name, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29411").items():
        monkeypatch.setenv(name, value)
    victim = tmp_path / "victim"
    victim.write_text("the user's file\n")
    note = tmp_path / f"classifier-engine-error-127.0.0.1-29411-{os.getpid()}"
    note.symlink_to(victim)

    def fails() -> None:
        raise ConfigError("data.batch_size must be >= 1, got 0")

    with pytest.raises(SystemExit) as exited:
        exit_on_user_error(fails)
    assert exited.value.code == 2 and victim.read_text() == "the user's file\n"
    assert not note.is_symlink() and note.stat().st_mode & 0o777 == 0o600  # a new file, for this user only
    assert _notes_of_failed_ranks(wait_s=0) == ["error (rank 1): data.batch_size must be >= 1, got 0"]
    assert capsys.readouterr().err.strip() == "error (rank 1): data.batch_size must be >= 1, got 0"


def test_a_ranks_error_note_removes_this_users_notes_a_day_old_and_keeps_the_others(tmp_path, monkeypatch, capsys):
    # Each failed ddp job left its ranks' notes in the temp folder for good (43 on this machine's /tmp).
    import tempfile

    from classifier_engine import errors
    from classifier_engine.errors import ConfigError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(errors, "_rank", (1, 2))
    for name, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29412").items():
        monkeypatch.setenv(name, value)
    old, recent, other = (tmp_path / f"classifier-engine-error-127.0.0.1-{port}-7" for port in (29413, 29414, 29415))
    for note in (old, recent):
        note.write_text("error (rank 0): a line\n")
    other.symlink_to(tmp_path)  # not a plain file: left as it is
    for path in (old, other):
        os.utime(path, (time.time() - 2 * 86400,) * 2, follow_symlinks=False)

    def fails() -> None:
        raise ConfigError("data.batch_size must be >= 1, got 0")

    with pytest.raises(SystemExit):
        exit_on_user_error(fails)
    capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([recent.name, other.name,
                                                                 f"classifier-engine-error-127.0.0.1-29412-{os.getpid()}"])


@pytest.mark.parametrize("padding", [0, 230])  # the URI whole, or its password across the 300 characters kept
def test_the_run_dirs_lock_names_its_command_line_without_a_uris_password(padding, tmp_path, monkeypatch):
    # .lock kept `python <argv>` as given, a tracking URI's password included, and a second start printed it.
    from classifier_engine.run.lock import claim

    monkeypatch.setattr(sys, "argv", ["x.py", "fit", "-" * padding,
                                      "--trainer.logger.init_args.tracking_uri=http://bob:PaSsW0rd9@127.0.0.1:5077"])
    claim(tmp_path / "run").release()
    held = (tmp_path / "run" / ".lock").read_text()
    assert "Pa" not in held and ("bob:***@" in held or padding), held


def test_a_file_written_whole_is_never_written_through_a_link_planted_at_its_temp_files_name(tmp_path):
    # atomic_write's temp file beside the target, .<name>.<host>-<pid>.partial, is a guessable name (in a shared
    # $TMPDIR: predictions rescued there); a link planted at it must not take the content.
    from classifier_engine.storage.files import atomic_write, partial_path

    victim = tmp_path / "victim"
    victim.write_text("the user's file")
    target = tmp_path / "predictions.csv"
    partial_path(target).symlink_to(victim)
    atomic_write(target, lambda file: file.write(b"path,class_1\n"))
    assert victim.read_text() == "the user's file" and target.read_bytes() == b"path,class_1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["predictions.csv", "victim"]


def test_a_full_disk_that_also_fails_lightnings_clean_up_is_still_the_runs_one_line():
    # The chain Lightning's _interrupt makes when a logger's flush fails on the same full disk after our error.
    with pytest.raises(OSError) as raised:
        try:
            raise CheckpointError("no space left on /runs while saving last.ckpt")
        except CheckpointError:
            raise OSError(errno.ENOSPC, "No space left on device")  # noqa: B904  (as Lightning's clean-up raises it)
    assert user_message(raised.value) == "no space left on /runs while saving last.ckpt"
    assert user_message(OSError(errno.ENOSPC, "No space left on device")) is None  # alone: not a user error


def test_last_skips_a_truncated_last_ckpt_and_resumes_from_the_good_one_beside_it(trained, tiny_root, tmp_path):
    import shutil

    root = tmp_path / "run"
    shutil.copytree(trained, root)
    checkpoints = root / "lightning_logs" / "version_0" / "checkpoints"
    (best,) = [p for p in checkpoints.glob("epoch*.ckpt")]
    (checkpoints / "last.ckpt").write_bytes((checkpoints / "last.ckpt").read_bytes()[:4096])
    before = (root / "lightning_logs" / "version_0" / "config.yaml").read_text()
    cli = cli_main(["fit", *tiny_args(tiny_root, root, "--trainer.max_epochs=3"), "--ckpt_path=last"])
    assert cli.trainer.ckpt_path == str(best)
    assert [path for path, _ in cli.started.skipped] == [checkpoints / "last.ckpt"]
    assert cli.trainer.global_step == 15
    assert (root / "lightning_logs" / "version_0" / "config.1.yaml").read_text() == before  # kept, not overwritten


# -- untrusted checkpoints -------------------------------------------------------------------------------------------

class Payload:
    """Unpickling it runs code (creates a file): what a crafted checkpoint does to torch.load(weights_only=False)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture
def crafted(trained, tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A real checkpoint with a code-running object added; torch.load's default was weights_only=False (torch < 2.6)."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    marker = tmp_path / "pwned"
    checkpoint = torch.load(trained / LAST, weights_only=True)
    checkpoint["hyper_parameters"]["payload"] = Payload(marker)
    path = tmp_path / "crafted.ckpt"
    torch.save(checkpoint, path)
    return path, marker


@pytest.mark.parametrize("subcommand", ["fit", "validate", "test", "predict"])
def test_a_crafted_checkpoint_is_refused_by_every_cli_subcommand(crafted, tiny_root, tmp_path, subcommand):
    path, marker = crafted
    with pytest.raises(CheckpointError, match=rf"{path} is not a trusted checkpoint: it holds pickled objects"):
        cli_main([subcommand, *tiny_args(tiny_root, tmp_path / "run"), f"--ckpt_path={path}"])
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_a_crafted_checkpoint_is_refused_by_load_from_checkpoint_and_the_trainer(crafted, tiny_root, tmp_path):
    path, marker = crafted
    # The library's data modules load weights-only; a plain LightningModule's load_from_checkpoint is Lightning's (a
    # template's model that loads weights-only is tested by the template).
    with pytest.raises(Exception, match="Weights only load failed"):
        ImageFolderDataModule.load_from_checkpoint(path)
    model = new_model(3)
    data = ImageFolderDataModule(root=str(tiny_root), batch_size=8, num_workers=0, train_crop_size=32,
                                 eval_resize_size=32, eval_crop_size=32)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                        plugins=[AtomicCheckpointIO()], default_root_dir=tmp_path)
    with pytest.raises(CheckpointError, match="is not a trusted checkpoint"):
        trainer.fit(model, data, ckpt_path=path)
    assert not marker.exists()


def test_export_refuses_a_crafted_checkpoint(crafted, trained, monkeypatch, capsys):
    # `python -m project export` as project/__main__.py runs it, in-process, where torch.load would unpickle anything
    # (torch reads TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD at each call): the user error's one line and exit 2, no traceback.
    path, marker = crafted
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    argv = [f"--ckpt_path={path}", f"--config={trained / 'lightning_logs/version_0/config.yaml'}"]
    capsys.readouterr()
    with mock.patch.dict(os.environ), pytest.raises(SystemExit) as exited:  # PL_GLOBAL_SEED stays out of what follows
        exit_on_user_error(lambda: export_main(argv))
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "not a trusted checkpoint" in lines[-1], err[-2000:]
    assert not marker.exists()


# -- explicit values and mismatched checkpoints -----------------------------------------------------------------------

def test_an_explicit_flag_wins_over_the_checkpoints_value_and_is_said(trained, tiny_root, tmp_path, caplog):
    import shutil

    root = tmp_path / "run"
    shutil.copytree(trained, root)
    cli = cli_main(["fit", *tiny_args(tiny_root, root, "--trainer.max_epochs=3", "--model.init_args.lr=0.8"),
                    f"--ckpt_path={root / LAST}"])
    assert cli.model.hparams.lr == 0.8
    assert "given instead: model.lr 0.8 (the checkpoint's: 0.05)" in caplog.text


def test_validate_with_another_network_than_the_checkpoint_stops_naming_both(trained, tiny_root, tmp_path):
    with pytest.raises(CheckpointError, match=r"holds another network \(its model.width is 16, this model's is 8\): "
                                              r"net.0.weight is \(16, 3, 3, 3\) there and \(8, 3, 3, 3\) here"):
        cli_main(["validate", *tiny_args(tiny_root, tmp_path / "run"), "--model.init_args.width=8",
                  f"--ckpt_path={trained / LAST}"])
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_of_other_data_names_both_class_counts(tiny_root, tmp_path):
    ten = new_model(10)
    path = tmp_path / "digits.ckpt"
    torch.save({"state_dict": ten.state_dict(), "epoch": 3, "global_step": 90,
                "hyper_parameters": dict(ten.hparams)}, path)
    with pytest.raises(CheckpointError,
                       match=rf"checkpoint {path} has 10 classes, the data has 3: "):
        cli_main(["validate", *tiny_args(tiny_root, tmp_path / "run"), f"--ckpt_path={path}"])


# -- one writer per run dir -------------------------------------------------------------------------------------------

def wait_until_stopped(process: subprocess.Popen, timeout: float = 120) -> None:
    """Until `process` is stopped (SIGSTOP: state T): alive, and holding whatever it holds, until SIGCONT."""
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
        if Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
            return
        time.sleep(0.2)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (DataLoader workers of a run)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
def test_a_second_fit_into_a_run_dir_in_use_stops_naming_the_first(trained, tiny_root, tmp_path, monkeypatch, capsys):
    import shutil

    root = tmp_path / "run"
    shutil.copytree(trained, root)
    args = ["fit", *tiny_args(tiny_root, root, "--trainer.max_epochs=3"), "--ckpt_path=last"]
    # The first stops itself after its first resumed step (trained ends at step 10) and stays stopped until the
    # second has exited: it provably holds the run dir the whole time, however long either takes to start. The
    # second is python -m project's entry point in this process (the lock is per process).
    first = start_project([*args, callback("stop_callbacks.SignalAtStep", step=11, signum=int(signal.SIGSTOP))])
    try:
        wait_until_stopped(first)
        code, _, second_err = project_in_process(args, monkeypatch, capsys)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    out, err = first.communicate(timeout=900)
    assert first.returncode == 0, err[-3000:]
    assert code == 2 and "Traceback" not in second_err
    assert f"run dir {root / 'lightning_logs' / 'version_0'} is in use by pid {first.pid} on" in second_err
    version = root / "lightning_logs" / "version_0"
    assert len(list(version.glob("events.out.tfevents.*"))) == 2  # the first fit's and the resumed one's, no third
    assert sorted(p.name for p in version.glob("config*.yaml")) == ["config.1.yaml", "config.yaml"]


@pytest.mark.slow
def test_kill_9_leaves_no_lock_behind_though_its_dataloader_workers_outlive_it(tiny_root, tmp_path, monkeypatch,
                                                                               capsys):
    # Workers forked after the lock was taken outlive a kill -9 of their parent (by ~5 s; stopped here, for as long
    # as the test needs): the lock must have died with the process that took it.
    args = ["fit", *tiny_args(tiny_root, tmp_path, "--trainer.max_epochs=2", "--data.num_workers=2",
                              "--last_checkpoint.every_n_steps=1")]
    first = start_project([*args, callback("stop_callbacks.SignalAtStep", step=2, signum=int(signal.SIGSTOP))])
    wait_until_stopped(first)  # mid-epoch, last.ckpt at step 2, its workers alive
    workers = children(first.pid)
    assert len(workers) >= 2, workers
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        first.kill()
        first.wait()
        code, _, resumed_err = project_in_process([*args, "--ckpt_path=last"], monkeypatch, capsys)  # in this process
        orphans = [pid for pid in workers if Path(f"/proc/{pid}").exists()]
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert orphans == workers  # they were there, holding whatever they inherited, during the whole second run
    assert code == 0, resumed_err[-3000:]
    assert "is in use" not in resumed_err
    assert torch.load(tmp_path / LAST, weights_only=True)["global_step"] == 10  # 2 epochs of 5 steps, resumed at 2


# -- bounded hangs -----------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_a_rank_that_stops_answering_or_dies_ends_the_ddp_job_with_a_message(tiny_root, tmp_path, how):
    signum = signal.SIGSTOP if how == "stopped" else signal.SIGKILL
    # Both ranks started together, as torchrun starts them, and warm (torchrun's variables are read when the Trainer
    # is built): they meet at the rendezvous at once, which shares the 15 s timeout (under Lightning's launcher rank 1
    # starts importing only once rank 0 has, and 15 s missed it on a loaded 2-core CI).
    env = dict(LOCAL_WORLD_SIZE="2", WORLD_SIZE="2", TORCHELASTIC_RUN_ID="t", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    args = ["fit", *tiny_args(tiny_root, tmp_path, "--trainer.max_epochs=3"), "--config", str(CONFIGS / "cpu_ddp.yaml"),
            "--ddp_timeout_minutes=0.25", callback("stop_callbacks.SignalAtStep", step=2, signum=int(signum), rank=1)]
    ranks = [start_project(args, env={**env, "RANK": str(rank), "GROUP_RANK": "0", "LOCAL_RANK": str(rank)},
                           fresh=False) for rank in (0, 1)]
    job = ranks[0]
    try:
        started = time.monotonic()
        job.wait(timeout=600)
        ended_after = time.monotonic() - started
    finally:
        for rank in ranks:
            rank.kill()  # a stopped rank 1 is still there
    err = job.communicate()[1]
    ranks[1].communicate()
    assert job.returncode != 0
    assert ended_after < 90, f"the job took {ended_after:.0f} s to end"
    assert last_line(err).startswith("stopped (rank 0): another rank failed or stopped answering"), err[-3000:]


def test_a_rank_that_never_joins_ends_the_others_at_the_timeout_with_a_message(tiny_root, tmp_path, monkeypatch,
                                                                               capsys):
    # Rank 0 of 2 as torchrun starts it; rank 1 never comes (its node failed to start): one line at the timeout (3 s).
    env = dict(RANK="0", GROUP_RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", WORLD_SIZE="2", TORCHELASTIC_RUN_ID="t",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = [*tiny_args(tiny_root, tmp_path), "--config", str(CONFIGS / "cpu_ddp.yaml"), "--ddp_timeout_minutes=0.05"]
    code, _, err = project_in_process(["fit", *args], monkeypatch, capsys)
    assert code == 1 and "Traceback" not in err
    assert last_line(err).startswith("stopped (rank 0): another rank failed or stopped answering (DistStoreError: "
                                     "Timed out after"), err[-3000:]


@pytest.mark.parametrize("flag, minutes", [([], 10), (["--ddp_timeout_minutes=0.5"], 0.5)])
def test_the_process_group_timeout_is_10_minutes_by_default_not_torchs_30(tiny_root, tmp_path, flag, minutes):
    from datetime import timedelta

    cli = cli_main([*tiny_args(tiny_root, tmp_path), "--config", str(CONFIGS / "cpu_ddp.yaml"), *flag], run=False)
    # DDPStrategy keeps the timeout it hands to init_process_group privately; there is no public accessor
    assert cli.trainer.strategy._timeout == timedelta(minutes=minutes)
