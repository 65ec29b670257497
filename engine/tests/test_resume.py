"""Resume exact to the batch: a run killed (-9) or stopped (SIGTERM) mid-epoch and resumed with `--ckpt_path last`
ends with the weights, optimizer state and step of an uninterrupted run, single process and ddp x2, with DataLoader
workers and the library's data ingredients on: auto-augment and erasing per image, repeated augmentation, and a
progressive-resizing ramp the kill lands in. (A template's model's own ingredients, MixUp/CutMix and its EMA: its
tests/test_resume.py.)

    python -m pytest engine/tests/test_resume.py --durations=0
"""

import gc
import signal
import warnings
from pathlib import Path

import pytest
import torch

from conftest import CONFIGS, NETWORK, callback, cli_main, read_scalars, run_project, start_project, tiny_args

# 40 images in batches of 8: 5 steps per epoch on one process, 2 per rank under ddp x2 (20 images each, the
# incomplete last batch dropped: data.drop_last).
EPOCHS = ["--trainer.max_epochs=3", "--trainer.check_val_every_n_epoch=3",
          "--data.auto_augment=trivialaugment_wide", "--data.random_erase_prob=0.5", "--data.ra_reps=2",
          # 24 px in epochs 0-1, 32 px in epoch 2: the kills below land in epoch 1
          "--data.progressive_resizing={start_size: 24, end_size: 32, start_epoch: 1, end_epoch: 2, multiple: 8}"]
WORKERS = ["--data.num_workers=2", "--data.persistent_workers=true"]
EVERY_STEP = ["--last_checkpoint.every_n_steps=1"]
CPU_DDP = ["--config", str(CONFIGS / "cpu_ddp.yaml")]
LAST = "lightning_logs/version_0/checkpoints/last.ckpt"


def with_csv(root: Path) -> str:
    """TensorBoard and CSV, both in the run dir (the CSV rows are what a kill -9 and a resume must keep)."""
    import json

    return "--trainer.logger=" + json.dumps([
        {"class_path": f"lightning.pytorch.loggers.{kind}", "init_args": {"save_dir": str(root)}}
        for kind in ("TensorBoardLogger", "CSVLogger")])


def assert_each_step_logged_once(root: Path, steps: int) -> None:
    """metrics.csv holds every step's train/loss once, as TensorBoard does, and the validations TensorBoard has."""
    import csv

    run_dir = root / "lightning_logs" / "version_0"
    rows = list(csv.DictReader((run_dir / "metrics.csv").open(newline="")))
    scalars = read_scalars(run_dir)
    for name in ("train/loss", "val/acc1"):
        assert [int(r["step"]) for r in rows if r.get(name)] == [step for step, _ in scalars[name]], name
    assert [step for step, _ in scalars["train/loss"]] == list(range(steps))


def final_state(path: Path) -> dict:
    """Step, epoch, network weights and momentum of a checkpoint file, or of <root>'s version_0/last.ckpt."""
    checkpoint = torch.load(path if path.is_file() else path / LAST, map_location="cpu", weights_only=True)
    momentum = checkpoint["optimizer_states"][0]["state"]
    network = lambda state: {k: v for k, v in state.items() if k.startswith(NETWORK)}  # noqa: E731
    return {"step": checkpoint["global_step"], "epoch": checkpoint["epoch"],
            "weights": network(checkpoint.get("current_model_state", checkpoint["state_dict"])),  # the trained ones
            "averaged": network(checkpoint["state_dict"]),  # the EMA's, when the run keeps one
            "momentum": {k: v["momentum_buffer"] for k, v in momentum.items()}}


def assert_same_training(resumed: dict, reference: dict, tolerance: float = 1e-6) -> None:
    assert resumed["step"] == reference["step"] and resumed["epoch"] == reference["epoch"]
    for part in ("weights", "averaged", "momentum"):
        a, b = resumed[part], reference[part]
        assert a.keys() == b.keys()
        floats = [k for k in b if b[k].is_floating_point()]
        diff = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in floats) ** 0.5
        norm = sum(float(b[k].double().pow(2).sum()) for k in floats) ** 0.5
        assert diff <= tolerance * norm, f"{part}: relative difference {diff / norm:.3e}"


def ok(result) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


@pytest.fixture(scope="module")
def reference(tiny_root, tmp_path_factory) -> dict:
    """The uninterrupted single-process run (in-process): 3 epochs, 15 steps, 2 workers."""
    run_dir = tmp_path_factory.mktemp("reference")
    cli_main(["fit", *tiny_args(tiny_root, run_dir, *EPOCHS, *WORKERS)])
    return final_state(run_dir)


@pytest.mark.slow
def test_kill_9_in_epoch_1_of_3_then_resume_ends_as_the_uninterrupted_run(tiny_root, tmp_path, reference):
    args = tiny_args(tiny_root, tmp_path, *EPOCHS, *WORKERS, with_csv(tmp_path))
    # last.ckpt after every step; kill -9 when step 8 starts: epoch 1, its 3rd batch, checkpoint at step 7.
    killed = run_project(["fit", *args, *EVERY_STEP, callback("stop_callbacks.SignalAtStep", step=7)])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    stopped = torch.load(tmp_path / LAST, map_location="cpu", weights_only=True)
    assert (stopped["global_step"], stopped["epoch"]) == (7, 1)
    with warnings.catch_warnings(record=True) as caught:  # the resume in this process: the kill needed a process
        warnings.simplefilter("always")
        cli_main(["fit", *args, "--ckpt_path=last"])
    assert not [w for w in caught if "resuming from a checkpoint that ended before the epoch ended" in str(w.message)]
    assert_same_training(final_state(tmp_path), reference)
    assert_each_step_logged_once(tmp_path, 15)  # Lightning writes each logged row at once: a kill -9 loses none


@pytest.mark.slow
def test_sighup_to_the_process_group_is_a_sigterm_saves_says_so_on_its_own_line_and_resumes_as_uninterrupted(
        tiny_root, tmp_path, reference):
    # A closed terminal: SIGHUP to the whole process group (DataLoader workers too) while the progress bar is drawn;
    # stdout and stderr in one stream, as a terminal shows them. The time trigger at every agreed step exercises the
    # timed save.
    args = tiny_args(tiny_root, tmp_path, *EPOCHS, *WORKERS)
    stop = [f"--last_checkpoint.every_minutes={1e-7}", "--trainer.enable_progress_bar=true",
            callback("stop_callbacks.SignalAtStep", step=4, signum=int(signal.SIGHUP), group=True)]
    run = start_project(["fit", *args, *stop], new_session=True, merge_stderr=True)
    out, _ = run.communicate(timeout=900)
    assert run.returncode == 143, out[-3000:]
    assert "Traceback" not in out
    (line,) = [line for line in out.split("\n") if "stopped by SIGHUP" in line]
    shown = line.split("\r")[-1]  # what stays visible of a line the bar redraws with carriage returns
    assert shown.startswith(f"stopped by SIGHUP (as SIGTERM) at epoch 0, global step 5; last checkpoint: "
                            f"{tmp_path / LAST}"), repr(line)
    cli_main(["fit", *args, "--ckpt_path=last"])  # the resume in this process
    assert_same_training(final_state(tmp_path), reference)


def test_sigint_saves_and_exits_130_in_process(tiny_root, tmp_path):
    args = tiny_args(tiny_root, tmp_path, "--trainer.max_epochs=2",
                     callback("stop_callbacks.SignalAtStep", step=2, signum=int(signal.SIGINT)))
    # Python's default_int_handler and SIG_DFL, unless this process was started ignoring them (a shell's `cmd &`)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        cli_main(["fit", *args])
    assert stopped.value.code == 130
    saved = torch.load(tmp_path / LAST, map_location="cpu", weights_only=True)
    assert saved["global_step"] == 3  # the signal came before step 3; that step's end saved and stopped
    from conftest import read_scalars

    logged = [step for step, _ in read_scalars(tmp_path / "lightning_logs" / "version_0")["train/loss"]]
    assert logged == [0, 1, 2]  # the stop step's train/loss too
    # every handler is back as it was before fit (not Lightning's, not ours): left behind, a SIGTERM handler
    # would keep a later multiprocessing.Pool.terminate() waiting forever
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_sigterm_without_checkpointing_stops_at_the_step_end_exits_143_and_saves_nothing(tiny_root, tmp_path, caplog):
    # enable_checkpointing=false: Lightning's own SIGTERM handling came back (exit 0; a broadcast every ddp step).
    args = tiny_args(tiny_root, tmp_path, "--trainer.max_epochs=2", "--trainer.enable_checkpointing=false",
                     callback("stop_callbacks.SignalAtStep", step=2, signum=int(signal.SIGTERM)))
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        cli_main(["fit", *args])
    assert stopped.value.code == 143
    assert "stopped by SIGTERM at epoch 0, global step 3; saved nothing (enable_checkpointing=false)" in caplog.text
    assert not list(tmp_path.rglob("*.ckpt"))
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


@pytest.fixture(scope="module")
def ddp_reference(tiny_root, tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("ddp_reference")
    ok(run_project(["fit", *tiny_args(tiny_root, run_dir, *EPOCHS, *WORKERS), *CPU_DDP]))
    return final_state(run_dir)


@pytest.mark.slow
def test_ddp_kill_9_mid_epoch_then_resume_ends_as_the_uninterrupted_run(tiny_root, tmp_path, ddp_reference):
    args = [*tiny_args(tiny_root, tmp_path, *EPOCHS, *WORKERS, with_csv(tmp_path)), *CPU_DDP]
    killed = run_project(["fit", *args, *EVERY_STEP, callback("stop_callbacks.SignalAtStep", step=3)])
    assert killed.returncode != 0
    stopped = torch.load(tmp_path / LAST, map_location="cpu", weights_only=True)
    assert (stopped["global_step"], stopped["epoch"]) == (3, 1)  # 2 steps per epoch: epoch 1, after its 1st batch
    ok(run_project(["fit", *args, "--ckpt_path=last"]))
    assert ddp_reference["step"] == 6
    assert_same_training(final_state(tmp_path), ddp_reference)
    assert_each_step_logged_once(tmp_path, 6)  # continue_csv_logs under ddp


def test_a_stop_signal_right_before_a_validation_waits_for_it_and_the_resumed_run_skips_nothing(tiny_root, tmp_path):
    from conftest import read_scalars

    # SIGTERM as the last batch of epoch 0 starts: the save waits until that epoch's validation has run.
    args = tiny_args(tiny_root, tmp_path, "--trainer.max_epochs=2")
    with pytest.raises(SystemExit) as stopped:
        cli_main(["fit", *args, callback("stop_callbacks.SignalAtStep", step=4, signum=int(signal.SIGTERM))])
    assert stopped.value.code == 143
    checkpoints = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    assert len(list(checkpoints.glob("epoch000-*.ckpt"))) == 1  # epoch 0 was validated before the stop
    cli_main(["fit", *args, "--ckpt_path=last"])
    validated = [step for step, _ in read_scalars(tmp_path / "lightning_logs" / "version_0")["val/acc1"]]
    assert validated == [4, 9]  # both epochs' validations, each once


@pytest.mark.slow
def test_ctrl_c_to_a_ddp_job_saves_once_on_every_rank_and_exits_130(tiny_root, tmp_path):
    # As a terminal does: SIGINT to the whole process group (both ranks, from rank 1's batch start at step 1).
    args = ["fit", *tiny_args(tiny_root, tmp_path, "--trainer.max_epochs=3", "--last_checkpoint.check_every_n_steps=1"),
            *CPU_DDP, callback("stop_callbacks.SignalAtStep", step=1, signum=int(signal.SIGINT), rank=1, group=True)]
    job = start_project(args, new_session=True)
    out, err = job.communicate(timeout=900)
    assert job.returncode == 130, err[-3000:]
    assert "stopped by SIGINT at epoch 0, global step 2" in out + err and "Traceback" not in err
    assert torch.load(tmp_path / LAST, map_location="cpu", weights_only=True)["global_step"] == 2


@pytest.mark.slow
def test_ddp_spawn_sigterm_to_the_main_process_saves_exits_143_and_the_resume_keeps_one_metrics_csv(tiny_root,
                                                                                                    tmp_path):
    import time

    # Under ddp_spawn the training runs in processes the main one spawned; `kill PID` reaches the main one alone.
    spawn = [*CPU_DDP, "--trainer.strategy=ddp_spawn"]
    args = [*tiny_args(tiny_root, tmp_path, "--trainer.max_epochs=2", with_csv(tmp_path)), *spawn]
    marker = tmp_path / "holding"
    job = start_project(["fit", *args, callback("stop_callbacks.HoldUntilSignalled", step=1, marker=str(marker))])
    deadline = time.monotonic() + 900
    while not marker.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=900)
    assert job.returncode == 143, err[-3000:]
    assert f"stopped by SIGTERM at epoch 0, global step 2; last checkpoint: {tmp_path / LAST}" in out + err, err[-3000:]
    assert "Traceback" not in err
    ok(run_project(["fit", *args, "--ckpt_path=last"]))
    # One run from the spawned ranks: one version, one config.yaml, 2 epochs of 2 steps (2 ranks x 2 full batches of
    # 8 of their 20 images, the last one dropped), each validated once.
    assert [p.name for p in (tmp_path / "lightning_logs").iterdir()] == ["version_0"]
    assert len(list(tmp_path.rglob("config.yaml"))) == 1
    assert torch.load(tmp_path / LAST, weights_only=True)["global_step"] == 4
    # continue_csv_logs under ddp_spawn: one metrics.csv, each step once, the steps TensorBoard holds
    assert_each_step_logged_once(tmp_path, 4)
    assert [step for step, _ in read_scalars(tmp_path / "lightning_logs" / "version_0")["val/acc1"]] == [1, 3]


def test_a_resumed_fit_keeps_of_its_checkpoint_only_the_state_the_optimizer_took_over(tiny_root, tmp_path):
    """The start's checkpoint is memory-mapped and handed to Lightning once: nothing of the start keeps the map (and the
    disk space of the last.ckpt that the run replaces) alive, only the optimizer's state, which torch adopts as loaded
    (SGD's momentum buffers on a CPU: Tensor.to without a copy)."""
    cli_main(["fit", *tiny_args(tiny_root, tmp_path, "--trainer.max_epochs=1")])
    cli = cli_main(["fit", *tiny_args(tiny_root, tmp_path, "--trainer.max_epochs=2"), "--ckpt_path=last"])
    gc.collect()
    spans = [[int(end, 16) for end in line.split()[0].split("-")] for line in Path("/proc/self/maps").read_text()
             .splitlines() if str(tmp_path / LAST) in line]
    mapped = {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor)
              and any(low <= o.untyped_storage().data_ptr() < high for low, high in spans)}
    adopted = {id(value) for optimizer in cli.trainer.optimizers for state in optimizer.state.values()
               for value in state.values() if isinstance(value, torch.Tensor)}
    assert mapped <= adopted, f"{len(mapped - adopted)} tensors of the start's checkpoint are still held"
