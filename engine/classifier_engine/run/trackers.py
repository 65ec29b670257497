"""Experiment trackers: the config's logger entries, checked at start-up, their credentials, the config each is sent
(docs/reliability.md#trackers); a resume continues their tracked runs (tracked_runs.py).

    python -m classifier_engine fit --config CONFIG --config MLFLOW.yaml --ckpt_path last
"""

import base64
import contextlib
import csv
import importlib
import json
import netrc
import os
import re
import socket
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Optional

from jsonargparse import Namespace
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_only

from classifier_engine.errors import ConfigError, install_extra

CREDENTIALS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
PENDING = "mlflow-pending.jsonl"  # in the run dir: one write MLflow did not take per line, in order (tracker_outage.py)
KINDS = {"TensorBoardLogger": "tensorboard", "CSVLogger": "csv", "MLFlowLogger": "mlflow", "WandbLogger": "wandb"}


def logger_entries(trainer: Namespace) -> list[tuple[str, Namespace]]:
    """(edit key, class_path/init_args entry) of each configured logger (the default logger, `True`, is none)."""
    logger = trainer.get("logger")
    if isinstance(logger, list):
        return [(f"trainer.logger.{i}", entry) for i, entry in enumerate(logger) if isinstance(entry, Namespace)]
    return [("trainer.logger", logger)] if isinstance(logger, Namespace) else []


def options(entry: Namespace) -> Namespace:
    """A logger entry's init_args (none given: empty)."""
    return entry.get("init_args") or Namespace()


def kind_of(entry: Namespace) -> str:
    """'tensorboard', 'csv', 'mlflow', 'wandb' or 'other' for a logger's class_path."""
    return KINDS.get(str(entry.get("class_path", "")).rsplit(".", 1)[-1], "other")


def check_trackers(trainer: Namespace) -> None:
    """ConfigError for a tracker that cannot work: a missing package, MLflow's refused file store, no server answer."""
    for _, entry in logger_entries(trainer):
        kind = kind_of(entry)
        try:  # the package the logger will import (a broken install fails here too)
            if kind in ("mlflow", "wandb", "tensorboard"):
                importlib.import_module(kind)
        except ImportError:
            raise ConfigError(f"trainer.logger {entry.class_path} needs the {kind} package, which is not installed: "
                              f"{install_extra('tracking')} (or pip install {kind})") from None
        if kind == "mlflow":
            _check_mlflow(options(entry))
        elif kind == "wandb":
            _check_wandb(entry)


def redact(text: str) -> str:
    """A URI's password as `***` (http://user:***@host): what may be printed or sent to a tracker."""
    return re.sub(r"(\b[a-zA-Z][\w+.-]*://[^/@\s:]*):[^/@\s]*@", r"\1:***@", text)


def bare(uri: str) -> str:
    """The URI without its user:password@."""
    parts = urllib.parse.urlsplit(uri)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl() if "@" in parts.netloc else uri


_moved: dict[str, str] = {}  # the server whose user:password this process moved into MLflow's variables, and them


def hidden_credentials(trainer: Namespace) -> tuple[list[tuple[str, str]], Optional[str]]:
    """Move a user:password in MLflow's tracking URIs (trainer.logger's, $MLFLOW_TRACKING_URI) into
    MLFLOW_TRACKING_USERNAME/_PASSWORD, which ranks and trials inherit (a redacted `***` is not taken), so that no URI
    MLflow prints, config.yaml keeps or a tracker receives holds the password. Moved ones are dropped when a later
    start in this process (a notebook) tracks at other servers only: MLflow's client would send them there.
    (the edits, the server whose moved credentials were dropped or None)"""
    def take(uri: str) -> str:
        parts = urllib.parse.urlsplit(uri)
        if parts.password is None or not uri.startswith(("http://", "https://")):
            return uri
        if parts.password != "***":
            os.environ["MLFLOW_TRACKING_USERNAME"] = urllib.parse.unquote(parts.username or "")
            os.environ["MLFLOW_TRACKING_PASSWORD"] = urllib.parse.unquote(parts.password)
            _moved.update(server=server_of(uri), **{key: os.environ[key] for key in CREDENTIALS})
        return bare(uri)

    if os.environ.get("MLFLOW_TRACKING_URI"):
        os.environ["MLFLOW_TRACKING_URI"] = take(os.environ["MLFLOW_TRACKING_URI"])
    uris = {key: options(entry).get("tracking_uri") for key, entry in logger_entries(trainer)
            if kind_of(entry) == "mlflow"}
    edits = [(f"{key}.init_args.tracking_uri", taken) for key, uri in uris.items()
             if uri and (taken := take(uri)) != uri]
    servers = {server_of(uri or os.environ.get("MLFLOW_TRACKING_URI", "")) for uri in uris.values()}
    if not (_moved and servers and _moved["server"] not in servers):
        return edits, None
    mine = [key for key in CREDENTIALS if os.environ.get(key) == _moved[key]]  # (not a value the user set since)
    for key in mine:
        del os.environ[key]
    server = _moved["server"]
    _moved.clear()
    return edits, server if mine else None


@contextlib.contextmanager
def credentials_put_back():
    """A dry start (--plan) moves credentials as a real one does (its checks send them), then puts them back: printing
    a plan changes nothing in the process (a notebook's next start)."""
    saved, moved = {key: os.environ.get(key) for key in ("MLFLOW_TRACKING_URI", *CREDENTIALS)}, dict(_moved)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _moved.clear()
        _moved.update(moved)


def server_of(uri: str) -> str:
    """scheme://host:port of a URI, without its user:password."""
    parts = urllib.parse.urlsplit(bare(uri))
    return f"{parts.scheme}://{parts.netloc}"


def _check_wandb(entry: Namespace) -> None:
    args, kwargs = options(entry), entry.get("dict_kwargs") or {}
    mode = os.environ.get("WANDB_MODE") or kwargs.get("mode") or ""
    if args.get("offline") or mode in ("offline", "dryrun", "disabled"):
        return
    url = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
    offline = "run offline with WANDB_MODE=offline and `wandb sync` the run later"
    parts = urllib.parse.urlsplit(url)
    try:  # 5 s; W&B alone waits ~2 minutes
        socket.create_connection((parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)), 5).close()
    except (OSError, ValueError) as error:
        raise ConfigError(f"W&B (online) at {redact(url)} cannot be reached ({error}): check the network, or "
                          f"{offline}") from None
    try:  # where `wandb login` puts it
        key = os.environ.get("WANDB_API_KEY") or netrc.netrc().authenticators(parts.hostname)
    except (OSError, netrc.NetrcParseError):
        key = None
    if not key:  # else wandb.init fails ~10 s later, with a traceback, after the run dir exists
        raise ConfigError(f"W&B (online) has no API key for {redact(url)}: run `wandb login` (it writes ~/.netrc) "
                          f"or set WANDB_API_KEY, or {offline}")


def health_request(uri: str) -> urllib.request.Request:
    """A request for an MLflow server's /health, with MLflow's basic auth (hidden_credentials put a URI's there): a
    proxy in front of the server may guard /health too."""
    request = urllib.request.Request(bare(uri).rstrip("/") + "/health")
    user, password = (os.environ.get(key) for key in CREDENTIALS)
    if user and password:
        request.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
    return request


def _check_mlflow(args: Namespace) -> None:
    """Also refuses an experiment deleted on the server (MLFlowLogger would fail after the run dir is made)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    uri = args.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
    file_store = uri is None or uri.startswith("file:") or "://" not in uri
    if file_store and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("1", "true"):
        where = uri or f"file store {args.get('save_dir') or './mlruns'}"
        raise ConfigError(f"MLflow 3 refuses its file store ({where}): set trainer.logger's tracking_uri to a "
                          "database (sqlite:///runs/mlflow.db) or a server (http://127.0.0.1:5000, started with "
                          "`mlflow server --backend-store-uri sqlite:///mlflow.db`), or MLFLOW_ALLOW_FILE_STORE=true")
    if uri and uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(health_request(uri), timeout=10) as answer:
                answer.read()
        except (OSError, ValueError) as error:  # (urllib's URLError and HTTPError are OSErrors)
            reason = redact(str(getattr(error, "reason", error)))
            raise ConfigError(f"the MLflow tracking server {redact(uri)} does not answer ({reason}): start it (mlflow "
                              "server --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port 5000) or fix "
                              "trainer.logger's tracking_uri") from None
    uri, name = tracking_uri(uri), args.get("experiment_name") or "lightning_logs"
    local = uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else urllib.parse.urlsplit(uri).path
    if (uri.startswith(("sqlite:///", "file:")) or "://" not in uri) and not os.path.exists(local):  # the resolved URI
        return  # a database or file store not made yet has no experiment (and is not made here: nothing is written)
    try:
        found = MlflowClient(uri).get_experiment_by_name(name)
    except MlflowException as error:
        raise ConfigError(f"the MLflow tracking server {redact(uri)} could not look up experiment {name!r} "
                          f"({redact(str(error)).splitlines()[0][:200]}): check trainer.logger's tracking_uri and "
                          "the credentials (MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD)") from None
    if found is not None and found.lifecycle_stage == "deleted":
        raise ConfigError(f"the MLflow experiment {name!r} is deleted on {redact(uri)}: restore it (mlflow "
                          f"experiments restore --experiment-id {found.experiment_id}) or set trainer.logger's "
                          "experiment_name to another one")


def tracking_uri(given: Optional[str]) -> str:
    """The given URI, else MLflow's current one ($MLFLOW_TRACKING_URI, its default, or the one a logger set)."""
    import mlflow

    return given or mlflow.get_tracking_uri()


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'model': {'depth': 18}} -> {'model.depth': 18}: a tracker's parameters, one per option."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and "class_path" in value:  # a part chosen by class: its options as the CLI
            flat[f"{name}.class_path"] = value["class_path"]   # spells them (--model.depth), without init_args
            flat.update(flat_config(value.get("init_args") or {}, name + "."))
        elif isinstance(value, dict) and value:
            flat.update(flat_config(value, name + "."))
        else:
            flat[name] = value
    return flat


def log_config(loggers: list, config: dict[str, Any], config_file: Path) -> None:
    """Send the resolved config to each tracker: its options as parameters, config.yaml as an artifact."""
    params = {k: (v if isinstance(v, (int, float, bool)) or v is None else redact(v if isinstance(v, str) else
                                                                                   json.dumps(v, default=str)))
              for k, v in flat_config(config).items()}
    for logger in loggers:
        kind = KINDS.get(type(logger).__name__)
        if kind == "mlflow":
            client, run_id = logger.experiment, logger.run_id
            present = client.get_run(run_id).data.params  # a resumed run: MLflow does not let a parameter change
            logger.log_hyperparams({k: v for k, v in params.items() if k not in present})
            if config_file.is_file():
                client.log_artifact(run_id, str(config_file))
        elif kind == "wandb":
            logger.experiment.config.update(params, allow_val_change=True)
            if config_file.is_file():
                logger.experiment.save(str(config_file), base_path=str(config_file.parent), policy="now")
        elif kind in ("tensorboard", "csv"):
            logger.log_hyperparams(params)


def how_to_look(loggers: list, run_dir: Path) -> list[str]:
    """For the closing line: per tracker, the command or address that shows this run."""
    parts: list[str] = []
    for logger in loggers:
        kind = KINDS.get(type(logger).__name__)
        if kind == "tensorboard":
            parts.append(f"tensorboard --logdir {run_dir.parent}")
        elif kind == "csv":
            parts.append(f"metrics in {Path(logger.log_dir) / 'metrics.csv'}")
        elif kind == "mlflow":
            uri = redact(tracking_uri(None))  # the logger set it when it started its run
            where = f"experiments/{logger.experiment_id}/runs/{logger.run_id}"
            parts.append(f"MLflow {uri.rstrip('/')}/#/{where}" if uri.startswith(("http://", "https://")) else
                         f"MLflow run {logger.run_id}: mlflow ui --backend-store-uri {uri}")
            if (run_dir / PENDING).is_file():  # the server stopped answering (tracker_outage.py)
                parts[-1] += f" (not all sent yet: {run_dir / PENDING}, sent at the next start)"
        elif kind == "wandb":
            run = logger.experiment
            offline = getattr(run, "offline", False) or os.environ.get("WANDB_MODE") in ("offline", "dryrun")
            parts.append(f"W&B offline run {run.id}: wandb sync {Path(run.dir).parent}" if offline else
                         f"W&B {run.entity}/{run.project}/runs/{run.id}")
    return parts


@rank_zero_only
def continue_csv_logs(loggers: list, resume_step: int) -> None:
    """Keep each CSVLogger's rows before `resume_step` on resume (Lightning's deletes metrics.csv, PR #19446); called
    before the Trainer first touches its loggers."""
    for logger in (logger for logger in loggers if isinstance(logger, CSVLogger)):
        path = Path(logger.log_dir) / "metrics.csv"
        aside = path.with_name(path.name + ".resume")
        if path.is_file():
            os.replace(path, aside)
        if not aside.is_file():  # (one left by a start that crashed here is taken up)
            continue
        writer = logger.experiment  # created now, with no metrics.csv to delete
        with open(aside, newline="") as file:
            reader = csv.DictReader(file)
            writer.metrics_keys = list(reader.fieldnames or [])  # the header it writes, and appends under
            writer.metrics = [row for row in reader if int(float(row.get("step") or 0)) < resume_step]
        writer.save()  # a new metrics.csv with these rows; until it is whole, the rows are in metrics.csv.resume
        os.remove(aside)
