"""One run dir, one writer: a POSIX record lock on <run dir>/.lock (docs/reliability.md#one-writer-per-run-dir).

    python -m classifier_engine fit --config CONFIG --ckpt_path last   # error: run dir ... is in use by pid ...
"""

import errno
import fcntl
import os
import shlex
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lightning.pytorch.utilities import rank_zero_warn

from classifier_engine.errors import ConfigError, RunDirInUse
from classifier_engine.run.run_dirs import CHECKPOINTS, LOCK_FILE, next_version, version_name
from classifier_engine.run.trackers import redact


@dataclass
class RunLock:
    run_dir: Path
    created: list[Path] = field(default_factory=list)  # the dirs this process created for the run, outermost first
    found: set[str] = field(default_factory=set)  # the run dir's entries when it was claimed (a resume's)
    _fd: Optional[int] = None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # which releases the lock: POSIX record locks end with any of the file's fds
            self._fd = None

    def remove_failed_start(self) -> None:
        """After a start that failed before its first optimizer step: delete what this process created for the run
        (the run dir holds only what that start wrote: the lock, perhaps config.yaml, hparams.yaml, an event file)."""
        held = self._fd is not None
        self.release()
        if self.run_dir not in self.created:
            # A resume's run dir: only what this start added, and only while it held the lock (else another run's).
            added = [p for p in self.run_dir.iterdir() if p.name not in (*self.found, LOCK_FILE, CHECKPOINTS)]
            for path in added if held else []:
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
            return
        if any(self.run_dir.glob(f"{CHECKPOINTS}/*.ckpt")):
            return
        shutil.rmtree(self.run_dir, ignore_errors=True)
        for parent in reversed(self.created[:-1]):  # e.g. <root>/lightning_logs, if this start made it
            try:
                parent.rmdir()
            except OSError:  # not empty: another run's, or the user's files
                break


def _mkdir(directory: Path, created: list[Path]) -> bool:
    """mkdir, added to `created`; False if it exists (another process's). Other failures remove `created`, say why."""
    try:
        directory.mkdir()
    except FileExistsError:
        return False
    except OSError as error:
        for made in reversed(created):
            made.rmdir()
        blocker = next((p for p in directory.parents if p.exists() and not p.is_dir()), None)
        what = f"{blocker} is a file, not a folder" if blocker is not None else error.strerror or str(error)
        raise ConfigError(f"cannot create the run dir {directory} ({what}): trainer.default_root_dir must be a "
                          "writable folder; point --trainer.default_root_dir elsewhere") from None
    created.append(directory)
    return True


def _make_dirs(path: Path) -> list[Path]:
    """mkdir -p, returning the dirs it created, outermost first."""
    created: list[Path] = []
    for directory in [p for p in (path, *path.parents) if not p.exists()][::-1]:
        _mkdir(directory, created)
    return created


def claim_new_version(logs: Path) -> RunLock:
    """Create the next free <logs>/version_N exclusively (N+1 if another run took N meanwhile) and lock it."""
    created = _make_dirs(logs)
    number = next_version(logs)
    while not _mkdir(logs / version_name(number), created):  # a run started at the same moment took it
        number += 1
    return _lock(RunLock(logs / version_name(number), created))


def claim(run_dir: Path) -> RunLock:
    """Create the run dir if it is missing, and lock it; RunDirInUse if a live process holds it."""
    created = _make_dirs(run_dir)
    return _lock(RunLock(run_dir, created, set() if created else {p.name for p in run_dir.iterdir()}))


def _holder(lock_file: Path) -> str:
    try:
        return lock_file.read_text().strip() or "an unknown process"
    except OSError:
        return "an unknown process"


def _lock(run_lock: RunLock) -> RunLock:
    lock_file = run_lock.run_dir / LOCK_FILE
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(fd)
        if error.errno in (errno.EACCES, errno.EAGAIN):
            run_lock.remove_failed_start()  # a dir this process created for it (never the holder's)
            raise RunDirInUse(f"run dir {run_lock.run_dir} is in use by {_holder(lock_file)}; wait for that run to end "
                              "(or stop it), or write elsewhere with --trainer.default_root_dir") from None
        # A filesystem without POSIX locks (some Lustre mounts): warn, do not refuse to train.
        rank_zero_warn(f"cannot lock {lock_file} ({error}); nothing stops a second run from writing into "
                       f"{run_lock.run_dir}")
        return run_lock
    holder = (f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
              f"{redact(shlex.join(['python', *sys.argv]))[:300]}")  # (a tracking URI's password: never written)
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder.encode() + b"\n", 0)
    run_lock._fd = fd
    return run_lock
