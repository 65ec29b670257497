"""Which checkpoint and run dir a run continues in, decided once here (docs/reliability.md#which-checkpoint-wins).

    python -m classifier_engine fit --config CONFIG --ckpt_path last
"""

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from jsonargparse import Namespace

from classifier_engine.errors import CheckpointError, ConfigError, env_global_rank
from classifier_engine.run.checkpoint_checks import SAVED_AT
from classifier_engine.run.checkpoint_io import load_checkpoint, progress
from classifier_engine.run.launchers import torchelastic_restart
from classifier_engine.run.lock import RunLock, claim, claim_new_version
from classifier_engine.run.run_dirs import (
    CHECKPOINTS,
    LAST,
    LOGS,
    logger_version,
    next_version,
    run_dir_of,
    version_name,
)
from classifier_engine.run.slurm import slurm_job_id, slurm_restart_count
from classifier_engine.run.trackers import (
    check_trackers,
    hide_credentials,
    kind_of,
    logger_entries,
    point_trackers,
    tracked_runs_to_continue,
)
from classifier_engine.storage.files import local_path


@dataclass
class RunPlan:
    ckpt_path: Optional[Path] = None
    checkpoint: Optional[dict[str, Any]] = None  # ckpt_path's contents, loaded once; the CLI takes it (and drops it)
    run_dir: Optional[Path] = None  # None: not a fit (validate/test/predict log into a version dir of their own)
    fresh: bool = True  # a new run dir (fit without a checkpoint, or from one outside <root>)
    reason: str = ""
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    lock: Optional[RunLock] = None  # rank 0: the run dir (an evaluation's own) created and locked until release()


def describe_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint's contents, memory-mapped (cheap); CheckpointError when it does not load or is not ours."""
    loaded = load_checkpoint(path, mmap=True)
    missing = [key for key in ("state_dict", "epoch", "global_step") if key not in loaded]
    if missing:
        raise CheckpointError(f"{path} is not a Lightning training checkpoint (it lacks {', '.join(missing)})")
    return loaded


def checkpoint_files(*directories: Path) -> list[Path]:
    """The *.ckpt files of these directories (a save in progress writes a .partial: never a candidate)."""
    return sorted(p for d in directories for p in d.glob("*.ckpt") if p.is_file())


def newest_loadable(candidates: list[Path], plan: RunPlan) -> Optional[tuple[Path, dict]]:
    """By what each checkpoint records, never file times (a copy resets them): the run that saved last, and in it the
    checkpoint furthest along (last.ckpt on a tie). Those that do not load go to plan.skipped with their reason."""
    loaded = []
    for path in candidates:
        try:
            loaded.append((path, describe_checkpoint(path)))
        except CheckpointError as error:
            plan.skipped.append((path, str(error)))
    saved: dict[Path, float] = {}
    for path, checkpoint in loaded:
        saved[path.parent] = max(saved.get(path.parent, 0.0), float(checkpoint.get(SAVED_AT) or 0.0))
    return max(loaded, default=None, key=lambda c: (saved[c[0].parent], *progress(c[1]), c[0].name == LAST))


def _file_loggers(trainer: Namespace) -> list[Namespace]:
    """The configured TensorBoard/CSV loggers (one, or in a list), whose directory is save_dir/name/version."""
    return [entry for entry in logger_entries(trainer) if kind_of(entry) in ("tensorboard", "csv")]


def logs_dir(trainer: Namespace, root: Path) -> Path:
    """Where the version dirs live: the first TensorBoard/CSV logger's save_dir/name, else <root>/lightning_logs."""
    files = _file_loggers(trainer)
    if not files:
        return root / LOGS
    args = files[0].init_args
    return Path(args.get("save_dir") or root, args.get("name", LOGS) or "")  # name None or "": no folder of its own


def pin_logger_version(trainer: Namespace, save_dir: Path, version: int | str) -> None:
    """Make the default logger (a TensorBoardLogger in <save_dir>/lightning_logs) and every TensorBoard or CSV logger
    write into the first one's save_dir/name/version: one run dir (edits the parsed config in place)."""
    if trainer.logger in (None, True):
        trainer.logger = Namespace(class_path="lightning.pytorch.loggers.TensorBoardLogger",
                                   init_args=Namespace(save_dir=str(save_dir), name=LOGS, version=version))
        return
    for entry in (files := _file_loggers(trainer)):
        args, first = entry.init_args, files[0].init_args
        args.save_dir, args.name, args.version = first.get("save_dir"), first.get("name", LOGS), version


def _skipped_note(plan: RunPlan) -> str:
    return "".join(f"; skipped {path} ({why})" for path, why in plan.skipped)


def start_run(subcommand: str, config: Namespace) -> RunPlan:
    """The CLI's one call: plan_run, with the run dir claimed by global rank 0 (the other ranks write nothing and
    rely on its lock). The caller ends it: plan.lock.release() (remove_failed_start() after a failure)."""
    return plan_run(subcommand, config, claim_run_dir=env_global_rank() == 0)


def plan_run(subcommand: str, config: Namespace, *, claim_run_dir: bool = False) -> RunPlan:
    """Decide the checkpoint and run dir of `subcommand` and write them into the parsed `config` (in place); with
    claim_run_dir the run dir is created and locked as it is chosen (RunDirInUse if a live run holds it)."""
    trainer = config.trainer
    root_text = str(trainer.default_root_dir or os.getcwd())
    if local_path(root_text) is None:
        raise ConfigError(f"trainer.default_root_dir {root_text}: runs write to a local or mounted filesystem, or to "
                          "s3://bucket/prefix (through a node-local mirror); point it at one of those")
    root = Path(local_path(root_text))
    hide_credentials(trainer)  # before anything prints, saves or sends the tracking URI
    if subcommand == "fit":
        check_trackers(trainer)  # a missing package, MLflow's file store, a server that does not answer: one line
    logs = logs_dir(trainer, root)
    group = config.get("checkpoint")
    given_dir = Path(group.dirpath) if group is not None and group.get("dirpath") else None
    job_id = slurm_job_id() if subcommand == "fit" else None
    job_dir = logs / f"slurm-{job_id}" if job_id else None
    plan = RunPlan()
    requested = config.get("ckpt_path")
    chosen = _choose_checkpoint(plan, subcommand, requested, logs, (root / CHECKPOINTS, *filter(None, [given_dir])),
                                given_dir, job_dir)
    if chosen is not None:
        plan.ckpt_path, plan.checkpoint = chosen
        config.ckpt_path = str(plan.ckpt_path)
    elif requested == "last":
        config.ckpt_path = None
        if subcommand != "fit":
            raise CheckpointError(f"--ckpt_path last: no loadable checkpoint under {logs}{_skipped_note(plan)}; "
                                  "pass the checkpoint's path instead")
    if subcommand == "fit":
        _place_run(plan, trainer, root, logs, given_dir, job_dir, claim_run_dir)
    elif trainer.logger is not False and (trainer.logger in (None, True) or _file_loggers(trainer)):
        # An evaluation's records are its own, never a training run's (whose config.yaml pins its logger's version);
        # the dir is made now: an unwritable root is one line before anything runs.
        plan.lock = claim_new_version(logs) if claim_run_dir else None
        pin_logger_version(trainer, root, logger_version(plan.lock.run_dir.name) if plan.lock else next_version(logs))
    return plan


def looks_for_checkpoints(subcommand: str, requested: Optional[str]) -> bool:
    """Whether this start may continue from a checkpoint it finds (--ckpt_path last, a restarted fit)."""
    restarted = (torchelastic_restart() or 0) > 0 or (slurm_job_id() is not None and slurm_restart_count() > 0)
    return requested == "last" or (subcommand == "fit" and restarted)


def _choose_checkpoint(plan: RunPlan, subcommand: str, requested: Optional[str], logs: Path, extra: tuple[Path, ...],
                       given_dir: Optional[Path], job_dir: Optional[Path]) -> Optional[tuple[Path, dict]]:
    """The checkpoint to continue from (the table in docs/reliability.md), loaded; plan.reason says why."""
    chosen: Optional[tuple[Path, dict]] = None
    restarted = subcommand == "fit" and (torchelastic_restart() or 0) > 0
    if job_dir is not None and slurm_restart_count() > 0:
        chosen = newest_loadable(checkpoint_files(given_dir or job_dir / CHECKPOINTS), plan)
        if chosen:
            given = f" instead of --ckpt_path {requested}" if requested else ""
            restart = f"Slurm job {slurm_job_id()} (restart {slurm_restart_count()})"
            plan.reason = f"{restart}: resuming from {chosen[0]}{given}"
    elif restarted and requested not in (None, "last"):
        # A restarted attempt has the first one's command line: its own newer checkpoints win over the given one.
        own = run_dir_of(Path(requested).expanduser(), logs)
        chosen = newest_loadable(checkpoint_files(own / CHECKPOINTS), plan) if own is not None else None
        if chosen:
            plan.reason = f"torchrun restart {torchelastic_restart()}: resuming from {chosen[0]} (its run's newest)"
    if chosen is None and (requested == "last" or (restarted and requested is None)):
        chosen = newest_loadable(checkpoint_files(*sorted(logs.glob(f"*/{CHECKPOINTS}")), *extra), plan)
        why = f"torchrun restart {torchelastic_restart()}" if restarted and requested is None else "--ckpt_path last"
        plan.reason = f"{why}: " + (f"resuming from {chosen[0]}" if chosen else
                                    f"no loadable checkpoint under {logs} yet; starting from scratch")
    elif chosen is None and requested:
        path = Path(requested).expanduser()
        chosen = path, describe_checkpoint(path)
        plan.reason = f"resuming from {chosen[0]}" if subcommand == "fit" else f"checkpoint {chosen[0]}"
    plan.reason += _skipped_note(plan)
    return chosen


def _place_run(plan: RunPlan, trainer: Namespace, root: Path, logs: Path, given_dir: Optional[Path],
               job_dir: Optional[Path], claim_run_dir: bool) -> None:
    """The fit's run dir (claimed and locked when asked), with the loggers pointed at it."""
    if given_dir is not None:  # the user chose where checkpoints go: that folder's parent is the run dir
        plan.run_dir, plan.fresh = given_dir.parent, False
    elif job_dir is not None:
        plan.run_dir, plan.fresh = job_dir, not job_dir.exists()
    elif plan.ckpt_path is not None and (existing := run_dir_of(plan.ckpt_path, logs)) is not None:
        plan.run_dir, plan.fresh = existing, False
    # Checked before the run dir is claimed: a resume refused here leaves it as it was.
    ids = tracked_runs_to_continue(trainer, plan.run_dir) if not plan.fresh and plan.run_dir is not None else {}
    if claim_run_dir:
        plan.lock = claim(plan.run_dir) if plan.run_dir is not None else claim_new_version(logs)
        plan.run_dir = plan.lock.run_dir
    elif plan.run_dir is None:
        plan.run_dir = logs / version_name(next_version(logs))
    point_trackers(trainer, plan.run_dir, ids)
    if given_dir is None:
        # (With loggers that write elsewhere, saved_config.py places the checkpoints in the run dir, not the config.)
        pin_logger_version(trainer, root, logger_version(plan.run_dir.name))
