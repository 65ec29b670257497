"""Resume into the run it came from: `fit --ckpt_path last` finds the newest checkpoint and keeps its version dir.

    python -m project fit --config configs/quickstart.yaml --ckpt_path last

Lightning alone resolves "last" inside the *new* run's (empty) version dir, starts from scratch with a warning,
and a resumed run's curves land in a new version_N. Here "last" means the newest of
<default_root_dir>/lightning_logs/*/checkpoints/last*.ckpt and the preemption checkpoints hpc_ckpt_*.ckpt
(in default_root_dir or a run dir), and a checkpoint inside a version dir pins the logger to that version.
"""

from pathlib import Path
from typing import Optional

from jsonargparse import Namespace

LOGS = "lightning_logs"
# Loggers whose directory is save_dir/name/version, so pinning `version` pins the directory.
VERSIONED_LOGGERS = ("TensorBoardLogger", "CSVLogger")


def find_last_checkpoint(default_root_dir: str | Path) -> Optional[Path]:
    """The most recently written last*.ckpt of any version, or hpc_ckpt_*.ckpt, under default_root_dir."""
    root = Path(default_root_dir)
    candidates = [
        *root.glob(f"{LOGS}/*/checkpoints/last*.ckpt"),
        *root.glob("hpc_ckpt_*.ckpt"),  # Lightning's own SLURM handler
        *root.glob(f"{LOGS}/*/hpc_ckpt_*.ckpt"),  # ours (project/slurm.py), in the job's run dir
    ]
    return max(candidates, key=lambda p: p.stat().st_mtime, default=None)


def version_of(checkpoint: str | Path, default_root_dir: str | Path) -> Optional[str]:
    """The version dir name of <root>/lightning_logs/<version>/checkpoints/*.ckpt or <root>/lightning_logs/<version>/*.ckpt."""
    path = Path(checkpoint).resolve()
    logs = (Path(default_root_dir) / LOGS).resolve()
    if path.parent.name == "checkpoints" and path.parent.parent.parent == logs:
        return path.parent.parent.name
    if path.parent.parent == logs:  # a preemption checkpoint in the run dir itself
        return path.parent.name
    return None


def version_number(name: str) -> int | str:
    """TensorBoardLogger writes `version_{int}` for ints and the string itself otherwise."""
    prefix = "version_"
    return int(name[len(prefix):]) if name.startswith(prefix) and name[len(prefix):].isdigit() else name


def pin_logger_version(trainer: Namespace, save_dir: str | Path, version: int | str) -> None:
    """Make the run log into <save_dir>/lightning_logs/<version> (edits the parsed trainer config in place).

    The default logger becomes a TensorBoardLogger pinned to that version; a configured TensorBoard or CSV logger
    gets the version; any other logger is left as configured.
    """
    logger = trainer.logger
    if logger in (None, True):
        trainer.logger = Namespace(
            class_path="lightning.pytorch.loggers.TensorBoardLogger",
            init_args=Namespace(save_dir=str(save_dir), name=LOGS, version=version),
        )
    elif isinstance(logger, Namespace) and str(logger.get("class_path", "")).rsplit(".", 1)[-1] in VERSIONED_LOGGERS:
        logger.init_args.version = version
