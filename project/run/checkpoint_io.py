"""Checkpoint files that survive kill -9, a full disk and any $TMPDIR, and that load without running code.

    python -m project fit --config configs/quickstart.yaml      # installed by the CLI for every run

Saving: the checkpoint is written to a temporary file in the destination directory, flushed, fsynced, checked to be
a complete archive, then renamed over the old file, and the directory is fsynced: a save that fails (an exception,
ENOSPC, kill -9) leaves the previous file intact and nothing partial under a checkpoint name. Lightning's own save
writes its temporary file in $TMPDIR and moves it: across filesystems (local /tmp, runs on NFS or Lustre) the move
is a copy in place, and kill -9 during it left a 0-byte last.ckpt (project.compat lists it).
Loading: always `torch.load(weights_only=True)`, whatever the torch version's default or the caller asks: our
checkpoints hold tensors and plain values only, and a crafted one is refused with one line naming the file.
"""

import errno
import os
import pickle
import re
import socket
import zipfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO

from project.errors import CheckpointError

PARTIAL_SUFFIX = ".partial"  # temp files are `.<name>.<host>-<pid>.partial`: never a name `--ckpt_path last` picks
HOST = socket.gethostname().replace(".", "_")


def _is_local(path: Any) -> bool:
    return "://" not in str(path) or str(path).startswith("file://")


def partial_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{HOST}-{os.getpid()}{PARTIAL_SUFFIX}")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; the rename is still atomic there
        pass
    finally:
        os.close(fd)


def remove_stale_partials(directory: Path) -> None:
    """Delete temp files that a killed save on this host left behind (their writer is gone); a live writer's, and
    other hosts' (whose processes cannot be checked from here), are kept."""
    for leftover in directory.glob(f".*.{HOST}-*{PARTIAL_SUFFIX}"):
        pid = leftover.name.removesuffix(PARTIAL_SUFFIX).rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            leftover.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _disk_full(error: BaseException) -> bool:
    """ENOSPC or EDQUOT, raised directly or behind torch's writer (a RuntimeError whose context is the OSError)."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        error = error.__cause__ or error.__context__
    return False


def save_atomically(checkpoint: dict[str, Any], path: Path) -> None:
    """torch.save into a temp file beside `path`, fsync, verify, rename over `path`, fsync the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = partial_path(path)
    try:
        with open(temp, "wb") as file:
            torch.save(checkpoint, file)
            file.flush()
            try:
                os.fsync(file.fileno())
            except OSError as error:  # a filesystem without fsync (EINVAL): the rename below is still atomic
                if error.errno not in (errno.EINVAL, errno.ENOTSUP):
                    raise
        with zipfile.ZipFile(temp) as archive:  # reads the central directory, written last: the file is whole
            archive.namelist()
        os.replace(temp, path)
    except BaseException as error:
        temp.unlink(missing_ok=True)
        if _disk_full(error):
            raise CheckpointError(
                f"no space left on {path.parent} while saving {path.name}; the previous {path.name} (if any) is intact. "
                "Free space or point --trainer.default_root_dir at a larger disk, then resume with --ckpt_path last"
            ) from error
        raise
    _fsync_dir(path.parent)
    remove_stale_partials(path.parent)


def load_trusted_format(path: str | Path, map_location: Any = "cpu", *, mmap: bool = False) -> dict[str, Any]:
    """torch.load(weights_only=True) with one-line errors: missing file, not a checkpoint, pickled code."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist" + (" (it is a folder)" if path.is_dir() else "") +
                              "; pass a .ckpt file, or --ckpt_path last for the newest one under the run's root")
    with open(path, "rb") as file:
        head = file.read(4)
    if not (head.startswith(b"PK") or head.startswith(b"\x80")):  # torch.save's zip archive, or a legacy pickle
        raise CheckpointError(f"{path} is not a checkpoint: a .ckpt file is a torch.save archive, this one starts "
                              f"with {head!r} ({path.stat().st_size} bytes)")
    try:
        loaded = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap and head.startswith(b"PK"))
    except pickle.UnpicklingError as error:
        text = str(error)
        if "Weights only load failed" in text or "WeightsUnpickler" in text:
            found = re.search(r"Unsupported (global|operand)[^.\n]*", text)
            what = f" ({found.group(0).strip()})" if found else ""
            raise CheckpointError(
                f"{path} is not a trusted checkpoint: it holds pickled objects beyond tensors and plain values{what}, "
                "which could run code; checkpoints are only loaded with torch.load(weights_only=True)"
            ) from error
        raise CheckpointError(f"{path} is not a checkpoint torch can read ({text.splitlines()[0][:160]})") from error
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(f"{path} is not a complete checkpoint ({path.stat().st_size} bytes; {reason[:160]})") from error
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{path} holds a {type(loaded).__name__}, not a checkpoint dictionary")
    return loaded


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's CheckpointIO with same-directory, fsynced, atomic saves and weights_only loading (see module doc)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or not _is_local(path):
            return super().save_checkpoint(checkpoint, path, storage_options)  # remote stores have their own semantics
        save_atomically(checkpoint, Path(str(path).removeprefix("file://")))

    def load_checkpoint(self, path: Any, map_location: Optional[Callable] = lambda storage, loc: storage,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        if not _is_local(path):
            return super().load_checkpoint(path, map_location, weights_only=True)
        return load_trusted_format(path, map_location)

    def remove_checkpoint(self, path: Any) -> None:
        fs = get_filesystem(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)
