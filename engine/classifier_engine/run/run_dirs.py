"""A run dir's place and names: `<logs>/version_N/` or `slurm-<job id>/`; the only place that spells `version_N`.

    python -m classifier_engine fit --config CONFIG      # -> <root>/lightning_logs/version_<next N>/
"""

from pathlib import Path
from typing import Optional

LOGS = "lightning_logs"
CHECKPOINTS = "checkpoints"
LAST = "last.ckpt"  # <run dir>/checkpoints/last.ckpt, kept current by last_checkpoint.py
LOCK_FILE = ".lock"
SHARDS = "shards"  # a sharded checkpoint's key for the folder of tensors beside it (strategy fsdp2_sharded)
VERSION_PREFIX = "version_"


def version_of(name: str) -> Optional[int]:
    """N for a `version_N` dir name, else None (a `slurm-<job id>` dir, or any other name)."""
    number = name.removeprefix(VERSION_PREFIX)
    return int(number) if name.startswith(VERSION_PREFIX) and number.isdigit() else None


def version_name(version: int | str) -> str:
    """The dir name a logger gives `version`: `version_3` for 3, the string itself for a string."""
    return version if isinstance(version, str) else f"{VERSION_PREFIX}{version}"


def logger_version(name: str) -> int | str:
    """What a logger's `version` must be for it to write into the dir called `name` (version_name's inverse)."""
    return name if (number := version_of(name)) is None else number


def next_version(logs: Path) -> int:
    """As TensorBoardLogger counts: one past the highest version_N in the logs dir."""
    numbers = [n for p in logs.glob(f"{VERSION_PREFIX}*") if p.is_dir() and (n := version_of(p.name)) is not None]
    return max(numbers, default=-1) + 1


def run_dir_of(checkpoint: Path, logs: Path) -> Optional[Path]:
    """<logs>/<version> for a checkpoint in its checkpoints/ (or in the run dir itself), else None."""
    path, logs = checkpoint.resolve(), logs.resolve()
    if path.parent.name == CHECKPOINTS and path.parent.parent.parent == logs:
        return path.parent.parent
    if path.parent.parent == logs:
        return path.parent
    return None
