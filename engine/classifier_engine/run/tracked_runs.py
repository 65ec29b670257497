"""The tracked runs (MLflow, W&B) a run dir continues: recorded in its trackers.json once they exist, continued by a
resume in that run dir, never by a copy of it elsewhere (docs/reliability.md#trackers).

    python -m classifier_engine fit --config CONFIG --config MLFLOW.yaml --ckpt_path last
"""

import json
import secrets
import subprocess
from pathlib import Path
from typing import Any, Optional

from jsonargparse import Namespace
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from classifier_engine.errors import ConfigError
from classifier_engine.run.trackers import KINDS, bare, kind_of, logger_entries, options, redact, tracking_uri
from classifier_engine.storage.files import atomic_write

TRACKERS_FILE = "trackers.json"


def read_tracked_runs(run_dir: Path) -> dict[str, str]:
    """The tracked-run ids a previous start recorded; ConfigError when damaged (a new run would fork)."""
    path = run_dir / TRACKERS_FILE
    try:
        loaded = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        loaded = error
    if not (isinstance(loaded, dict) and all(isinstance(v, str) for v in loaded.values())):
        what = f"not JSON: {loaded}" if isinstance(loaded, Exception) else "not an object of ids"
        raise ConfigError(f"{path} is damaged ({what}): it names the tracked runs (MLflow, W&B) this run dir "
                          "continues; restore it, or delete it to go on in new tracked runs (the old ones stay on "
                          "their servers)")
    return loaded


def tracked_runs_to_continue(trainer: Namespace, run_dir: Path) -> dict[str, str]:
    """The tracked runs a resume in `run_dir` continues (one that cannot is left out, in a line)."""
    ids, here = read_tracked_runs(run_dir), str(run_dir.resolve())
    if ids.get("run_dir", here) != here:
        if Path(ids["run_dir"]).is_dir():
            raise ConfigError(f"{run_dir / TRACKERS_FILE} names the tracked runs of the run dir {ids['run_dir']}, "
                              "which still exists (a copy?): resuming here would log into that run's history; resume "
                              f"{ids['run_dir']} itself, or delete {run_dir / TRACKERS_FILE} to track this run dir as "
                              "new runs")
        rank_zero_info(f"{run_dir / TRACKERS_FILE} was written in {ids['run_dir']}, which is gone (moved here): its "
                       "tracked runs continue")
    for _, entry in logger_entries(trainer):
        if kind_of(entry) == "mlflow" and ids.get("mlflow") and not _mlflow_run_continues(options(entry), ids):
            ids = {key: value for key, value in ids.items() if not key.startswith("mlflow")}
    return ids


def git_commit() -> Optional[str]:
    """The checkout's commit (with '-dirty' for uncommitted changes), or None outside a git checkout."""
    try:  # --exclude='*': the commit's hash, never a tag's name
        described = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=40", "--exclude=*"],
                                   capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return described.stdout.strip() if described.returncode == 0 else None


def tracker_edits(trainer: Namespace, run_dir: Path, ids: dict[str, str]) -> list[tuple[str, Any]]:
    """Edits continuing the tracked runs `ids`, putting W&B's files into the run dir, and tagging the commit."""
    commit, edits = git_commit(), []
    for key, entry in logger_entries(trainer):
        kind, args = kind_of(entry), options(entry)
        if kind == "mlflow":
            if ids.get("mlflow"):
                edits.append((f"{key}.init_args.run_id", ids["mlflow"]))
            if commit:
                edits.append((f"{key}.init_args.tags", {**(args.get("tags") or {}), "git_commit": commit}))
        elif kind == "wandb":
            given = args.get("save_dir")
            if given and Path(given).resolve().parent != run_dir.resolve().parent:  # not a run dir of these logs
                rank_zero_warn(f"trainer.logger WandbLogger save_dir {given}: W&B's local files go into the run dir "
                               f"{run_dir} instead, beside its checkpoints and config.yaml")
            edits += [(f"{key}.init_args.save_dir", str(run_dir)),  # W&B's own id: 8 of [a-z0-9]
                      (f"{key}.init_args.id", args.get("id") or ids.get("wandb") or secrets.token_hex(4))]
            if commit:  # dict_kwargs: WandbLogger's **kwargs, which it passes to wandb.init
                edits.append((f"{key}.dict_kwargs", {**(entry.get("dict_kwargs") or {}),
                                                     "config": {"git_commit": commit}}))
    return edits


def _mlflow_run_continues(args: Namespace, ids: dict[str, str]) -> bool:
    """True when the run dir's MLflow run can go on here; else a line says a new one starts."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    uri, was = tracking_uri(args.get("tracking_uri")), ids.get("mlflow_tracking_uri")
    name, why = args.get("experiment_name") or "lightning_logs", None
    if was is not None and bare(was) != bare(uri):
        why = f"it was tracked at {was}, this run tracks at {redact(uri)}"
    else:
        try:
            client = MlflowClient(uri)
            run = client.get_run(ids["mlflow"])
            experiment = client.get_experiment(run.info.experiment_id)
            if "deleted" in (run.info.lifecycle_stage, experiment.lifecycle_stage):
                why = "it was deleted" if run.info.lifecycle_stage == "deleted" else "its experiment was deleted"
            elif experiment.name != name:  # MLFlowLogger would log into it all the same
                why = f"it is in experiment {experiment.name!r}, trainer.logger's experiment_name is {name!r}"
        except MlflowException as error:
            why = f"the tracking server does not have it ({redact(str(error)).splitlines()[0][:120]})"
    if why:  # (a deleted experiment `name` stopped the fit in check_trackers, before this)
        rank_zero_warn(f"the run dir's MLflow run {ids['mlflow']} cannot continue ({why}): a new MLflow run starts")
    return why is None


def record_tracked_runs(loggers: list, run_dir: Path) -> None:
    """Write the tracked-run ids into the run dir (global rank 0, once the runs exist), so a resume continues them."""
    ids = read_tracked_runs(run_dir)
    for logger in loggers:
        kind = KINDS.get(type(logger).__name__)
        if kind == "mlflow":
            ids.update(mlflow=logger.run_id, mlflow_experiment_id=logger.experiment_id,
                       mlflow_tracking_uri=bare(tracking_uri(None)))  # a resume elsewhere starts a new run
        elif kind == "wandb":
            ids["wandb"] = logger.experiment.id
    if ids:
        ids["run_dir"] = str(run_dir.resolve())  # a copy of the run dir must not continue these runs
        atomic_write(run_dir / TRACKERS_FILE, lambda file: file.write(json.dumps(ids, indent=1) + "\n"), mode="w")
