"""Files written all or nothing, and durable: atomic_write, the temp files a killed write leaves, and paths.

    from classifier_engine.storage.files import atomic_write   # any file: atomic_write(path, write)
"""

import contextlib
import errno
import itertools
import os
import socket
from pathlib import Path
from typing import IO, Any, Callable, Optional

from classifier_engine.errors import DiskFullError

PARTIAL_SUFFIX = ".partial"  # temp files are `.<name>.<host>-<pid>.partial`: never a name `--ckpt_path last` picks
HOST = socket.gethostname().replace(".", "_")


def local_path(path: Any) -> Optional[str]:
    """`path` without its file:// prefix, or None for a remote store (s3://, gs://: their own semantics)."""
    text = str(path)
    return text.removeprefix("file://") if "://" not in text or text.startswith("file://") else None


def partial_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{HOST}-{os.getpid()}{PARTIAL_SUFFIX}")


def remove_stale_partials(directory: Path) -> None:
    """Delete temp files that a killed write on this host left behind; a live writer's, and other hosts', are kept."""
    for leftover in directory.glob(f".*.{HOST}-*{PARTIAL_SUFFIX}"):
        pid = leftover.name.removesuffix(PARTIAL_SUFFIX).rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not alive(int(pid)):
            leftover.unlink(missing_ok=True)


def alive(pid: int) -> bool:
    """Whether process `pid` of this host runs (under any user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, under another user
        pass
    return True


def keep_aside(path: Path) -> None:
    """A previous start's file, if there is one, kept as <stem>.<n><suffix>, the first n free (config.1.yaml)."""
    if path.is_file():
        n = next(n for n in itertools.count(1) if not path.with_name(f"{path.stem}.{n}{path.suffix}").exists())
        path.rename(path.with_name(f"{path.stem}.{n}{path.suffix}"))


def atomic_write(path: str | os.PathLike, write: Callable[[IO], object], *, mode: str = "wb",
                 check: Optional[Callable[[Path], object]] = None, fsync: bool = True,
                 fix: str = "Free space there, or write it elsewhere") -> Path:
    """Write `path` all or nothing (a failure leaves the previous one): `write(file)` fills a temp file beside it ("w":
    UTF-8, newline=""), fsynced, `check(temp)` may refuse it, renamed over `path` (fsync=False: atomic, not durable);
    a full disk raises DiskFullError, `fix` last."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = partial_path(path)
    text = {"encoding": "utf-8", "newline": ""} if "b" not in mode else {}
    try:
        temp.unlink(missing_ok=True)  # a killed writer's of this pid, or a link (in $TMPDIR): never written through
        with open(temp, mode.replace("w", "x"), **text) as file:
            write(file)
            file.flush()
            if fsync:
                try:
                    os.fsync(file.fileno())
                except OSError as error:  # a filesystem without fsync (EINVAL): the rename below is still atomic
                    if error.errno not in (errno.EINVAL, errno.ENOTSUP):
                        raise
        if check is not None:
            check(temp)
        os.replace(temp, path)
    except BaseException as error:
        temp.unlink(missing_ok=True)
        cause: Optional[BaseException] = error  # ENOSPC/EDQUOT, or behind a writer (torch: a RuntimeError's context)
        while cause is not None and not (isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise DiskFullError(f"no space left on {path.parent} while saving {path.name}; the previous {path.name} "
                                f"(if any) is intact. {fix}") from error
        raise
    if fsync:
        fsync_directory(path.parent)
    remove_stale_partials(path.parent)
    return path


def fsync_directory(directory: Path) -> None:
    """Make the names in `directory` durable (its files' own contents need their own fsync)."""
    fd = os.open(directory, os.O_RDONLY)
    with contextlib.suppress(OSError):  # some filesystems refuse fsync on directories; a rename is still atomic
        os.fsync(fd)
    os.close(fd)
