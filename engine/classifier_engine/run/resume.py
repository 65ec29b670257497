"""Which checkpoint a start continues from and which run dir it writes into (docs/reliability.md#which-checkpoint-wins):
read-only choices, for the run plan's placement passes; claiming the run dir is the start's (lock.py).

    python -m classifier_engine fit --config CONFIG --ckpt_path last
"""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from jsonargparse import Namespace

from classifier_engine.errors import CheckpointError, ConfigError
from classifier_engine.run.checkpoint_checks import SAVED_AT
from classifier_engine.run.checkpoint_io import load_checkpoint, progress
from classifier_engine.run.launchers import torchelastic_restart
from classifier_engine.run.run_dirs import CHECKPOINTS, LAST, LOGS, next_version, run_dir_of, version_name
from classifier_engine.run.slurm import slurm_job_id, slurm_restart_count
from classifier_engine.run.trackers import kind_of, logger_entries, options
from classifier_engine.storage.files import local_path


@dataclass(frozen=True)
class Where:
    """Where a start reads and writes: the root, its version dirs' folder, checkpoint.dirpath, a Slurm job's run dir."""

    root: Path
    logs: Path
    given_dir: Optional[Path]  # checkpoint.dirpath: its parent is the run dir
    job_dir: Optional[Path]  # <logs>/slurm-<job id> of a Slurm fit

    @classmethod
    def of(cls, subcommand: str, config: Namespace) -> "Where":
        trainer = config.trainer
        root_text = str(trainer.default_root_dir or os.getcwd())
        if (local := local_path(root_text)) is None:
            raise ConfigError(f"trainer.default_root_dir {root_text}: runs write to a local or mounted filesystem, or "
                              "to s3://bucket/prefix (through a node-local mirror); point it at one of those")
        root = Path(local)
        logs = logs_dir(trainer, root)
        group = config.get("checkpoint")
        given = Path(group.dirpath) if group is not None and group.get("dirpath") else None
        job_id = slurm_job_id() if subcommand == "fit" else None
        return cls(root, logs, given, logs / f"slurm-{job_id}" if job_id else None)


@dataclass(frozen=True)
class Choice:
    """The checkpoint a start continues from (loaded, memory-mapped), why, and the candidates that did not load."""

    path: Optional[Path] = None
    checkpoint: Optional[dict[str, Any]] = None
    reason: str = ""
    skipped: tuple[tuple[Path, str], ...] = ()


def describe_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint's contents, memory-mapped (cheap); CheckpointError when it does not load or is not ours."""
    loaded = load_checkpoint(path, mmap=True)
    missing = [key for key in ("state_dict", "epoch", "global_step") if key not in loaded]
    if missing:
        raise CheckpointError(f"{path} is not a Lightning training checkpoint (it lacks {', '.join(missing)})")
    return loaded


def newest_loadable(folders: list[Path], skipped: list, claims: Optional[dict[Path, tuple]] = None,
                    fetch: Callable[[Path], Any] = lambda path: None) -> Optional[tuple[Path, dict]]:
    """Of the folders' *.ckpt files (a save in progress writes a .partial: never a candidate), by what each records,
    never file times (a copy resets them): the run that saved last, and in it the checkpoint furthest along (last.ckpt
    on a tie). Those that do not load go to `skipped` with their reason. `claims`: stored checkpoints not read yet,
    with the records their upload metadata claims; each is fetched and read only when the choice would rest on its
    claim (a claim further than its file: one more download; one of an earlier save or less progress than its file
    hides that checkpoint, as deleting it would)."""
    named = {folder.resolve(): folder for folder in folders}  # each run's files under one name: a run is a folder
    claims = {named[path.parent.resolve()] / path.name: c for path, c in (claims or {}).items()
              if path.parent.resolve() in named}  # (not those of folders the choice does not look in)
    loaded, records = {}, {}

    def read(path: Path) -> None:
        try:
            loaded[path] = describe_checkpoint(path)
            records[path] = (float(loaded[path].get(SAVED_AT) or 0.0), *progress(loaded[path]))
        except CheckpointError as error:
            skipped.append((path, str(error)))

    for path in sorted(p for folder in named.values() for p in folder.glob("*.ckpt") if p.is_file()):
        if path not in claims:
            read(path)
    while (best := furthest(known := {**records, **claims})) is not None:
        # Its run's time must be read too, not claimed: the checkpoint of its run that saved last (a read one on a tie).
        stamp = max((path for path in known if path.parent == best.parent), key=lambda p: (known[p][0], p in records))
        if (unread := best if best in claims else stamp if stamp in claims else None) is None:
            return best, loaded[best]
        del claims[unread]
        fetch(unread)
        read(unread)
    return None


def furthest(records: dict[Path, tuple]) -> Optional[Path]:
    """The checkpoint a resume continues from, of their (saved_at, *progress()) records: the run (folder) that saved
    last, then the furthest along in it, last.ckpt on a tie."""
    runs: dict[Path, float] = {}
    for path, (saved_at, *_) in records.items():
        runs[path.parent] = max(runs.get(path.parent, 0.0), saved_at)
    return max(sorted(records), default=None,  # (on a tie, the first by name)
               key=lambda path: (runs[path.parent], *records[path][1:], path.name == LAST))


def file_loggers(trainer: Namespace) -> list[tuple[str, Namespace]]:
    """The configured TensorBoard/CSV loggers (one, or in a list), whose directory is save_dir/name/version."""
    return [(key, entry) for key, entry in logger_entries(trainer) if kind_of(entry) in ("tensorboard", "csv")]


def logs_dir(trainer: Namespace, root: Path) -> Path:
    """Where the version dirs live: the first TensorBoard/CSV logger's save_dir/name, else <root>/lightning_logs."""
    files = file_loggers(trainer)
    if not files:
        return root / LOGS
    args = options(files[0][1])
    return Path(args.get("save_dir") or root, args.get("name", LOGS) or "")  # name None or "": no folder of its own


def logger_pins(trainer: Namespace, save_dir: Path, version: int | str) -> list[tuple[str, Any]]:
    """Edits making the default logger (a TensorBoardLogger in <save_dir>/lightning_logs) and every TensorBoard or CSV
    logger write into the first one's save_dir/name/version: one run dir."""
    if trainer.logger in (None, True):
        return [("trainer.logger", Namespace(class_path="lightning.pytorch.loggers.TensorBoardLogger",
                                             init_args=Namespace(save_dir=str(save_dir), name=LOGS, version=version)))]
    files = file_loggers(trainer)
    first = options(files[0][1]) if files else None
    return [(f"{key}.init_args.{name}", value) for key, _ in files
            for name, value in (("save_dir", first.get("save_dir")), ("name", first.get("name", LOGS)),
                                ("version", version))]


def looks_for_checkpoints(subcommand: str, requested: Optional[str]) -> bool:
    """Whether this start may continue from a checkpoint it finds (--ckpt_path last, a restarted fit)."""
    restarted = (torchelastic_restart() or 0) > 0 or (slurm_job_id() is not None and slurm_restart_count() > 0)
    return requested == "last" or (subcommand == "fit" and restarted)


def choose_checkpoint(subcommand: str, requested: Optional[str], where: Where,
                      fetch: Optional[Callable[[Optional[Path]], dict]] = None) -> Choice:
    """The checkpoint to continue from (the table in docs/reliability.md), loaded, with the reason. `fetch` brings an
    object store's checkpoints into the mirror before they are read: one, those of one checkpoints folder, or (None)
    those whose metadata claims nothing, returning the others' claims (RemoteRoot.fetch_checkpoints)."""
    fetch = fetch or (lambda which: {})
    chosen: Optional[tuple[Path, dict]] = None
    skipped: list[tuple[Path, str]] = []
    restarted = subcommand == "fit" and (torchelastic_restart() or 0) > 0
    reason = ""
    if where.job_dir is not None and slurm_restart_count() > 0:
        fetch(folder := where.given_dir or where.job_dir / CHECKPOINTS)  # a requeue chooses in its own run dir only
        chosen = newest_loadable([folder], skipped)
        if chosen:
            given = f" instead of --ckpt_path {requested}" if requested else ""
            reason = f"Slurm job {slurm_job_id()} (restart {slurm_restart_count()}): resuming from {chosen[0]}{given}"
    elif restarted and requested not in (None, "last"):
        # A restarted attempt has the first one's command line: its own newer checkpoints win over the given one.
        own = run_dir_of(Path(requested).expanduser(), where.logs)
        if own is not None:
            fetch(own / CHECKPOINTS)
            chosen = newest_loadable([own / CHECKPOINTS], skipped)
        if chosen:
            reason = f"torchrun restart {torchelastic_restart()}: resuming from {chosen[0]} (its run's newest)"
    if chosen is None and (requested == "last" or (restarted and requested is None)):
        claims = fetch(None)  # a stored checkpoint is downloaded when its claim would win, then read
        runs = [path.parent for path in claims if path.parent.parent.parent.resolve() == where.logs.resolve()]
        folders = [*where.logs.glob(f"*/{CHECKPOINTS}"), *runs, where.root / CHECKPOINTS,
                   *filter(None, [where.given_dir])]  # (runs only in the store have no folder in the mirror yet)
        chosen = newest_loadable(folders, skipped, claims, fetch)
        why = f"torchrun restart {torchelastic_restart()}" if restarted and requested is None else "--ckpt_path last"
        reason = f"{why}: " + (f"resuming from {chosen[0]}" if chosen else
                               f"no loadable checkpoint under {where.logs} yet; starting from scratch")
        if chosen is None and subcommand != "fit":
            raise CheckpointError(f"--ckpt_path last: no loadable checkpoint under {where.logs}{_note(skipped)}; "
                                  "pass the checkpoint's path instead")
    elif chosen is None and requested:
        path = Path(requested).expanduser()
        fetch(path)  # a stored run's checkpoint, named by its mirror path (a requeue whose own dir has none)
        chosen = path, describe_checkpoint(path)
        reason = f"resuming from {path}" if subcommand == "fit" else f"checkpoint {path}"
    return Choice(*(chosen or (None, None)), reason + _note(skipped), tuple(skipped))


def _note(skipped: list[tuple[Path, str]]) -> str:
    return "".join(f"; skipped {path} ({why})" for path, why in skipped)


@dataclass(frozen=True)
class Place:
    """A fit's run dir: a given one (its checkpoints' folder's parent, a Slurm job's, a resumed run's), or a new
    version dir under `logs` (run_dir None until claimed or proposed)."""

    run_dir: Optional[Path]
    new: bool
    why: str


def choose_place(choice: Choice, where: Where) -> Place:
    """Where a fit writes: read-only (lock.py claims it)."""
    if where.given_dir is not None:  # the user chose where checkpoints go: that folder's parent is the run dir
        return Place(where.given_dir.parent, False, "checkpoint.dirpath's parent")
    if where.job_dir is not None:
        return Place(where.job_dir, not where.job_dir.exists(), f"Slurm job {slurm_job_id()}'s own run dir")
    if choice.path is not None and (existing := run_dir_of(choice.path, where.logs)) is not None:
        return Place(existing, False, "the resumed checkpoint's run dir")
    return Place(None, True, f"the next free version under {where.logs}")


def proposed(place: Place, where: Where, taken: tuple[int, ...] = ()) -> Path:
    """The run dir a place names, or the version a claim would take now (past `taken`: versions a store holds)."""
    return place.run_dir or where.logs / version_name(max([next_version(where.logs), *(n + 1 for n in taken)]))
