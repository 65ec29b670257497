"""Run dirs on object storage: `--trainer.default_root_dir s3://bucket/prefix` (docs/reliability.md#run-dirs-on-
object-storage). The run works in a node-local mirror of that root, as on any filesystem; each checkpoint is uploaded
as it is saved (one PUT or multipart upload: the store shows the object whole or not at all), config.yaml and the logs
with it; a start with --ckpt_path last lists the stored checkpoints and downloads the one furthest along.

    AWS_ENDPOINT_URL=http://127.0.0.1:9000 python -m classifier_engine fit --config CONFIG \\
        --trainer.default_root_dir s3://bucket/runs --ckpt_path last
"""

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from classifier_engine.errors import CheckpointError, ConfigError, RunDirInUse
from classifier_engine.run.checkpoint_checks import SAVED_AT
from classifier_engine.run.checkpoint_io import load_checkpoint, progress
from classifier_engine.storage.cache import cache_dir
from classifier_engine.storage.object_store import BUCKET, passing_failure, plain_key, s3_client

PROGRESS = "progress"  # metadata of an uploaded checkpoint: "saved_at global_step epoch batches", compared
JOURNAL = ".uploaded.json"  # in the mirror: (size, mtime, URL) of each file as uploaded or downloaded
LEASE, LEASE_RENEW_S, LEASE_TTL_S = ".lease", 10.0, 30.0  # one writer per run dir: renewed while it trains


class RemoteRoot:
    """s3://bucket/prefix and its node-local mirror, <base>/bucket/prefix ($CLASSIFIER_ENGINE_RUN_MIRROR, else runs/ in
    the data cache): the root's own keys, so two roots share a folder only where they share the objects."""

    def __init__(self, url: str):
        if not url.startswith("s3://"):
            raise ConfigError(f"trainer.default_root_dir {url} looks like a mistyped object-store URL: write "
                              "s3://bucket/prefix (lowercase s3, a colon, two slashes), or ./<path> for a local folder")
        self.bucket, _, self.prefix = url[len("s3://"):].rstrip("/").partition("/")
        if not BUCKET.fullmatch(self.bucket):
            raise ConfigError(f"trainer.default_root_dir {url}: {self.bucket!r} is not a bucket name (3-63 lowercase "
                              "letters, digits, dots and hyphens): expected s3://bucket/prefix")
        if self.prefix and not plain_key(self.prefix):  # as data keys are: nothing lands outside the mirror's base
            raise ConfigError(f"trainer.default_root_dir {url}: the prefix {self.prefix!r} has an empty part, '.', "
                              "'..' or a backslash: expected s3://bucket/plain/parts")
        self.url = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        base = Path(os.environ.get("CLASSIFIER_ENGINE_RUN_MIRROR") or cache_dir() / "runs").expanduser()
        self.mirror = base / self.bucket / self.prefix
        self._client = None
        self._lease: Optional[tuple[str, threading.Event]] = None

    def __getstate__(self) -> dict[str, Any]:  # ddp_spawn pickles the checkpoint IO: each process its own client
        return {**self.__dict__, "_client": None, "_lease": None}

    def client(self):
        if self._client is None:
            self._client = s3_client(retries=2)
        return self._client

    def key(self, local: Path) -> str:
        relative = Path(local).resolve().relative_to(self.mirror.resolve()).as_posix()
        return f"{self.prefix}/{relative}".lstrip("/")

    def url_of(self, local: Path) -> str:
        return f"s3://{self.bucket}/{self.key(local)}"

    def _fail(self, error: Exception, doing: str) -> ConfigError:
        why = passing_failure(error) or (str(error).splitlines() or [type(error).__name__])[0][:200]
        return ConfigError(f"trainer.default_root_dir {self.url}: {doing} failed ({why}): check the bucket, "
                           "AWS_ENDPOINT_URL and the AWS_* keys, then rerun (--ckpt_path last continues the run)")

    def listing(self) -> dict[str, int]:
        """{key relative to the root: bytes} of every object under it."""
        found: dict[str, int] = {}
        start = f"{self.prefix}/".lstrip("/")
        try:  # (the prefix without its "/": moto 5.2's server refuses the signature of a Prefix ending in one)
            for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix):
                found.update({item["Key"][len(start):]: item["Size"] for item in page.get("Contents", [])
                              if item["Key"].startswith(start)})
        except Exception as error:  # noqa: BLE001  botocore's
            raise self._fail(error, "listing the runs") from None
        # Keys are untrusted input (anyone with write access to the bucket): one that would land outside the mirror
        # (.., an absolute or empty part) is never downloaded.
        unsafe = [name for name in found if not plain_key(name)]
        if unsafe:
            rank_zero_warn(f"trainer.default_root_dir {self.url}: ignored {len(unsafe)} object(s) whose key leaves "
                           f"the run root (e.g. {unsafe[0][:100]!r})")
        return {name: size for name, size in found.items() if name not in unsafe}

    # -- at start: the mirror made to know what the store holds ----------------------------------------------------
    def stored_versions(self, stored: dict[str, int], logs_name: str) -> tuple[str, ...]:
        """The run dirs the store holds under `logs_name` (version_N, slurm-<id>), by name."""
        return tuple(sorted({name.split("/")[1] for name in stored
                             if name.count("/") >= 2 and name.split("/")[0] == logs_name}))

    def stored_resume(self, stored: dict[str, int], logs_name: str) -> Optional[tuple[str, tuple[float, ...]]]:
        """(key, progress) of the stored checkpoint furthest along by its upload record, or None."""
        checkpoints = [name for name in stored if name.endswith(".ckpt") and name.startswith(f"{logs_name}/")]
        progress = {name: self._progress(name) for name in checkpoints}
        best = max(checkpoints, key=progress.__getitem__, default=None)
        return (best, progress[best]) if best is not None else None

    def prepare(self, logs_name: str, resume: bool) -> Path:
        """The mirror root, with a folder for every stored run dir (a new run takes the next free version) and, when
        resuming, the stored checkpoint furthest along downloaded (unless the mirror has it already)."""
        stored = self.listing()
        for version in self.stored_versions(stored, logs_name):
            (self.mirror / logs_name / version).mkdir(parents=True, exist_ok=True)
        self.mirror.mkdir(parents=True, exist_ok=True)
        found = self.stored_resume(stored, logs_name) if resume else None
        # and the run dir's config.yaml, logs...: a resumed run keeps and extends them. A checkpoint this mirror saved
        # further along and could not upload yet is kept, with its run dir: nothing it trained is redone.
        if found is not None and not self._further_here(self.mirror / found[0], found[1]):
            run_dir = found[0].rsplit("/checkpoints/", 1)[0] + "/"
            for name in [found[0], *(n for n in stored if n.startswith(run_dir) and not n.endswith(".ckpt"))]:
                if _mirrored(Path(name)):
                    self.download(name, stored[name])
        return self.mirror

    def _further_here(self, local: Path, stored: tuple[float, ...]) -> bool:
        """Whether the mirror's `local` checkpoint is one not uploaded as it is, and at least as far as `stored`."""
        if not local.is_file() or _as_recorded(local):
            return False
        try:
            checkpoint = load_checkpoint(local, mmap=True)
            return (float(checkpoint.get(SAVED_AT) or 0.0), *progress(checkpoint)) >= stored
        except (CheckpointError, KeyError):
            return False

    def _progress(self, name: str) -> tuple[float, ...]:
        try:
            head = self.client().head_object(Bucket=self.bucket, Key=f"{self.prefix}/{name}".lstrip("/"))
        except Exception as error:  # noqa: BLE001
            raise self._fail(error, f"reading {name}") from None
        try:  # (metadata is untrusted: a value that is not numbers counts as nothing)
            return tuple(float(part) for part in head.get("Metadata", {}).get(PROGRESS, "0 0 0 0").split())
        except ValueError:
            return (0.0,)

    def download(self, name: str, size: int) -> Path:
        """The stored object `name` into the mirror (written beside, then renamed: never half a file)."""
        target = self.mirror / name
        if not plain_key(name) or self.mirror.resolve() not in target.resolve().parents:
            raise ConfigError(f"trainer.default_root_dir {self.url}: the object {name[:100]!r} would land outside the "
                              "run's mirror: not downloaded")
        if target.is_file() and target.stat().st_size == size and _as_recorded(target):
            return target  # the mirror's own upload: the same file
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}.download")
        try:
            self.client().download_file(self.bucket, f"{self.prefix}/{name}".lstrip("/"), str(partial))
            os.replace(partial, target)
        except Exception as error:  # noqa: BLE001
            partial.unlink(missing_ok=True)
            raise self._fail(error, f"downloading {name}") from None
        self._record(target)
        if name.endswith(".ckpt"):
            rank_zero_info(f"downloaded {self.url}/{name} ({size / 2**20:.1f} MiB) into {target}")
        return target

    # -- while it runs: uploads (global rank 0) ---------------------------------------------------------------------
    def upload(self, local: Path, progress: Optional[tuple[float, ...]] = None) -> Optional[float]:
        """Upload one file of the mirror; the seconds it took, or None when it failed (said in one line, the file kept
        in the mirror as pending: the next save or start sends it)."""
        started = time.monotonic()
        extra = {"Metadata": {PROGRESS: " ".join(map(str, progress))}} if progress else {}
        try:
            self.client().upload_file(str(local), self.bucket, self.key(local), ExtraArgs=extra)
        except Exception as error:  # noqa: BLE001
            rank_zero_warn(f"{self._fail(error, f'uploading {local.name}')}; kept in {local} meanwhile")
            return None
        self._record(local)
        return time.monotonic() - started

    def sync(self, run_dir: Path) -> None:
        """Upload the run dir's files the store does not have as they are now (logs, config.yaml, a pending save)."""
        for path in sorted(p for p in Path(run_dir).rglob("*") if p.is_file() and _mirrored(p)):
            if not _as_recorded(path):
                if self.upload(path) is None:
                    return  # the store is away: the rest waits for the next sync

    def delete(self, local: Path) -> None:
        try:
            self.client().delete_object(Bucket=self.bucket, Key=self.key(local))
        except Exception as error:  # noqa: BLE001  a stale best checkpoint left in the store costs space only
            rank_zero_warn(f"{self._fail(error, f'deleting {local.name}')}")

    def _record(self, path: Path) -> None:
        journal = _journal(path.parent)
        journal[path.name] = [*_stamp(path), self.url_of(path)]
        temp = path.parent / f"{JOURNAL}.{os.getpid()}"
        temp.write_text(json.dumps(journal))
        os.replace(temp, path.parent / JOURNAL)

    # -- one writer per run dir ------------------------------------------------------------------------------------
    def claim(self, run_dir: Path) -> None:
        """Take the run dir's lease, renewed every LEASE_RENEW_S until release(). A lease another writer holds is
        watched for up to LEASE_TTL_S: renewed, the start is refused (RunDirInUse); not, it is taken over (a run killed
        without releasing it: a preempted node, kill -9). The same host's dead process's lease is taken at once."""
        key, me = f"{self.key(run_dir)}/{LEASE}", {"holder": f"pid {os.getpid()} on {socket.gethostname()}"}
        held, deadline = self._read_lease(key), time.monotonic() + LEASE_TTL_S
        if held is not None and not _lapsed(held, me):
            rank_zero_info(f"run dir {self.url_of(run_dir)} has a lease from {held['holder']}: waiting up to "
                           f"{LEASE_TTL_S:.0f} s for it to be renewed (a live run) or to lapse (a killed one)")
            while time.monotonic() < deadline:
                time.sleep(1.0)
                now = self._read_lease(key)
                if now is None:
                    break
                if now.get("renewed") != held.get("renewed"):
                    raise RunDirInUse(f"run dir {self.url_of(run_dir)} is in use by {now['holder']} (its lease is "
                                      "renewed); wait for that run to end, or write elsewhere with "
                                      "--trainer.default_root_dir")
        stop = threading.Event()
        self._put_lease(key, me)

        def renew() -> None:
            while not stop.wait(LEASE_RENEW_S):
                self._put_lease(key, me, quiet=True)

        threading.Thread(target=renew, name="run-lease", daemon=True).start()
        self._lease = (key, stop)

    def _read_lease(self, key: str) -> Optional[dict[str, Any]]:
        try:
            return json.loads(self.client().get_object(Bucket=self.bucket, Key=key)["Body"].read())
        except Exception as error:  # noqa: BLE001
            if "NoSuchKey" in str(error) or "404" in str(error):
                return None
            if isinstance(error, ValueError):
                return {"holder": "an unreadable lease", "renewed": 0}
            raise self._fail(error, "reading the run's lease") from None

    def _put_lease(self, key: str, lease: dict[str, Any], quiet: bool = False) -> None:
        try:
            body = json.dumps({**lease, "renewed": time.time()}).encode()  # each renewal another object (its ETag)
            self.client().put_object(Bucket=self.bucket, Key=key, Body=body)
        except Exception as error:  # noqa: BLE001
            if not quiet:
                raise self._fail(error, "writing the run's lease") from None

    def release(self) -> None:
        if self._lease is not None:
            key, stop = self._lease
            stop.set()
            self._lease = None
            try:
                self.client().delete_object(Bucket=self.bucket, Key=key)
            except Exception:  # noqa: BLE001  it lapses on its own
                pass


def _lapsed(lease: dict[str, Any], me: dict[str, str]) -> bool:
    """Whether a lease is ours, or its holder is a process of this host that is gone."""
    if lease.get("holder") == me["holder"]:
        return True
    pid, _, host = str(lease.get("holder", "")).removeprefix("pid ").partition(" on ")
    if host == socket.gethostname() and pid.isdigit():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
    return False


def _journal(folder: Path) -> dict[str, list]:
    try:
        journal = json.loads((folder / JOURNAL).read_text())
    except (OSError, ValueError):
        return {}
    return journal if isinstance(journal, dict) else {}


def _as_recorded(path: Path) -> bool:
    """Whether `path` is as it was when last uploaded or downloaded (else: pending, or written since)."""
    entry = _journal(path.parent).get(path.name)
    return isinstance(entry, list) and entry[:2] == _stamp(path)


def stored_origin(path: Path) -> Optional[str]:
    """For a file of an object store's run dir (in its mirror: a folder with a journal), its URL; None for any other.
    What such a folder holds is shared storage, untrusted input as a checkpoint is: anyone with write access to the
    bucket could have put it there, or put it there since this node wrote it."""
    path = Path(path)
    journal = _journal(path.parent)
    if not journal:
        return None
    own = journal.get(path.name)
    if isinstance(own, list) and len(own) > 2:
        return str(own[2])
    urls = [entry[2] for entry in journal.values() if isinstance(entry, list) and len(entry) > 2]
    return f"{str(urls[0]).rpartition('/')[0]}/{path.name}" if urls else f"the object store mirrored in {path.parent}"


def _stamp(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def _mirrored(path: Path) -> bool:
    """The run's own files: not the journal, the local lock, a partial save or a download in progress."""
    return not path.name.startswith(".") and not path.name.endswith((".partial", ".download"))
