"""Checkpoints that load without running code, saved atomically (docs/how-it-works.md#what-a-checkpoint-holds).

    from classifier_engine.run.checkpoint_io import load_checkpoint   # weights-only, one-line errors
"""

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from classifier_engine.errors import CheckpointError, DiskFullError, untrusted_checkpoint_message
from classifier_engine.run.run_dirs import SHARDS
from classifier_engine.storage.files import atomic_write, local_path


def load_checkpoint(path: str | Path, map_location: Any = "cpu", *, mmap: bool = False,
                    shards: bool = True) -> dict[str, Any]:
    """torch.load(weights_only=True) with one-line errors: missing file, not a checkpoint, pickled code. Opens the
    file once (twice with mmap); a file that fails is examined afterwards. shards=False: a sharded checkpoint's file
    alone (its records and its folder's name), the folder not read."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist" + (" (it is a folder)" if path.is_dir() else "") +
                              "; pass a .ckpt file, or --ckpt_path last for the newest one under the run's root")
    try:
        try:
            loaded = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        except RuntimeError as error:
            if not (mmap and "mmap can only be used with files saved with" in str(error)):
                raise
            loaded = torch.load(path, map_location=map_location, weights_only=True)  # a legacy (non-zip) file
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as error:
        raise CheckpointError(_why_it_did_not_load(path, error)) from error
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{path} holds a {type(loaded).__name__}, not a checkpoint dictionary")
    if SHARDS in loaded and shards:
        from classifier_engine.run.sharded_checkpoints import read_sharded  # (torch.distributed.checkpoint: on use)

        return read_sharded(path, loaded)
    return loaded


def _why_it_did_not_load(path: Path, error: BaseException) -> str:
    """The one line for a file torch.load refused: not an archive at all, pickled code, or damaged."""
    with open(path, "rb") as file:
        head = file.read(4)
    size = path.stat().st_size
    if not (head.startswith(b"PK") or head.startswith(b"\x80")):  # torch.save's zip archive, or a legacy pickle
        return (f"{path} is not a checkpoint: a .ckpt file is a torch.save archive, this one starts with {head!r} "
                f"({size} bytes)")
    if (untrusted := untrusted_checkpoint_message(error, path)) is not None:
        return untrusted
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    if isinstance(error, pickle.UnpicklingError):
        return f"{path} is not a checkpoint torch can read ({reason[:160]})"
    return f"{path} is not a complete checkpoint ({size} bytes; {reason[:160]})"


def progress(checkpoint: dict[str, Any]) -> tuple[int, int, int]:
    """How far a checkpoint's training got, by its own records: optimizer steps, epochs, then training batches (a stop
    between two steps of gradient accumulation is further along at the same step)."""
    batches = checkpoint.get("loops")  # Lightning's fit loop state; absent in a checkpoint not saved by a fit
    for key in ("fit_loop", "epoch_loop.batch_progress", "total", "completed"):
        batches = batches.get(key) if isinstance(batches, dict) else None
    return checkpoint["global_step"], checkpoint["epoch"], batches if isinstance(batches, int) else 0


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's CheckpointIO with same-directory, fsynced, atomic saves and weights_only loading."""

    _handed: Optional[tuple[str, dict[str, Any]]] = None  # (real path, checkpoint) from hand_over

    def __init__(self, remote: Any = None):
        """`remote`: a RemoteRoot (run/remote_runs.py) each checkpoint is uploaded to once it is saved here."""
        super().__init__()
        self.remote = remote
        self.stored: dict[str, str] = {}  # local path: where it is durable now (its URL once uploaded)

    def stored_at(self, path: Any) -> str:
        """Where the checkpoint saved at `path` is durable: its URL in the object store, or the path itself."""
        return self.stored.get(str(path), str(path))

    def hand_over(self, path: Path, checkpoint: dict[str, Any]) -> None:
        """The next load of `path` returns `checkpoint` (already loaded, and checked, by the run plan) once."""
        self._handed = (os.path.realpath(path), checkpoint)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or (local := local_path(path)) is None:
            return super().save_checkpoint(checkpoint, path, storage_options)
        try:  # ZipFile reads the central directory, written last: the archive is whole
            saved = atomic_write(local, lambda file: torch.save(checkpoint, file),
                                 check=lambda temp: zipfile.ZipFile(temp).close(),
                                 fix="Free space or point --trainer.default_root_dir at a larger disk, then resume "
                                     "with --ckpt_path last")
        except DiskFullError as full:
            raise CheckpointError(str(full)) from full.__cause__
        if self.remote is not None:
            uploaded = self.remote.store_checkpoint(saved)
            self.stored[str(path)] = self.remote.url_of(saved) if uploaded else str(path)
            if uploaded:
                self.remote.sync(saved.parent.parent)  # the run dir's config.yaml and logs beside it

    def remove_checkpoint(self, path: Any) -> None:
        super().remove_checkpoint(path)
        if self.remote is not None and (local := local_path(path)) is not None:
            self.remote.delete(Path(local))

    def load_checkpoint(self, path: Any, map_location: Optional[Callable] = lambda storage, loc: storage,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        local = local_path(path)
        if local is None:
            return super().load_checkpoint(path, map_location, weights_only=True)
        if self._handed is not None and self._handed[0] == os.path.realpath(local):
            checkpoint, self._handed = self._handed[1], None  # given once: the run does not keep it alive
            return checkpoint
        return load_checkpoint(local, map_location)

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the Trainer for its processes: they read the file themselves rather than receive a copy.
        return {**self.__dict__, "_handed": None}
