"""Experiment trackers: MLflow against a real `mlflow server` (sqlite, on 127.0.0.1), W&B offline, CSV, as a list.

    python -m pytest tests/test_trackers.py

A run stopped by SIGTERM and resumed with `--ckpt_path last` is ONE tracked run whose curves continue, and ONE run dir
with the checkpoints, config.yaml and every file-based logger's output; bad tracker settings are one line each.
"""

import base64
import contextlib
import csv as csv_module
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import callback, project_in_process, read_scalars, run_project, tiny_args
from local_services import free_port

pytestmark = pytest.mark.slow
mlflow = pytest.importorskip("mlflow", reason="the tracking extra: pip install -e './engine[tracking]'")


@pytest.fixture(scope="module")
def mlflow_service(tmp_path_factory):
    """A real MLflow tracking server (sqlite backend, artifacts in a temp folder) on 127.0.0.1: (URI, its folder)."""
    home = tmp_path_factory.mktemp("mlflow")
    with running_mlflow_server(home, free_port()) as (uri, _):
        yield uri, home


@pytest.fixture(scope="module")
def mlflow_server(mlflow_service):
    return mlflow_service[0]


@contextlib.contextmanager
def running_mlflow_server(home: Path, port: int):
    """`mlflow server` on 127.0.0.1:port, its database, artifacts and log in `home`: (URI, its process group);
    stopped on exit (if not before)."""
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}",
               "--default-artifact-root", str(home / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
               "--workers", "1"]
    # Without MLflow 3's job runner (7 huey consumer processes for GenAI scoring and trace archival, no part of
    # tracking): they took CPU from the runs under test and ~10 s to stop. Older MLflow ignores the variable.
    # The AI Gateway off too: no part of tracking, and the subject of CVE-2026-71211 (docs/reliability.md).
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_ENABLE_AI_GATEWAY": "false"}
    log = open(home / "server.log", "a")
    server = subprocess.Popen(command, cwd=home, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            with urllib.request.urlopen(uri + "/health", timeout=2) as answer:
                if answer.status == 200:
                    break
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            pytest.fail(f"mlflow server did not start: {(home / 'server.log').read_text()[-2000:]}")
        time.sleep(0.5)
    try:
        yield uri, server.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


def _loggers(*entries: dict) -> str:
    return "--trainer.logger=" + json.dumps(list(entries))


def _tensorboard(root: Path) -> dict:
    return {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": str(root)}}


def _mlflow(uri: str, experiment: str) -> dict:
    return {"class_path": "lightning.pytorch.loggers.MLFlowLogger",
            "init_args": {"tracking_uri": uri, "experiment_name": experiment}}


def _stop_then_resume(tiny_root: Path, root: Path, *extra: str, env: dict | None = None):
    """fit 2 epochs stopped by SIGTERM in epoch 1 (exit 143), then `--ckpt_path last` to the end (exit 0)."""
    args = tiny_args(tiny_root, root, "--trainer.max_epochs=2", *extra)
    stopped = run_project(["fit", *args, callback("stop_callbacks.SignalAtStep", step=7, signum=int(signal.SIGTERM))],
                          env=env)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    resumed = run_project(["fit", *args, "--ckpt_path", "last"], env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return stopped, resumed


def test_tensorboard_mlflow_wandb_offline_and_csv_stopped_and_resumed_are_one_run_each_and_one_run_dir(
        tiny_root, tmp_path, mlflow_server):
    # All four loggers in one stopped-and-resumed run (one stop and one resume process, not two of each): each must
    # come out as one tracked run in the one run dir, beside the others.
    pytest.importorskip("wandb")
    wandb_logger = {"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": {"project": "resume"}}
    csv = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "elsewhere"}}
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    stopped, resumed = _stop_then_resume(
        tiny_root, tmp_path, _loggers(_tensorboard(tmp_path), _mlflow(mlflow_server, "resume"), wandb_logger, csv),
        env=env)
    output = resumed.stdout + resumed.stderr

    # MLflow: one run whose curves continue
    client = mlflow.tracking.MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("resume")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    run = runs[0]
    run_dir = tmp_path / "lightning_logs" / "version_0"
    tensorboard = read_scalars(run_dir)
    # 2 epochs of 5 steps, each logged once (the step the stop was taken at too)
    for name, count in (("val/acc1", 2), ("train/loss", 10)):
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, name))
        assert len(steps) == len(set(steps)) == count, (name, steps)  # each step once: one run, no counter restart
        assert steps == sorted(step for step, _ in tensorboard[name]), (name, steps)  # TensorBoard's steps
    params = run.data.params
    assert params["model.width"] == "16"
    assert params["trainer.max_epochs"] == "2"
    assert run.data.tags.get("git_commit") or not (Path(__file__).parents[1] / ".git").exists()
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert "config.yaml" in artifacts, artifacts
    assert run.info.status == "FINISHED"

    versions = sorted(p.name for p in (tmp_path / "lightning_logs").iterdir())
    assert versions == ["version_0"], versions
    assert (run_dir / "checkpoints" / "last.ckpt").is_file() and (run_dir / "config.yaml").is_file()
    assert list(run_dir.glob("events.out.tfevents.*"))
    trackers = json.loads((run_dir / "trackers.json").read_text())
    assert trackers["mlflow"] == run.info.run_id
    assert f"run_id: {run.info.run_id}" not in (run_dir / "config.yaml").read_text()  # a rerun from it is a new run
    last_line = [line for line in output.splitlines() if line.startswith("run dir ")][-1]
    assert f"MLflow {mlflow_server}/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}" in last_line
    assert f"tensorboard --logdir {tmp_path / 'lightning_logs'}" in last_line

    # W&B offline: two starts, one run id
    offline_runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    ids = {path.name.rsplit("-", 1)[-1] for path in offline_runs}
    assert len(offline_runs) == 2 and len(ids) == 1, offline_runs  # two starts, one W&B run
    assert trackers["wandb"] == ids.pop()
    assert "wandb sync" in output
    # CSV beside them: moved from save_dir "elsewhere" into the one run dir, with TensorBoard's events and the run's
    # files; its metrics.csv continues across the resume (Lightning's CSVLogger alone would have deleted the first
    # start's rows: classifier_engine.run.trackers.continue_csv_logs), each step once, the steps TensorBoard holds.
    assert (run_dir / "metrics.csv").is_file()
    with open(run_dir / "metrics.csv", newline="") as file:
        rows = list(csv_module.DictReader(file))
    for name in ("train/loss", "val/acc1"):
        steps = [int(row["step"]) for row in rows if row.get(name)]
        assert steps == sorted(step for step, _ in tensorboard[name]), (name, steps)
    assert not (run_dir / "metrics.csv.resume").exists()
    # config.yaml keeps settings, not the run's identity: a new run from it gets its own W&B run and run dir
    import yaml

    (saved,) = [e for e in yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["logger"]
                if e["class_path"].endswith("WandbLogger")]
    assert saved["init_args"]["id"] is None and saved["init_args"]["save_dir"] is None, saved


def _one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-3000:]
    assert lines and lines[-1].startswith("error: "), lines[-5:]
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[-1], lines[-1]


def _one_line_error_in_process(capsys, monkeypatch, args: list[str], *needles: str) -> None:
    """The real process's contract in this process (conftest.project_in_process): one `error: ` line, exit 2."""
    code, _, err = project_in_process(args, monkeypatch, capsys)
    assert code == 2, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_an_unreachable_tracking_server_is_one_line_and_nothing_is_written(tiny_root, tmp_path, capsys, monkeypatch):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    args = ["fit", *tiny_args(tiny_root, tmp_path, _loggers(_mlflow(uri, "x")))]
    _one_line_error_in_process(capsys, monkeypatch, args, uri, "does not answer", "mlflow server")
    assert not (tmp_path / "lightning_logs").exists()


def test_mlflows_refused_file_store_is_one_line_naming_the_fix(tiny_root, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    args = ["fit", *tiny_args(tiny_root, tmp_path, _loggers(_mlflow(f"file://{tmp_path}/mlruns", "x")))]
    _one_line_error_in_process(capsys, monkeypatch, args, "file store", "sqlite:///")
    assert not (tmp_path / "lightning_logs").exists() and not (tmp_path / "mlruns").exists()


def test_a_missing_tracker_package_is_one_line_naming_the_extra(tiny_root, tmp_path):
    # A real process (the file's one): the error line as `python -m project` prints it, through __main__.
    # A folder first on sys.path whose `mlflow` fails to import as an absent package does.
    hide = tmp_path / "hide" / "mlflow"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'mlflow'\", name='mlflow')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(hide.parent), str(Path(__file__).parent)])}
    result = run_project(["fit", *tiny_args(tiny_root, tmp_path / "run", _loggers(_mlflow("http://127.0.0.1:1", "x")))],
                         env=env)
    _one_line_error(result, "mlflow", 'pip install -e "./engine[tracking]" (from a clone), or pip install '
                                      '"classifier-engine[tracking]"')
    assert not (tmp_path / "run").exists()



# -- trackers at start-up and on resume: one line before anything is written, or a new tracked run said so ----------

def test_a_tracking_uri_with_a_password_is_used_and_never_printed(tiny_root, tmp_path, mlflow_server, capsys,
                                                                  monkeypatch):
    from jsonargparse import Namespace

    from classifier_engine.run.trackers import check_trackers, redact

    with_password = mlflow_server.replace("http://", "http://ann:s3cret@")  # basic auth, as MLflow's client takes it
    entry = Namespace(class_path="lightning.pytorch.loggers.MLFlowLogger",
                      init_args=Namespace(tracking_uri=with_password))
    check_trackers(Namespace(logger=[entry]))  # the server answers: no refusal as an unknown host
    assert redact(with_password) == mlflow_server.replace("http://", "http://ann:***@")
    port = free_port()
    args = ["fit", *tiny_args(tiny_root, tmp_path, _loggers(_mlflow(f"http://ann:s3cret@127.0.0.1:{port}", "x")))]
    code, out, err = project_in_process(args, monkeypatch, capsys)
    assert code == 2 and err.strip().splitlines() == [err.strip()], err[-3000:]
    assert f"http://127.0.0.1:{port} does not answer" in err and "s3cret" not in out + err
    assert not (tmp_path / "lightning_logs").exists()
    code, out, err = project_in_process([*args, "--print_config"], monkeypatch, capsys)
    assert code == 0 and f"http://ann:***@127.0.0.1:{port}" in out and "s3cret" not in out + err


def _resume_plan(root: Path, uri: str, experiment: str, recorded: dict):
    """The run plan of `fit --ckpt_path last` into a run dir whose trackers.json holds `recorded`."""
    import torch
    from jsonargparse import Namespace

    from classifier_engine.plan.make import plan_run

    run_dir = root / "lightning_logs" / "version_0"
    (run_dir / "checkpoints").mkdir(parents=True)
    torch.save({"state_dict": {}, "epoch": 0, "global_step": 5}, run_dir / "checkpoints" / "last.ckpt")
    (run_dir / "trackers.json").write_text(json.dumps(recorded))
    entry = Namespace(class_path="lightning.pytorch.loggers.MLFlowLogger",
                      init_args=Namespace(tracking_uri=uri, experiment_name=experiment))
    config = Namespace(trainer=Namespace(default_root_dir=str(root), logger=[entry]), ckpt_path="last",
                       checkpoint=Namespace(dirpath=None))
    return plan_run("fit", config), entry.init_args


def _as_it_is(run_dir: Path) -> dict:
    return {str(p.relative_to(run_dir)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
            for p in sorted(run_dir.rglob("*"))}


@pytest.mark.parametrize("case", ["truncated", "another run dir's", "experiment deleted"])
def test_a_tracked_history_that_would_fork_or_cross_runs_is_one_line_and_leaves_the_run_dir_as_it_was(
        case, tiny_root, tmp_path, mlflow_server, monkeypatch, capsys):
    # Issue 39, item 2: a truncated trackers.json resumed into a new MLflow run without a word, another run dir's
    # into that run; a deleted experiment exited 2 after the run dir's lock was taken (its .lock rewritten).
    client = mlflow.tracking.MlflowClient(mlflow_server)
    experiment = f"history-{case.replace(' ', '-').replace(chr(39), '')}"
    run_id = client.create_run(client.create_experiment(experiment)).info.run_id
    original = tmp_path / "original" / "lightning_logs" / "version_0"
    _resume_plan(tmp_path / "original", mlflow_server, experiment, {"mlflow": run_id, "run_dir": str(original),
                                                                     "mlflow_tracking_uri": mlflow_server})
    run_dir, expected = original, None
    if case == "truncated":
        (run_dir / "trackers.json").write_text(f'{{"mlflow": "{run_id}", "mlflow_tracki')
        expected = "trackers.json is damaged (not JSON: "
    elif case == "another run dir's":
        run_dir = tmp_path / "copy" / "lightning_logs" / "version_0"
        shutil.copytree(original, run_dir)  # cp -r of a run dir: its trackers.json names the original's runs
        expected = f"names the tracked runs of the run dir {original}, which still exists (a copy?)"
    else:
        client.delete_experiment(client.get_experiment_by_name(experiment).experiment_id)
        expected = f"the MLflow experiment '{experiment}' is deleted on {mlflow_server}: restore it"
    (run_dir / ".lock").write_text("a previous start's holder line\n")
    before = _as_it_is(run_dir)
    args = ["fit", *tiny_args(tiny_root, run_dir.parents[1], _loggers(_mlflow(mlflow_server, experiment))),
            "--ckpt_path=last"]
    _one_line_error_in_process(capsys, monkeypatch, args, expected)
    assert _as_it_is(run_dir) == before
    if case != "experiment deleted":  # (whose runs the server no longer lists)
        runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
        assert [r.info.run_id for r in runs] == [run_id]  # no new MLflow run


def test_a_new_fit_into_a_deleted_mlflow_experiment_is_one_line_and_writes_nothing(tiny_root, tmp_path, mlflow_server,
                                                                                    monkeypatch, capsys):
    # Issue 39, item 2: a resume said so in one line; a new run ended in MLflow's traceback after its run dir was made.
    client = mlflow.tracking.MlflowClient(mlflow_server)
    experiment_id = client.create_experiment("deleted-before-a-new-fit")
    client.delete_experiment(experiment_id)
    args = ["fit", *tiny_args(tiny_root, tmp_path, _loggers(_mlflow(mlflow_server, "deleted-before-a-new-fit")))]
    _one_line_error_in_process(capsys, monkeypatch, args, f"the MLflow experiment 'deleted-before-a-new-fit' is "
                               f"deleted on {mlflow_server}: restore it (mlflow experiments restore --experiment-id "
                               f"{experiment_id}) or set trainer.logger's experiment_name to another one")
    assert not list(tmp_path.iterdir())
    assert client.search_runs([experiment_id], run_view_type=mlflow.entities.ViewType.ALL) == []  # no run started


def test_a_moved_run_dir_continues_its_tracked_runs_said_in_a_line(tmp_path, mlflow_server, monkeypatch):
    said = []  # (Lightning's info logger keeps the stream it found when first imported: capsys may not see it)
    monkeypatch.setattr("classifier_engine.run.tracked_runs.rank_zero_info", said.append)
    client = mlflow.tracking.MlflowClient(mlflow_server)
    run_id = client.create_run(client.create_experiment("moved")).info.run_id
    plan, args = _resume_plan(tmp_path, mlflow_server, "moved", {"mlflow": run_id, "mlflow_tracking_uri": mlflow_server,
                                                                 "run_dir": str(tmp_path / "gone" / "version_0")})
    assert args.run_id == run_id
    assert len(said) == 1 and f"was written in {tmp_path / 'gone' / 'version_0'}, which is gone (moved here)" in said[0]


@pytest.mark.parametrize("case", ["run deleted", "experiment deleted", "another tracking uri", "another experiment"])
def test_a_resume_whose_mlflow_run_cannot_continue_starts_a_new_one_said_or_stops_in_one_line(tmp_path, mlflow_server,
                                                                                                case):
    from classifier_engine.errors import ConfigError

    client = mlflow.tracking.MlflowClient(mlflow_server)
    experiment = f"gone-{case.replace(' ', '-')}"
    experiment_id = client.create_experiment(experiment)
    run_id = client.create_run(experiment_id).info.run_id
    recorded = {"mlflow": run_id, "mlflow_tracking_uri": mlflow_server}
    if case == "run deleted":
        client.delete_run(run_id)
    elif case == "experiment deleted":
        client.delete_experiment(experiment_id)
        with pytest.raises(ConfigError, match=rf"MLflow experiment '{experiment}' is deleted on .*mlflow experiments "
                                              rf"restore --experiment-id {experiment_id}"):
            _resume_plan(tmp_path, mlflow_server, experiment, recorded)
        return
    elif case == "another tracking uri":
        recorded["mlflow_tracking_uri"] = "http://elsewhere:5000"
    configured = f"{experiment}-renamed" if case == "another experiment" else experiment  # MLFlowLogger: logged there
    with pytest.warns(UserWarning, match=rf"MLflow run {run_id} cannot continue \(.*\): a new MLflow run starts"):
        plan, args = _resume_plan(tmp_path, mlflow_server, configured, recorded)
    assert plan.ckpt_path is not None and args.get("run_id") is None  # the logger starts a new run


def test_wandb_online_without_a_network_is_one_line_at_once(tiny_root, tmp_path, capsys, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens: as no network
    wandb_logger = {"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": {"project": "x"}}
    started = time.monotonic()
    _one_line_error_in_process(capsys, monkeypatch, ["fit", *tiny_args(tiny_root, tmp_path, _loggers(wandb_logger))],
                               "W&B (online)", "cannot be reached", "WANDB_MODE=offline")
    assert time.monotonic() - started < 120 and not (tmp_path / "lightning_logs").exists()


def test_wandb_online_without_an_api_key_is_one_line_at_once(tiny_root, tmp_path, capsys, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no key where `wandb login` writes it
    with socket.socket() as server:  # a reachable server: only the key is missing
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        wandb_logger = {"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": {"project": "x"}}
        _one_line_error_in_process(capsys, monkeypatch, ["fit", *tiny_args(tiny_root, tmp_path / "run",
                                                                            _loggers(wandb_logger))],
                                   "W&B (online) has no API key", "wandb login", "WANDB_API_KEY")
    assert not (tmp_path / "run").exists()


def test_an_explicit_wandb_save_dir_is_said_to_move_into_the_run_dir(tmp_path):
    from jsonargparse import Namespace

    from classifier_engine.run.tracked_runs import tracker_edits

    entry = Namespace(class_path="lightning.pytorch.loggers.WandbLogger",
                      init_args=Namespace(project="x", save_dir=str(tmp_path / "mine")))
    run_dir = tmp_path / "lightning_logs" / "version_0"
    with pytest.warns(UserWarning, match=rf"save_dir {tmp_path / 'mine'}: W&B's local files go into the run dir "
                                         rf"{run_dir} instead"):
        edits = dict(tracker_edits(Namespace(logger=[entry]), run_dir, {}))
    assert edits["trainer.logger.0.init_args.save_dir"] == str(run_dir)


def test_tracked_parameters_are_named_as_the_cli_spells_them_without_init_args():
    from classifier_engine.run.trackers import flat_config

    config = {"model": {"class_path": "project.ImageClassifier", "init_args": {"arch": "resnet18",
                                                                              "optim": {"lr_per_256": 0.2}}},
              "trainer": {"max_epochs": 2, "logger": [{"class_path": "x.Y"}]}}
    assert flat_config(config) == {"model.class_path": "project.ImageClassifier", "model.arch": "resnet18",
                                   "model.optim.lr_per_256": 0.2, "trainer.max_epochs": 2,
                                   "trainer.logger": [{"class_path": "x.Y"}]}


@pytest.mark.parametrize("given_as", ["MLFLOW_TRACKING_URI", "tracking_uri"])
def test_a_password_in_the_tracking_uri_reaches_no_console_log_saved_config_or_tracker_artifact(
        given_as, tiny_root, tmp_path, mlflow_service, monkeypatch):
    # Issue 39, item 3: MLflow printed the URI with its password twice, and config.yaml (saved and sent as an artifact)
    # held it. The password moves into MLflow's own MLFLOW_TRACKING_PASSWORD, which its client sends as basic auth.
    from jsonargparse import Namespace
    from mlflow import MlflowClient

    uri, home = mlflow_service
    with_password = uri.replace("http://", "http://ann:s3cret@")
    logger = _mlflow(with_password, f"secret-{given_as}")
    env = {"MLFLOW_TRACKING_URI": with_password} if given_as == "MLFLOW_TRACKING_URI" else {}
    if env:
        del logger["init_args"]["tracking_uri"]  # MLFlowLogger's default: the variable's value
    args = tiny_args(tiny_root, tmp_path / "runs", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
                     _loggers(_tensorboard(tmp_path / "runs"), logger))
    result = run_project(["fit", *args], env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"MLflow {uri}/#/experiments/" in result.stdout + result.stderr  # tracked, at the URI without the password
    run = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name(f"secret-{given_as}").experiment_id])
    assert len(run) == 1 and "config.yaml" in [a.path for a in MlflowClient(uri).list_artifacts(run[0].info.run_id)]
    holding = ["the console"] if "s3cret" in result.stdout + result.stderr else []
    holding += [str(path) for root in (tmp_path, home) for path in root.rglob("*")  # run dir, server db, artifacts, log
                if path.is_file() and b"s3cret" in path.read_bytes()]
    assert not holding, holding

    from classifier_engine.run.trackers import hidden_credentials

    monkeypatch.setenv("MLFLOW_TRACKING_URI", with_password)  # what MLflow's client sends: the password, as basic auth
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    trainer = Namespace(logger=[Namespace(class_path="lightning.pytorch.loggers.MLFlowLogger",
                                          init_args=Namespace(tracking_uri=with_password))])
    assert hidden_credentials(trainer) == ([("trainer.logger.0.init_args.tracking_uri", uri)], None)
    assert uri == os.environ["MLFLOW_TRACKING_URI"]
    credentials = MlflowClient(uri)._tracking_client.store.get_host_creds()
    assert (credentials.username, credentials.password) == ("ann", "s3cret")




def test_a_password_moved_for_one_server_is_not_sent_to_another_by_a_later_start_in_the_process(monkeypatch):
    # A notebook's second run tracking at another server: MLflow's client sends MLFLOW_TRACKING_USERNAME/_PASSWORD to
    # whatever server it talks to, so the first run's moved password would reach the second's server.
    from jsonargparse import Namespace

    from classifier_engine.config_edits import read_only
    from classifier_engine.plan.placement import credentials
    from classifier_engine.run.trackers import hidden_credentials
    from classifier_engine.run_plan import PlanInput, RunPlan

    def start(uri: str) -> dict:
        """The run plan's credentials pass for a fit tracking at `uri`: {topic: its edits, else its value}."""
        config = Namespace(trainer=Namespace(logger=Namespace(class_path="lightning.pytorch.loggers.MLFlowLogger",
                                                              init_args=Namespace(tracking_uri=uri))))
        decisions = credentials(PlanInput("fit", read_only(config), Namespace(), RunPlan("fit")))
        return {decision.topic: decision.edits or decision.value for decision in decisions}

    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(key, raising=False)
    start("http://ann:s3cret@127.0.0.1:5001")
    assert start("http://127.0.0.1:5001/") == {} and os.environ["MLFLOW_TRACKING_PASSWORD"] == "s3cret"  # its own
    assert start("http://ann:***@127.0.0.1:5001") == {
        "tracking credentials": (("trainer.logger.init_args.tracking_uri", "http://127.0.0.1:5001"),)}
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "s3cret"  # a resumed run's redacted config: the same server
    assert hidden_credentials(Namespace(logger=True)) == ([], None)
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "s3cret"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5009")  # the logger's own URI is where it tracks
    assert start("http://127.0.0.1:5001") == {} and os.environ["MLFLOW_TRACKING_PASSWORD"] == "s3cret"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert start("http://127.0.0.1:5002") == {"tracking credentials dropped": "http://127.0.0.1:5001"}  # in the plan
    assert "MLFLOW_TRACKING_USERNAME" not in os.environ and "MLFLOW_TRACKING_PASSWORD" not in os.environ
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "the user's own")  # set by the user: theirs to keep
    start("http://bob:pw@127.0.0.1:5003")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "set since")
    start("http://127.0.0.1:5004")
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "set since" and "MLFLOW_TRACKING_USERNAME" not in os.environ


def test_a_dry_plan_moves_no_tracking_credentials_of_the_process(tiny_root, tmp_path, mlflow_server, capsys,
                                                                 monkeypatch):
    # --plan reads only: a notebook's next start finds MLflow's variables (and the moved record) as they were.
    from classifier_engine.entry import main
    from classifier_engine.run import trackers

    for key in ("MLFLOW_TRACKING_URI", *trackers.CREDENTIALS):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(trackers, "_moved", {})  # (as a new process has it: earlier tests' starts moved some)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.replace("http://", "http://eve:env-pw@"))
    uri = mlflow_server.replace("http://", "http://ann:s3cret@")
    monkeypatch.setattr(sys, "argv", ["classifier_engine", "fit", "--plan",
                                      *tiny_args(tiny_root, tmp_path, _loggers(_mlflow(uri, "dry")))])
    with pytest.raises(SystemExit) as exit:
        main()
    out, err = capsys.readouterr()
    assert exit.value.code == 0 and "tracking credentials: moved into" in out, out + err
    assert "s3cret" not in out + err and "env-pw" not in out + err
    assert os.environ["MLFLOW_TRACKING_URI"] == mlflow_server.replace("http://", "http://eve:env-pw@")
    assert not any(key in os.environ for key in trackers.CREDENTIALS) and trackers._moved == {}
    assert not (tmp_path / "lightning_logs").exists()


# -- a tracking server that stops answering: the training goes on, its tracked run continues (issue 39, item 1) -------

def test_a_tracking_server_killed_mid_run_costs_no_training_and_its_run_continues_at_the_next_start(tiny_root,
                                                                                                    tmp_path):
    # A real server, killed (-9) as step 3 starts; the fit must reach its last step (10) with one line about it, keep
    # what the server could not take, and send it when the run is continued against the server started again.
    home, port, root = tmp_path / "mlflow", free_port(), tmp_path / "runs"
    home.mkdir()
    loggers = _loggers(_tensorboard(root), _mlflow(f"http://127.0.0.1:{port}", "outage"))
    with running_mlflow_server(home, port) as (uri, pgid):
        started = time.monotonic()
        killed = run_project(["fit", *tiny_args(tiny_root, root, "--trainer.max_epochs=2", loggers),
                              callback("stop_callbacks.KillServerAtStep", step=3, pgid=pgid, port=port)])
        took = time.monotonic() - started
    output = killed.stdout + killed.stderr
    assert killed.returncode == 0 and "Traceback" not in output, output[-3000:]
    run_dir = root / "lightning_logs" / "version_0"
    said = [line for line in output.splitlines() if "stopped answering" in line or "Retrying" in line]
    assert len(said) == 1 and said[0].startswith(f"MLflow tracking server {uri} stopped answering ([Errno 111] "
                                                 f"Connection refused): training goes on"), said
    assert "(not all sent yet" in output.strip().splitlines()[-1]
    import torch

    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 10
    assert (run_dir / "mlflow-pending.jsonl").is_file() and took < 400  # MLflow alone retried ~8 minutes a call

    with running_mlflow_server(home, port):  # back, with its database
        resumed = run_project(["fit", *tiny_args(tiny_root, root, "--trainer.max_epochs=3", loggers),
                               "--ckpt_path", "last"])
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "writes an earlier start of this run dir kept are sent to" in resumed.stderr
        client = mlflow.tracking.MlflowClient(uri)
        (run,) = client.search_runs([client.get_experiment_by_name("outage").experiment_id])
        tensorboard = read_scalars(run_dir)
        for name, count in (("train/loss", 15), ("val/acc1", 3)):
            steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, name))
            assert steps == sorted(step for step, _ in tensorboard[name]) and len(set(steps)) == count, (name, steps)
        assert run.info.status == "FINISHED" and "config.yaml" in [a.path for a in client.list_artifacts(
            run.info.run_id)]
    assert not (run_dir / "mlflow-pending.jsonl").exists()


def test_a_tracking_server_back_during_the_run_gets_what_it_missed_in_order(mlflow_server, tmp_path, monkeypatch,
                                                                            capsys):
    from mlflow.entities import Metric, Param

    from classifier_engine.run import tracker_outage
    from local_services import FaultyProxy

    monkeypatch.setattr(tracker_outage, "RETRY_S", 0.0)  # try again at every write
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    client = mlflow.tracking.MlflowClient(mlflow_server)
    run_id = client.create_run(client.create_experiment("back")).info.run_id
    with FaultyProxy(mlflow_server) as proxy:
        outliving = tracker_outage.OutlivingClient(mlflow.tracking.MlflowClient(proxy.url), tmp_path, proxy.url)
        for step in range(6):
            proxy.fault = "refuse" if step in (2, 3) else None  # the server gone for steps 2 and 3
            outliving.log_batch(run_id, metrics=[Metric("loss", float(step), 1000 + step, step)])
            assert (tmp_path / "mlflow-pending.jsonl").is_file() == (step in (2, 3))
        outliving.log_batch(run_id, params=[Param("lr", "0.1")])
        with pytest.raises(mlflow.exceptions.RestException, match="Changing param values is not allowed"):
            outliving.log_batch(run_id, params=[Param("lr", "0.2")])  # refused, not an outage: raised, as stock
        assert not (tmp_path / "mlflow-pending.jsonl").exists()
        outliving.set_terminated(run_id, "FINISHED")
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == list(range(6))
    assert client.get_run(run_id).info.status == "FINISHED"
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and "stopped answering" in lines[0], lines
    assert lines[1] == f"MLflow tracking server {proxy.url} answers again: 2 kept writes sent"


def test_the_outage_probe_sends_the_tracking_credentials_a_guarded_health_needs(tmp_path, monkeypatch):
    # A proxy in front of an MLflow server may guard /health too: the probe that decides whether the kept writes go out
    # sends MLflow's basic auth, as the start-up check does; without it such a server would never count as back.
    from classifier_engine.run.tracker_outage import RETRY_S, OutlivingClient

    token = "Basic " + base64.b64encode(b"ann:s3cret").decode()

    class Guarded(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" and self.headers.get("Authorization") == token else 401)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Guarded)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = OutlivingClient(None, tmp_path, f"http://127.0.0.1:{server.server_address[1]}")
        answers = []
        for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):  # (an earlier start may have set them)
            monkeypatch.delenv(key, raising=False)
        for user in (None, "ann"):
            if user is not None:
                monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
                monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret")
            client.lost_at = time.monotonic() - RETRY_S - 1  # the last failed try is a retry interval ago
            answers.append(client.answers_again())
        assert answers == [False, True]
    finally:
        server.shutdown()
        server.server_close()
