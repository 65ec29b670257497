"""One run dir, one writer: a live run holds a lock on its run dir; a second process that would write there stops.

    python -m project fit --config configs/quickstart.yaml --ckpt_path last &
    python -m project fit --config configs/quickstart.yaml --ckpt_path last   # error: run dir ... is in use by pid ...

Global rank 0 (the only rank that writes) takes an exclusive flock on <run dir>/.lock when fit starts and holds it
until the process ends; the kernel releases it when the process dies, so a crashed run leaves no stale lock (the file
itself stays, naming the last holder). The other ranks of the job write nothing and rely on rank 0's lock. A new run
dir is created here, exclusively: two fresh runs started at the same moment get two versions, not one.
"""

import fcntl
import os
import shlex
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from lightning.pytorch.utilities import rank_zero_warn

from project.errors import RunDirInUse

LOCK_FILE = ".lock"


@dataclass
class RunLock:
    run_dir: Path
    created: bool  # this process created the run dir
    _fd: Optional[int] = None

    def release(self) -> None:
        if self._fd is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None

    def remove_failed_start(self) -> None:
        """After a start that failed before its first optimizer step: delete the run dir if this process created it
        (it holds only what that start wrote: config.yaml, hparams.yaml, an empty event file, the lock)."""
        self.release()
        if self.created and self.run_dir.is_dir() and not any(self.run_dir.glob("checkpoints/*.ckpt")):
            shutil.rmtree(self.run_dir, ignore_errors=True)


def _holder(lock_file: Path) -> str:
    try:
        return lock_file.read_text().strip() or "an unknown process"
    except OSError:
        return "an unknown process"


class RunDirTaken(Exception):
    """A fresh run's version dir was created by another run meanwhile: pick the next one."""


def claim(run_dir: Path, *, fresh: bool) -> RunLock:
    """Create (fresh: exclusively) or open the run dir and lock it; RunDirInUse if a live process holds it."""
    created = False
    if fresh and run_dir.name.startswith("version_"):
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            run_dir.mkdir()
        except FileExistsError:
            raise RunDirTaken(run_dir) from None
        created = True
    run_dir.mkdir(parents=True, exist_ok=True)
    lock_file = run_dir / LOCK_FILE
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirInUse(
            f"run dir {run_dir} is in use by {_holder(lock_file)}; wait for that run to end (or stop it), or write "
            "elsewhere with --trainer.default_root_dir"
        ) from None
    except OSError as error:  # a filesystem without flock (some Lustre mounts): warn, do not refuse to train
        rank_zero_warn(f"cannot lock {lock_file} ({error}); nothing stops a second run from writing into {run_dir}")
        return RunLock(run_dir, created, fd)
    holder = (f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
              f"{shlex.join(['python', *sys.argv])[:300]}")
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder.encode() + b"\n", 0)
    return RunLock(run_dir, created, fd)
