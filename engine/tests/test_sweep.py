"""Sweeps (classifier_engine/run/sweep.py, sweep_trials.py) on configs/sweep.yaml over configs/quickstart.yaml: workers
share a study, each trial a real fit of the contract's Top1Net whose value is the best val/acc1 its TensorBoard events
hold; pruned, diverged, preempted and killed trials; bad input is one line before any trial; the journal survives a
record cut short and a full disk.

    python -m pytest engine/tests/test_sweep.py -m "not slow"      # bad input, the journal, the plot: in-process
    python -m pytest engine/tests/test_sweep.py --durations=0
"""

import csv
import os
import re
import signal
import time
from pathlib import Path

import optuna
import pytest
import torch

from classifier_engine.errors import DiskFullError, exit_on_user_error
from classifier_engine.run.sweep import legible_parallel_coordinates
from classifier_engine.run.sweep import main as sweep_main
from classifier_engine.run.sweep_trials import open_storage
from conftest import CONFIGS, QUICKSTART, callback, cli_main, project_env, read_scalars, run_project, start_project

SWEEP = CONFIGS / "sweep.yaml"
STUDY = SWEEP.stem  # a study is named after its sweep file
FAST_HEARTBEAT = ["--sweep.heartbeat_interval=1", "--sweep.grace_period=4"]
NEVER_GOOD_ENOUGH = "--sweep.pruner={class_path: optuna.pruners.ThresholdPruner, init_args: {lower: 1.1}}"


def sweep_args(root: Path, *extra: str) -> list[str]:
    return ["sweep", "--config", str(QUICKSTART), "--config", str(SWEEP), f"--trainer.default_root_dir={root}", *extra]


@pytest.fixture
def trials_see_the_suite(monkeypatch):
    """A worker in this process: its trials (`python -m classifier_engine fit`, new processes) import plain_model from
    tests/ as the suite's own processes do."""
    monkeypatch.setenv("PYTHONPATH", project_env()["PYTHONPATH"])


def load_study(root: Path, storage=None) -> optuna.Study:
    """The study in its default storage (the journal in the study dir), or in `storage` (an RDB URL)."""
    if storage is None:
        journal = optuna.storages.journal.JournalFileBackend(str(root / "sweeps" / STUDY / "journal.log"))
        storage = optuna.storages.JournalStorage(journal)
    return optuna.load_study(study_name=STUDY, storage=storage)


def csv_rows(root: Path) -> dict[int, dict]:
    with open(root / "sweeps" / STUDY / "trials.csv") as file:
        return {int(row["number"]): row for row in csv.DictReader(file)}


def logged_acc1(run_dir: Path) -> list[tuple[int, float]]:
    """val/acc1 as the trial's TensorBoard events hold it: (step, value) per validation, across every start."""
    return read_scalars(run_dir)["val/acc1"]


def ok(result) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


def assert_value_is_the_logs_best(trial, row: dict) -> list[tuple[int, float]]:
    logged = logged_acc1(Path(trial.user_attrs["run_dir"]))
    steps = [step for step, _ in logged]
    assert len(steps) == len(set(steps)), f"trial {trial.number}: a validation logged twice (run twice?): {logged}"
    best = max(value for _, value in logged)
    assert float(row["value"]) == best
    if trial.state == optuna.trial.TrialState.COMPLETE:
        assert trial.value == best
    return logged


@pytest.mark.slow
def test_two_workers_share_a_study_of_4_trials_none_run_twice_values_are_the_logs_best(tiny_root, tmp_path, capsys,
                                                                                       trials_see_the_suite):
    # A worker whose trial ended waits for the other's with a nap of min(heartbeat_interval, 5 s): 1 s here. The
    # trials fit the tiny images (17 to validate, not the digits' 355).
    args = sweep_args(tmp_path, "--sweep.n_trials=4", "--sweep.heartbeat_interval=1", "--trainer.max_epochs=2",
                      f"--data.root={tiny_root}")
    workers = [start_project(args) for _ in range(2)]
    outputs = [worker.communicate(timeout=1800) for worker in workers]
    for worker, (out, err) in zip(workers, outputs):
        assert worker.returncode == 0, f"{out[-2000:]}\n{err[-3000:]}"

    study = load_study(tmp_path)
    trials = study.trials
    assert sorted(t.state.name for t in trials if t.state.name != "PRUNED") == ["COMPLETE"] * (4 - sum(
        t.state.name == "PRUNED" for t in trials)), [t.state.name for t in trials]
    assert len(trials) == 4
    started = [[int(n) for n in re.findall(r"^sweep: trial (\d+) \(", out, re.M)] for out, _ in outputs]
    assert all(started), f"a worker ran no trial: {started}"
    assert sorted(started[0] + started[1]) == [0, 1, 2, 3]  # each trial started once, by one of the workers
    assert len({t.user_attrs["run_dir"] for t in trials}) == 4

    rows = csv_rows(tmp_path)
    for trial in trials:
        assert_value_is_the_logs_best(trial, rows[trial.number])
        assert rows[trial.number]["state"] == trial.state.name
        assert Path(rows[trial.number]["run_dir"], "config.yaml").is_file()
        if trial.state.name == "COMPLETE":  # its best checkpoint: the model's Monitor maximizes val/acc1
            assert Path(trial.user_attrs["checkpoint"]).name.endswith(f"val_acc1={trial.value:.4f}.ckpt"), trial
    assert list((tmp_path / "sweeps" / STUDY).glob("*.png"))

    best = max((t for t in trials if t.state.name == "COMPLETE"), key=lambda t: t.value)
    best_line = f"best trial {best.number}: val/acc1 {best.value:.4f} with "
    for out, _ in outputs:  # a worker stops once the study has its 4 trials: both print the final summary
        assert out.strip().splitlines()[-1].startswith(best_line), out[-1500:]
    assert f"checkpoint {best.user_attrs['checkpoint']}" in outputs[0][0].strip().splitlines()[-1]
    assert Path(best.user_attrs["checkpoint"]).is_file()

    capsys.readouterr()
    sweep_main([*args[1:], "--summary"], cli_main)  # on demand, in-process: the same summary
    assert capsys.readouterr().out.strip().splitlines()[-1] == outputs[0][0].strip().splitlines()[-1]


@pytest.mark.slow
def test_a_pruned_trial_stops_at_that_validation_on_every_ddp_rank_and_rank_zero_reports(tmp_path):
    # A rank that did not stop would wait in the next epoch's first collective until the ddp timeout. The study is in
    # an RDB storage this time, instead of the default journal.
    database = f"sqlite:///{tmp_path / 'studies.db'}"
    result = run_project(sweep_args(tmp_path, "--sweep.n_trials=1", NEVER_GOOD_ENOUGH, f"--sweep.storage={database}",
                                    "--config", str(CONFIGS / "cpu_ddp.yaml"), "--ddp_timeout_minutes=2"), timeout=900)
    ok(result)
    assert not (tmp_path / "sweeps" / STUDY / "journal.log").exists()
    trial = load_study(tmp_path, database).trials[0]
    assert trial.state == optuna.trial.TrialState.PRUNED
    logged = assert_value_is_the_logs_best(trial, csv_rows(tmp_path)[0])
    assert len(logged) == 1  # 3 epochs configured: stopped after the first validation
    log = (Path(trial.user_attrs["run_dir"]) / "fit.log").read_text()
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in log
    assert log.count("pruned at step 0") == 1  # reported and decided once, by rank zero
    assert result.stdout.strip().splitlines()[-1] == f"sweep {STUDY}: no complete trial yet"


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.slow
def test_preempted_or_killed_workers_leave_their_trial_to_the_next_worker_which_resumes_its_last_ckpt(tmp_path):
    # Top1Net trains an epoch of 6 steps in well under a second: by the time a signal sent on a checkpoint reached the
    # fit, it had ended the next epoch too. At 1 s a step, the signals land inside the epoch after the checkpoint.
    args = sweep_args(tmp_path, "--sweep.n_trials=1", "--trainer.limit_train_batches=6", *FAST_HEARTBEAT,
                      callback("stop_callbacks.SlowSteps", seconds=1.0))
    run_dir = tmp_path / "sweeps" / STUDY / "trial_0"
    last, log = run_dir / "checkpoints" / "last.ckpt", run_dir / "fit.log"

    # A preempted worker (SIGTERM) passes it to its fit, which saves and stops; the trial is handed back at once.
    first = start_project(args)
    wait_for(lambda: last.is_file() or first.poll() is not None, 900, "the first epoch's last.ckpt")
    first.send_signal(signal.SIGTERM)
    out, err = first.communicate(timeout=900)
    assert first.returncode == 143, f"{out[-2000:]}\n{err[-3000:]}"
    # (else the second worker would be killed before its fit starts, and the orphan's stop below never come)
    assert global_step(last) < 12, f"the first stop came after epoch 1's end (step {global_step(last)}): slower steps"
    assert [t.state.name for t in load_study(tmp_path).trials] == ["FAIL", "WAITING"]

    # The next worker continues it; killed with -9 once epoch 1 has ended, mid-trial. Its fit gets SIGTERM from the
    # kernel as its parent dies: it saves last.ckpt at the next batch and stops.
    second = start_project(args)
    wait_for(lambda: global_step(last) >= 12 or second.poll() is not None, 900, "epoch 1's end (step 12)")
    os.kill(second.pid, signal.SIGKILL)
    second.wait()
    wait_for(lambda: log.read_text().count("stopped by SIGTERM") == 2, 300, "the orphaned fit to save and stop")

    # A third worker finds the trial without a heartbeat, retries it, and finishes it.
    third = run_project(args, timeout=900)
    ok(third)
    assert "sweep: trial 1 has had no heartbeat" in third.stdout
    trials = load_study(tmp_path).trials
    assert [t.state.name for t in trials] == ["FAIL", "FAIL", "COMPLETE"]
    finished = trials[2]
    assert finished.system_attrs["retry_history"] == [0, 1] and Path(finished.user_attrs["run_dir"]) == run_dir
    assert finished.params == trials[0].params
    assert log.read_text().count(f"--ckpt_path last: resuming from {last}") == 2
    # Each start continued where the one before stopped: no training step logged twice, 3 validations in all.
    steps = [step for step, _ in read_scalars(run_dir)["train/loss"]]
    assert len(steps) == len(set(steps)) and max(steps) >= 17, steps
    assert len(assert_value_is_the_logs_best(finished, csv_rows(tmp_path)[2])) == 3
    assert third.stdout.strip().splitlines()[-1].startswith("best trial 2: val/acc1 ")


def global_step(checkpoint: Path) -> int:
    if not checkpoint.is_file():
        return -1
    return torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)["global_step"]


BAD = {
    # name: (extra arguments, expected text of the one line)
    "unknown option in the space": (["--sweep.space.model.widht={choices: [8, 16]}"],
                                    "sweep.space.model.widht is not a fit option (did you mean model.width?)"),
    "empty range": (["--sweep.space.model.lr={low: 0.1, high: 0.1}"], "empty range [0.1, 0.1]"),
    "inverted range": (["--sweep.space.model.lr={low: 1.0, high: 0.1}"], "inverted range, low 1.0 > high 0.1"),
    "empty choices": (["--sweep.space.data.auto_augment={choices: []}"], "0 choice(s) is an empty search"),
    "a choice the fit refuses": (["--sweep.space.data.auto_augment={choices: [null, trivialaugment_wid]}"],
                                 "sweep.space.data.auto_augment: the fit does not accept 'trivialaugment_wid'"),
    "storage that cannot be opened": (["--sweep.storage=sqlite:////nonexistent/dir/sweep.db"],
                                      "sweep.storage sqlite:////nonexistent/dir/sweep.db cannot be opened"),
    "journal in a missing folder": (["--sweep.storage=/nonexistent/dir/journal.log"],
                                    "its folder /nonexistent/dir does not exist"),
    "unknown fit option": (["--model.lrr=0.1"], "fit options of the sweep: "),
    "empty space": (["--sweep.space={}"], "sweep.space is empty: name fit options and their ranges, e.g. `model.lr: "),
    "unknown sweep setting": (["--sweep.trials=4"], "sweep.trials is not a sweep setting"),
    "sampler that does not exist": (["--sweep.sampler=TPESampla"],
                                    "sweep.sampler: cannot build optuna.samplers.TPESampla"),
    "summary of a study not started": (["--summary"], f"no study '{STUDY}' yet"),
    "log range with a step": (["--sweep.space.model.lr={low: 1.0, high: 10.0, log: true, step: 1}"],
                              "a log range needs low > 0 and no step"),
    "validation on a batch-size-dependent subset": (["--trainer.limit_val_batches=4"],
                                                    "trainer.limit_val_batches 4: trials would score on the first"),
    "a tracker that does not answer": (['--trainer.logger={"class_path": "lightning.pytorch.loggers.MLFlowLogger", '
                                        '"init_args": {"tracking_uri": "http://127.0.0.1:9"}}'],
                                       "the MLflow tracking server http://127.0.0.1:9 does not answer"),
    "validation on one batch": (["--trainer.limit_val_batches=1"],  # (an int: one batch; 1.0 is the whole split)
                                "trainer.limit_val_batches 1: trials would score on the first"),
    "a password in the storage URL": (["--sweep.storage=postgresql://ann:s3cret@127.0.0.1:1/db"],
                                      "sweep.storage postgresql://ann:***@127.0.0.1:1/db cannot be opened"),
    "an argument the sampler does not take": (["--sweep.sampler={class_path: TPESampler, init_args: {n_startup: 3}}"],
                                              "sweep.sampler: its class takes no n_startup; drop it"),
    "an option only predict uses": (["--predictions.images=/tmp"],
                                     "--predictions.images is predict's: sweep does not use it; drop it"),
    "a prefix of one": (["--predictions=/tmp/x.csv"], "--predictions is predict's: sweep does not use it; drop it"),
    "grid that misses a parameter": (["--sweep.sampler={class_path: GridSampler, init_args: {search_space: "
                                      "{model.lr: [0.1, 0.2]}}}"], "the GridSampler's grid names"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_sweep_input_is_one_line_exit_2_before_anything_is_written(case, tmp_path, capsys):
    extra, expected = BAD[case]
    root = tmp_path / "runs"
    with pytest.raises(SystemExit) as exit:
        exit_on_user_error(lambda: sweep_main(sweep_args(root, *extra)[1:], cli_main))
    assert exit.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert not root.exists()


@pytest.mark.slow
def test_a_metric_the_model_never_logs_stops_the_sweep_after_its_first_validation_in_one_line(tiny_root, tmp_path,
                                                                                              capsys,
                                                                                              trials_see_the_suite):
    # The engine cannot know what a model logs before it runs: the first trial's first validation tells, and says what
    # it logs. One trial, stopped at its first validation; the sweep ends with exit 2. The worker runs in this process.
    # No logging step before that validation: else LearningRateMonitor's lr-SGD is in the list when the trial draws
    # data.batch_size 16 (two steps an epoch, log_every_n_steps 2) and not when it draws 32.
    args = sweep_args(tmp_path / "runs", "--sweep.metric=val/acc2", f"--data.root={tiny_root}",
                      "--trainer.max_epochs=3", "--trainer.limit_train_batches=2", "--trainer.log_every_n_steps=50")
    with pytest.raises(SystemExit) as stopped:
        sweep_main(args[1:], cli_main)
    out, err = capsys.readouterr()
    assert stopped.value.code == 2, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        "error: sweep.metric 'val/acc2' is never logged: trial 0's fit logs val/acc1, val/acc5, val/loss at its "
        "validation; pass one of them with --sweep.metric")
    assert "trial 1" not in out


DIVERGING = "1.0e+30"  # model.lr, as YAML reads a float: one SGD step takes Top1Net's logits past float32's range


@pytest.mark.slow
def test_a_diverged_trial_fails_and_a_used_up_grid_ends_the_sweep_with_its_summary(tiny_root, tmp_path, capsys,
                                                                                   trials_see_the_suite):
    # val/acc1 of NaN logits is a number (argmax picks class 0): the diverged trial must fail, not rank. The grid has
    # 2 points and n_trials is 4: Optuna's GridSampler calls study.stop() after the last one (a RuntimeError outside
    # study.optimize), and would then repeat points. The worker runs in this process; its trials are processes.
    args = sweep_args(tmp_path, "--sweep.n_trials=4", "--trainer.max_epochs=1", "--trainer.limit_train_batches=3",
                      f"--data.root={tiny_root}", "--sweep.space={model.lr: {choices: [0.1, %s]}}" % DIVERGING,
                      "--sweep.sampler={class_path: GridSampler, init_args: {search_space: {model.lr: [0.1, %s]}}}"
                      % DIVERGING)
    sweep_main(args[1:], cli_main)
    out = capsys.readouterr().out
    trials = load_study(tmp_path).trials
    by_lr = {t.params["model.lr"]: t for t in trials}
    assert len(trials) == 2 and set(by_lr) == {0.1, float(DIVERGING)}, out
    diverged = by_lr[float(DIVERGING)]
    assert diverged.state.name == "FAIL" and "val/loss nan" in diverged.user_attrs["diverged"]
    assert f"sweep: trial {diverged.number} failed: it diverged (val/loss nan at step 0" in out
    assert by_lr[0.1].state.name == "COMPLETE"
    assert out.strip().splitlines()[-1].startswith(f"best trial {by_lr[0.1].number}: val/acc1 ")


def test_a_grids_integers_reach_the_fit_as_integers(tmp_path):
    from classifier_engine.run.sweep import check_sweep, parse, sweep_parser
    from classifier_engine.run.sweep_trials import param_flags, suggest

    space = {"data.batch_size": {"choices": [16, 32]}, "model.lr": {"low": 0.1, "high": 1.0}}
    grid = {"data.batch_size": [16, 32], "model.lr": [0.1, 1]}
    config = parse(sweep_parser(cli_main), ["--config", str(QUICKSTART), "--config", str(SWEEP),
                                            f"--sweep.space={space}",
                                            f"--sweep.sampler={{class_path: GridSampler, init_args: {{search_space: "
                                            f"{grid}}}}}"])
    sampler = check_sweep(config.sweep, config.get("config") or [])
    study = optuna.create_study(sampler=sampler)
    flags = set()
    for _ in range(4):
        trial = study.ask()
        flags.update(param_flags({name: suggest(trial, name, spec) for name, spec in config.sweep.space.items()}))
    assert {"--data.batch_size=16", "--data.batch_size=32"} <= flags  # never `32.0`, which the fit refuses


def test_a_journal_record_cut_short_by_a_kill_is_set_aside_and_the_study_goes_on(tmp_path):
    journal = tmp_path / "journal.log"
    study = optuna.create_study(study_name="s", storage=open_storage(str(journal)))
    study.tell(study.ask(), 1.0)
    cut = b'{"op_code":5,"worker_id":"w","trial_id":1,"param_na'  # a worker killed while it wrote a record
    with open(journal, "ab") as file:
        file.write(cut)
    study = optuna.load_study(study_name="s", storage=open_storage(str(journal)))  # a partial last record is skipped
    study.tell(study.ask(), 2.0)  # ...and, with Optuna's own backend, joined to this one: unreadable for good
    again = optuna.load_study(study_name="s", storage=open_storage(str(journal)))
    assert [t.value for t in again.trials] == [1.0, 2.0]
    assert (tmp_path / "journal.log.cut").read_bytes() == cut + b"\n"


def test_a_full_disk_under_the_journal_is_one_line_and_the_study_goes_on_once_there_is_space(tmpfs):
    disk = tmpfs("256k")
    journal = disk / "journal.log"
    study = optuna.create_study(study_name="s", storage=open_storage(str(journal)))
    study.tell(study.ask(), 1.0)
    before = journal.read_bytes()
    with open(disk / "filler", "wb", buffering=0) as filler, pytest.raises(OSError):
        while True:
            filler.write(b"\0" * 4096)
    with pytest.raises(DiskFullError, match=f"no space left for the study's journal {journal}: nothing of it was"):
        study.set_user_attr("notes", "x" * 20000)  # a record longer than what is left of the journal's last page
    assert journal.read_bytes() == before
    (disk / "filler").unlink()
    study = optuna.load_study(study_name="s", storage=open_storage(str(journal)))
    study.tell(study.ask(), 3.0)
    assert [t.value for t in optuna.load_study(study_name="s", storage=open_storage(str(journal))).trials] == [1.0, 3.0]


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # since optuna 2.2
def test_the_parallel_coordinate_plot_draws_every_trial_dark_enough_with_whole_names():
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.collections import LineCollection
    from optuna.visualization.matplotlib import plot_parallel_coordinate

    study = optuna.create_study(direction="maximize")
    names = ["trainer.gradient_clip_val", "data.random_erase_prob"]  # fit options of 20 characters or more
    for clip, erase, value in ((0.01, 0.0, 0.1), (0.1, 0.1, 0.5), (1.0, 0.2, 0.9)):
        study.enqueue_trial({names[0]: clip, names[1]: erase})
        trial = study.ask()
        trial.suggest_float(names[0], 0.01, 1.0, log=True), trial.suggest_float(names[1], 0.0, 0.2)
        study.tell(trial, value)
    axes = plot_parallel_coordinate(study, target_name="val/acc1")
    cut = [tick.get_text() for tick in axes.get_xticklabels()]
    assert not set(names) & set(cut), cut  # Optuna cuts them to trainer.gradient_...
    legible_parallel_coordinates(axes, names)
    axes.figure.canvas.draw()
    lines = next(c for c in axes.collections if isinstance(c, LineCollection))
    brightness = [0.299 * r + 0.587 * g + 0.114 * b for r, g, b, _ in lines.get_colors()]
    assert len(brightness) == 3 and max(brightness) < 0.8, brightness  # Optuna's "Blues": the lowest value is white
    labels = [tick.get_text().replace("\n", "") for tick in axes.get_xticklabels()]
    assert set(names) <= set(labels), labels


def test_a_sweeps_plan_names_its_study_storage_score_and_space_and_opens_nothing(tmp_path, monkeypatch, capsys):
    from conftest import project_in_process

    code, out, err = project_in_process(sweep_args(tmp_path, "--sweep.n_trials=3", "--plan"), monkeypatch, capsys)
    assert code == 0, err[-3000:]
    lines = [line.strip() for line in out.strip().splitlines()]
    assert lines[0] == "plan of sweep (dry: no study opened, no trial run, nothing written):"
    study = tmp_path / "sweeps" / STUDY
    assert f"study: {STUDY} in {study} (sweep.study, else the sweep file's name)" in lines
    assert any(line.startswith(f"storage: {study / 'journal.log'} (the study dir's journal") for line in lines), lines
    assert "trials: 3 (sweep.n_trials, shared by every worker of the study)" in lines
    assert any(line.startswith("score: metric val/acc1, direction maximize") for line in lines)
    space = "space: model.lr {'low': 0.01, 'high': 0.5, 'log': True}; model.width {'choices': [8, 16]}; "
    assert any(line.startswith(space) for line in lines), lines
    assert not tmp_path.joinpath("sweeps").exists()
    # A storage URL's password is not printed (it was).
    code, out, err = project_in_process(sweep_args(tmp_path, "--sweep.storage=postgresql://ann:s3cret@db/x", "--plan"),
                                        monkeypatch, capsys)
    assert code == 0 and "  storage: postgresql://ann:***@db/x (sweep.storage)" in out.splitlines(), out + err


def test_a_sweep_file_names_the_fit_config_it_builds_on_in_its_configs(tmp_path, monkeypatch, capsys):
    # The library's entry has no default model or data: they come from the files sweep.configs names, read first.
    from conftest import project_in_process

    sweep_file = tmp_path / "lr.yaml"
    sweep_file.write_text(f"sweep:\n  configs: [{QUICKSTART}]\n  space:\n    model.lr: {{low: 0.01, high: 0.5}}\n")
    args = ["sweep", "--config", str(sweep_file), f"--trainer.default_root_dir={tmp_path}", "--plan"]
    code, out, err = project_in_process(args, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    assert f"study: lr in {tmp_path / 'sweeps' / 'lr'} (sweep.study, else the sweep file's name)" in out
    assert not tmp_path.joinpath("sweeps").exists()


@pytest.mark.slow
def test_a_sweep_that_sets_the_checkpoint_monitor_keeps_its_mode_as_a_fit_would(tiny_root, tmp_path,
                                                                              trials_see_the_suite):
    # Without it, a trial's checkpoint follows the model's Monitor (val/acc1, max); with it, mode and file name stay as
    # configured (the fit's monitor pass): val/loss keeps the default mode min, not the model's max.
    args = sweep_args(tmp_path, "--sweep.n_trials=1", "--checkpoint.monitor=val/loss", f"--data.root={tiny_root}",
                      "--trainer.max_epochs=1", "--trainer.limit_train_batches=2")
    ok(run_project(args))
    assert "monitor: metric val/loss, mode min (--checkpoint.monitor given)" in (
        tmp_path / "sweeps" / STUDY / "trial_0" / "fit.log").read_text()
