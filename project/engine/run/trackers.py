"""Experiment trackers (TensorBoard, CSV, MLflow, W&B; one or a list): one run dir, one tracked run per run.

    python -m project fit --config configs/quickstart.yaml --config configs/tracking/mlflow.yaml
    python -m project fit --config configs/quickstart.yaml --config configs/tracking/mlflow.yaml --ckpt_path last

Whatever `trainer.logger` holds, the run dir (chosen by project.engine.run.resume) keeps the checkpoints, config.yaml and
every file-based logger's output (TensorBoard and CSV pinned to it, W&B's local files in it). A tracker's own store
(an MLflow server or database, W&B's servers) is written only through its API. The ids of the tracked runs are kept
in `<run dir>/trackers.json`: a resume into the run dir (`--ckpt_path last`, a Slurm requeue, a torchrun restart)
continues the same MLflow run and W&B run, at the steps the checkpoint restores; a new run dir gets new tracked runs.
Each tracker is checked at start-up, before anything is written: its package, MLflow's file store, a reachable server.
"""

import json
import os
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

from jsonargparse import Namespace

from project.engine.errors import ConfigError

TRACKERS_FILE = "trackers.json"
_KINDS = {"TensorBoardLogger": "tensorboard", "CSVLogger": "csv", "MLFlowLogger": "mlflow", "WandbLogger": "wandb"}
_PACKAGES = {"mlflow": "mlflow", "wandb": "wandb", "tensorboard": "tensorboard"}


def logger_entries(trainer: Namespace) -> list[Namespace]:
    """The configured loggers as class_path/init_args namespaces (the default logger is a TensorBoardLogger)."""
    logger = trainer.get("logger")
    if logger in (None, True, False):
        return []
    items = logger if isinstance(logger, list) else [logger]
    return [item for item in items if isinstance(item, Namespace)]


def kind_of(entry: Namespace) -> str:
    """'tensorboard', 'csv', 'mlflow', 'wandb' or 'other' for a logger's class_path."""
    return _KINDS.get(str(entry.get("class_path", "")).rsplit(".", 1)[-1], "other")


def _init_args(entry: Namespace) -> Namespace:
    if entry.get("init_args") is None:
        entry.init_args = Namespace()
    return entry.init_args


def _is_file_store(uri: Optional[str]) -> bool:
    return uri is None or uri.startswith("file:") or "://" not in uri


def check_trackers(trainer: Namespace) -> None:
    """ConfigError (one line, nothing written yet) for a tracker that cannot work: its package is missing, MLflow
    would use its refused file store, or its tracking server does not answer."""
    import importlib

    for entry in logger_entries(trainer):
        kind = kind_of(entry)
        package = _PACKAGES.get(kind)
        try:
            if package:
                importlib.import_module(package)  # what the logger will import (a broken install fails here too)
        except ImportError:
            raise ConfigError(f"trainer.logger {entry.class_path} needs the {package} package, which is not installed: "
                              f"pip install -e \".[tracking]\" (or pip install {package})") from None
        if kind == "mlflow":
            _check_mlflow(_init_args(entry))


def _check_mlflow(args: Namespace) -> None:
    uri = args.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
    allowed = os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("1", "true")
    if _is_file_store(uri) and not allowed:
        where = uri or f"file store {args.get('save_dir') or './mlruns'}"
        raise ConfigError(f"MLflow 3 refuses its file store ({where}): set trainer.logger's tracking_uri to a "
                          "database (sqlite:///runs/mlflow.db) or a server (http://127.0.0.1:5000, started with "
                          "`mlflow server --backend-store-uri sqlite:///mlflow.db`), or MLFLOW_ALLOW_FILE_STORE=true")
    if uri and uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=10) as answer:
                answer.read()
        except (urllib.error.URLError, OSError, ValueError) as error:
            reason = getattr(error, "reason", error)
            raise ConfigError(f"the MLflow tracking server {uri} does not answer ({reason}): start it (mlflow server "
                              "--backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port 5000) or fix "
                              "trainer.logger's tracking_uri") from None


def read_tracked_runs(run_dir: Path) -> dict[str, str]:
    """The tracked-run ids a previous start of this run dir recorded ({} for a new run dir)."""
    try:
        loaded = json.loads((run_dir / TRACKERS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in loaded.items()} if isinstance(loaded, dict) else {}


def git_commit() -> Optional[str]:
    """The checkout's commit (with '-dirty' for uncommitted changes), or None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def point_trackers(trainer: Namespace, run_dir: Path, *, resuming: bool) -> None:
    """Make the trackers continue this run dir's tracked runs (MLflow run_id, W&B id) when resuming into it and keep
    W&B's local files in it; tags carry the git commit. Edits the parsed config in place. (TensorBoard and CSV are
    pinned to the run dir by project.engine.run.resume.)"""
    ids = read_tracked_runs(run_dir) if resuming else {}
    commit = git_commit()
    for entry in logger_entries(trainer):
        kind, args = kind_of(entry), _init_args(entry)
        if kind == "mlflow":
            if ids.get("mlflow"):
                args.run_id = ids["mlflow"]
            if commit:
                args.tags = {**(args.get("tags") or {}), "git_commit": commit}
        elif kind == "wandb":
            args.save_dir = str(run_dir)
            args.id = args.get("id") or ids.get("wandb") or _new_wandb_id()
            # dict_kwargs (the **kwargs of WandbLogger) are passed to wandb.init
            if commit:
                entry.dict_kwargs = {**(entry.get("dict_kwargs") or {}), "config": {"git_commit": commit}}


def _new_wandb_id() -> str:
    import secrets

    return secrets.token_hex(4)  # W&B's own ids are 8 characters of [a-z0-9]


def record_tracked_runs(loggers: list, run_dir: Path) -> None:
    """Write the tracked-run ids into the run dir (global rank 0, once the runs exist), so a resume continues them."""
    from project.engine.run.checkpoint_io import atomic_write

    ids = read_tracked_runs(run_dir)
    for logger in loggers:
        kind = _KINDS.get(type(logger).__name__)
        if kind == "mlflow":
            ids["mlflow"] = logger.run_id
            ids["mlflow_experiment_id"] = logger.experiment_id
        elif kind == "wandb":
            ids["wandb"] = logger.experiment.id
    if ids:
        text = json.dumps(ids, indent=1) + "\n"
        atomic_write(run_dir / TRACKERS_FILE, lambda file: file.write(text.encode()))


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'model': {'arch': 'resnet18'}} -> {'model.arch': 'resnet18'}: a tracker's parameters, one per option."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and "class_path" not in value:
            flat.update(flat_config(value, name + "."))
        else:
            flat[name] = value
    return flat


def log_config(loggers: list, config: dict[str, Any], config_file: Path) -> None:
    """Send the resolved config to each tracker: its options as parameters, config.yaml as an artifact.

    A resumed MLflow run already holds its first start's parameters, which MLflow does not let change: only keys it
    lacks are logged then (each start's config.yaml stays in the run dir: config.<n>.yaml)."""
    params = {k: (v if isinstance(v, (int, float, str, bool)) or v is None else json.dumps(v, default=str))
              for k, v in flat_config(config).items()}
    for logger in loggers:
        kind = _KINDS.get(type(logger).__name__)
        if kind == "mlflow":
            client, run_id = logger.experiment, logger.run_id
            present = client.get_run(run_id).data.params
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
        kind = _KINDS.get(type(logger).__name__)
        if kind == "tensorboard":
            parts.append(f"tensorboard --logdir {run_dir.parent}")
        elif kind == "csv":
            parts.append(f"metrics in {Path(logger.log_dir) / 'metrics.csv'}")
        elif kind == "mlflow":
            import mlflow

            uri = mlflow.get_tracking_uri()  # the logger set it when it started its run
            where = f"experiments/{logger.experiment_id}/runs/{logger.run_id}"
            if uri.startswith(("http://", "https://")):
                parts.append(f"MLflow {uri.rstrip('/')}/#/{where}")
            else:
                parts.append(f"MLflow run {logger.run_id}: mlflow ui --backend-store-uri {uri}")
        elif kind == "wandb":
            run = logger.experiment
            if getattr(run, "offline", False) or os.environ.get("WANDB_MODE") in ("offline", "dryrun"):
                parts.append(f"W&B offline run {run.id}: wandb sync {Path(run.dir).parent}")
            else:
                parts.append(f"W&B {run.entity}/{run.project}/runs/{run.id}")
    return parts


def continue_csv_logs(loggers: list, resume_step: int) -> None:
    """A fit resuming into its run dir keeps metrics.csv: each CSVLogger's rows logged before `resume_step` (the
    checkpoint's global_step; those at or after it are the stopped run's, which the resumed one logs again).

    Lightning's CSVLogger deletes metrics.csv when it starts in a run dir that has one (Lightning PR #19446; listed in
    project.engine.compat). Called once the Trainer exists and before it first touches its loggers: metrics.csv is moved
    aside, Lightning's writer is created (it finds nothing to delete), the kept rows are written back and the writer
    takes their header, so Lightning's own save() appends (or rewrites with a wider header when a key is new). A crash
    in between leaves the rows in metrics.csv.resume, which the next resume takes up."""
    import csv
    import io

    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.utilities import rank_zero_only

    from project.engine.run.checkpoint_io import atomic_write

    if rank_zero_only.rank != 0:
        return
    for logger in loggers:
        if not isinstance(logger, CSVLogger):
            continue
        path = Path(logger.log_dir) / "metrics.csv"
        aside = path.with_name(path.name + ".resume")
        if path.is_file():
            os.replace(path, aside)
        if not aside.is_file():  # (one left by a start that crashed here is taken up)
            continue
        writer = logger.experiment
        with open(aside, newline="") as file:
            reader = csv.DictReader(file)
            header = list(reader.fieldnames or [])
            rows = [row for row in reader if int(float(row.get("step") or 0)) < resume_step]
        if header:
            text = io.StringIO()
            table = csv.DictWriter(text, fieldnames=header)
            table.writeheader()
            table.writerows(rows)
            atomic_write(path, lambda file: file.write(text.getvalue().encode()))
            writer.metrics_keys = header  # Lightning's writer appends under the keys it holds
        os.remove(aside)
