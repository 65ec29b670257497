"""Run dirs on object storage, worked on in a node-local mirror: each checkpoint uploaded whole as it is saved, the
logs with it; --ckpt_path last downloads what its choice needs and continues from the furthest along
(docs/reliability.md).

    AWS_ENDPOINT_URL=http://127.0.0.1:9000 python -m classifier_engine fit --config CONFIG \\
        --trainer.default_root_dir s3://bucket/runs --ckpt_path last
"""

import math
import os
import time
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from classifier_engine.errors import CheckpointError, ConfigError, RunDirInUse
from classifier_engine.run.checkpoint_checks import SAVED_AT
from classifier_engine.run.checkpoint_io import load_checkpoint, progress
from classifier_engine.run.mirror_journal import as_recorded, mirrored, record
from classifier_engine.run.remote_lease import LEASE_TTL_S, Lease, take_lease
from classifier_engine.run.run_dirs import CHECKPOINTS, SHARDS
from classifier_engine.storage.cache import cache_dir
from classifier_engine.storage.object_store import BUCKET, passing_failure, plain_key, s3_client

PROGRESS = "progress"  # metadata of an uploaded checkpoint, "saved_at global_step epoch batches": what to read first
Stored = dict[str, tuple[int, str]]  # a listing: {key relative to the root: (bytes, ETag)}


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
        self._lease: Optional[Lease] = None
        self._fetched: set[Path] = set()  # the files this start downloaded into the mirror
        self._listed: Optional[Stored] = None  # the store as prepare() listed it: what this start chose from

    def __getstate__(self) -> dict[str, Any]:  # ddp_spawn pickles the checkpoint IO: each process its own client
        return {**self.__dict__, "_client": None, "_lease": None, "_listed": None, "_fetched": set()}  # (the start's)

    def client(self):
        if self._client is None:
            self._client = s3_client(retries=2)
        return self._client

    def name(self, local: Path) -> str:
        """A file of the mirror's key relative to the root (as listing() names it)."""
        return Path(local).resolve().relative_to(self.mirror.resolve()).as_posix()

    def key(self, local: Path) -> str:
        return f"{self.prefix}/{self.name(local)}".lstrip("/")

    def url_of(self, local: Path) -> str:
        return f"s3://{self.bucket}/{self.key(local)}"

    def named(self, given: Optional[str]) -> Optional[str]:
        """The root's name of a file given as its URL under the root or as its mirror path (--ckpt_path), else None."""
        if given is None or given == "last":
            return None
        if given.startswith("s3://"):
            name = given[len(self.url) + 1:] if given.startswith(f"{self.url}/") else ""
            return name if name and plain_key(name) else None
        try:
            return self.name(Path(given).expanduser())
        except ValueError:
            return None

    def outdated(self, name: str, stored: Stored) -> bool:
        """Whether a start given stored checkpoint `name` downloads it: the mirror lacks it, or holds a copy of another
        object (the store's replaced since); one written here is read as it is."""
        target = self.mirror / name
        return name.endswith(".ckpt") and (not target.exists() or (
            name in stored and as_recorded(target) and not self._as_stored(name, stored)))

    def not_stored(self, name: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {self.url}/{name} is not in the store: name a stored one (aws s3 ls "
                               f"{self.url}/ --recursive), or pass --ckpt_path last for the newest")

    def store_error(self, error: Exception, doing: str) -> ConfigError:
        why = passing_failure(error) or (str(error).splitlines() or [type(error).__name__])[0][:200]
        return ConfigError(f"trainer.default_root_dir {self.url}: {doing} failed ({why}): check the bucket, "
                           "AWS_ENDPOINT_URL and the AWS_* keys, then rerun (--ckpt_path last continues the run)")

    def _list(self, start: str) -> Stored:
        """{key: (bytes, ETag)} of every object whose key starts with `start` (botocore's errors raised as they are)."""
        # (moto 5.2's server refuses the signature of a Prefix ending in "/": asked without it)
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start.rstrip("/"))
        return {item["Key"]: (item["Size"], item.get("ETag", "")) for page in pages
                for item in page.get("Contents", []) if item["Key"].startswith(start)}

    def listing(self) -> Stored:
        """{key relative to the root: (bytes, ETag)} of every object under it."""
        start = f"{self.prefix}/".lstrip("/")
        try:
            found = {key[len(start):]: value for key, value in self._list(start).items()}
        except Exception as error:  # noqa: BLE001  botocore's
            raise self.store_error(error, "listing the runs") from None
        # Keys are untrusted input (anyone with write access to the bucket): one that would land outside the mirror
        # (.., an absolute or empty part) is never downloaded.
        unsafe = [name for name in found if not plain_key(name)]
        if unsafe:
            rank_zero_warn(f"trainer.default_root_dir {self.url}: ignored {len(unsafe)} object(s) whose key leaves "
                           f"the run root (e.g. {unsafe[0][:100]!r})")
        return {name: value for name, value in found.items() if name not in unsafe}

    # -- at start: the mirror made to know what the store holds ----------------------------------------------------
    def logs_name(self, logs: Path) -> str:
        """The store's name of the folder of version dirs: the first file logger's save_dir/name in the mirror
        (lightning_logs by default; "" for the root itself)."""
        try:
            name = Path(logs).resolve().relative_to(self.mirror.resolve()).as_posix()
        except ValueError:
            raise ConfigError(f"trainer.default_root_dir {self.url}: the logger writes its run dirs in {logs}, outside "
                              "the root (its mirror), where nothing is stored; leave the logger's save_dir unset") \
                from None
        return "" if name == "." else name

    def stored_versions(self, stored: Stored, logs_name: str) -> tuple[str, ...]:
        """The run dirs the store holds under `logs_name` (version_N, slurm-<id>)."""
        return tuple(sorted({parts[0] for name in stored if len(parts := _below(name, logs_name)) >= 2}))

    def stored_checkpoints(self, stored: Stored, logs_name: str) -> list[str]:
        """The stored checkpoints a resume chooses from: <logs>/*/checkpoints/*.ckpt and checkpoints/*.ckpt."""
        return [name for name in stored if name.endswith(".ckpt") and (name.split("/")[:-1] == [CHECKPOINTS] or (
            len(parts := _below(name, logs_name)) == 3 and parts[1] == CHECKPOINTS))]

    def claims(self, stored: Stored, logs_name: str) -> dict[str, tuple[float, ...]]:
        """What each stored checkpoint's upload metadata claims of it: (saved_at, *progress()), () when nothing (copied
        without it, or not 4 finite numbers). Untrusted: an order to read them in, and a dry plan's guess."""
        claims = {}
        for name in self.stored_checkpoints(stored, logs_name):
            try:
                head = self.client().head_object(Bucket=self.bucket, Key=f"{self.prefix}/{name}".lstrip("/"))
            except Exception as error:  # noqa: BLE001
                raise self.store_error(error, f"reading {name}") from None
            try:
                values = tuple(float(part) for part in head.get("Metadata", {}).get(PROGRESS, "").split())
            except ValueError:
                values = ()
            claims[name] = values if len(values) == 4 and all(map(math.isfinite, values)) else ()
        return claims

    def prepare(self, logs_name: str, resume: bool) -> Stored:
        """The listing and a mirror folder per stored run dir; when resuming, the mirror's checkpoints since removed
        from the store are dropped (the resume fetches those it chooses among: fetch_checkpoints)."""
        stored = self._listed = self.listing()
        for version in self.stored_versions(stored, logs_name):
            (self.mirror / logs_name / version).mkdir(parents=True, exist_ok=True)
        self.mirror.mkdir(parents=True, exist_ok=True)
        for path in self.mirror.glob(f"{logs_name}/*/{CHECKPOINTS}/*.ckpt".lstrip("/")) if resume else ():
            if as_recorded(path) and self.name(path) not in stored:
                path.unlink()  # as it was stored, and removed there since (by its run, or by hand): not a candidate
        return stored

    def fetch_checkpoints(self, stored: Stored, logs_name: str, which: Optional[Path]) -> dict[Path, tuple]:
        """Stored checkpoints a start reads, into the mirror: one (its mirror path: CheckpointError when neither holds
        it), those of one checkpoints folder (a Slurm requeue's or torchrun restart's own run), or (None) those whose
        metadata claims nothing, returning the claims of the others whose mirror copy is not that object ({mirror
        path: claim}): the choice fetches each of those only if its claim would win (resume.newest_loadable), then
        goes by its own records."""
        if which is not None:
            wanted, folder = Path(which).resolve(), not Path(which).name.endswith(".ckpt")
            for name in stored:
                if name.endswith(".ckpt") and wanted in ((path := (self.mirror / name).resolve()),
                                                         *([path.parent] if folder else [])):
                    self.fetch_checkpoint(name, stored)
            if (name := self.named(str(which))) is not None and name.endswith(".ckpt") and not Path(which).exists():
                raise self.not_stored(name)
            return {}
        claimed = {}
        for name, claim in self.claims(stored, logs_name).items():
            target = self.mirror / name
            if not claim:
                self.fetch_checkpoint(name, stored)
            elif self.outdated(name, stored) or not as_recorded(target) and _records(_contents(target)) < claim:
                claimed[target] = claim  # (one this node could not upload yet: read, if ahead of the claim)
        return claimed

    def _as_stored(self, name: str, stored: Stored) -> bool:
        """Whether the mirror holds stored checkpoint `name` as that object, with every file of its shard folder (a
        download cut short leaves a recorded file and part of its folder)."""
        target = self.mirror / name
        return as_recorded(target, stored[name][1]) and all(
            (self.mirror / part).is_file() for part in self._shard_parts(name, stored, _contents(target)))

    def _shard_parts(self, name: str, stored: Stored, checkpoint: dict[str, Any]) -> list[str]:
        """The stored files of a sharded checkpoint's folder ([] for a one-file checkpoint)."""
        if SHARDS not in checkpoint:
            return []
        start = f"{name.rpartition('/')[0]}/{Path(str(checkpoint[SHARDS])).name}/".lstrip("/")
        return [part for part in stored if part.startswith(start)]

    def fetch_checkpoint(self, name: str, stored: Stored) -> None:
        """A stored checkpoint into the mirror with its shard folder (CheckpointError when incomplete); one this node
        saved and could not upload yet is kept when as far along by its own records: nothing it trained is lost."""
        target = self.mirror / name
        if target.is_file() and not as_recorded(target):
            theirs = self.download(name, stored, to=target.with_name(f".{target.name}.stored"))
            if _records(_contents(theirs)) > _records(_contents(target)):
                os.replace(theirs, target)
                self._fetched.add(target.resolve())
                record(target, self.url_of(target), stored[name][1])
            theirs.unlink(missing_ok=True)
        else:
            self.download(name, stored)
        checkpoint = _contents(target)
        if SHARDS not in checkpoint:
            return  # a one-file checkpoint, or one that does not load: the choice skips it, in one line
        folder = target.parent / Path(str(checkpoint[SHARDS])).name
        for part in self._shard_parts(name, stored, checkpoint):
            self.download(part, stored)
        from classifier_engine.run.sharded_checkpoints import missing_shards  # (torch.distributed.checkpoint: on use)

        missing = missing_shards(folder) if folder.name.endswith(".shards") else []  # (a crafted name: load refuses)
        if missing:
            raise CheckpointError(
                f"the stored checkpoint {self.url}/{name} is incomplete: the store lacks {len(missing)} file(s) of "
                f"its shard folder {folder.name} ({', '.join(missing[:3])}), never uploaded or deleted since; delete "
                f"the checkpoint (aws s3 rm {self.url}/{name}) and rerun: --ckpt_path last then continues from the "
                "one before it")

    def fetch_run_dir(self, checkpoint: Path, stored: Stored) -> None:
        """The resumed checkpoint's run dir's other files (config.yaml, logs...), which the resumed run extends. One
        this node wrote and has not sent yet stays when the checkpoint is this node's too (not downloaded now)."""
        if self.mirror.resolve() not in Path(checkpoint).resolve().parents:
            return
        run_dir, ours = self.name(checkpoint).rpartition(f"/{CHECKPOINTS}/")[0], Path(checkpoint).resolve() not in \
            self._fetched
        for name in stored:
            if run_dir and name.startswith(f"{run_dir}/") and not name.endswith(".ckpt") and mirrored(Path(name)) \
                    and ".shards/" not in name and not (ours and (local := self.mirror / name).is_file() and
                                                        not as_recorded(local)):
                self.download(name, stored)

    def download(self, name: str, stored: Stored, to: Optional[Path] = None) -> Path:
        """Download `name` into the mirror (or `to`), never half a file; a copy recorded as that object is kept."""
        target, (size, etag) = self.mirror / name, stored[name]
        if not plain_key(name) or self.mirror.resolve() not in target.resolve().parents:
            raise ConfigError(f"trainer.default_root_dir {self.url}: the object {name[:100]!r} would land outside the "
                              "run's mirror: not downloaded")
        if to is None and target.is_file() and target.stat().st_size == size and as_recorded(
                target, etag if name.endswith(".ckpt") else None):
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}.download")
        try:
            self.client().download_file(self.bucket, f"{self.prefix}/{name}".lstrip("/"), str(partial))
            os.replace(partial, to or target)
        except Exception as error:  # noqa: BLE001
            partial.unlink(missing_ok=True)
            raise self.store_error(error, f"downloading {name}") from None
        if to is None:
            record(target, self.url_of(target), etag)
            self._fetched.add(target.resolve())
        if name.endswith(".ckpt"):
            rank_zero_info(f"downloaded {self.url}/{name} ({size / 2**20:.1f} MiB) into {to or target}")
        return to or target

    # -- while it runs: uploads (global rank 0) ---------------------------------------------------------------------
    def upload(self, local: Path, progress: Optional[tuple[float, ...]] = None) -> Optional[float]:
        """Upload a mirror file (a checkpoint with its `progress`); the seconds it took, None if it failed (a line)."""
        if self.taken_over():
            raise RunDirInUse(self.taken_over())
        started, key = time.monotonic(), self.key(local)
        extra = {"Metadata": {PROGRESS: " ".join(map(str, progress))}} if progress else {}
        try:
            self.client().upload_file(str(local), self.bucket, key, ExtraArgs=extra)
            # a checkpoint's ETag: a later start downloads it again if the store's is another object of the same size
            etag = self.client().head_object(Bucket=self.bucket, Key=key)["ETag"] if progress else None
        except Exception as error:  # noqa: BLE001
            rank_zero_warn(f"{self.store_error(error, f'uploading {local.name}')}; kept in {local} meanwhile")
            return None
        record(local, self.url_of(local), etag)
        return time.monotonic() - started

    def store_checkpoint(self, local: Path) -> bool:
        """Upload a saved checkpoint, its records as metadata: a shard folder before the file naming it, then delete
        the folders it replaced. False when it could not (one line; the next save or start sends it)."""
        from classifier_engine.run.sharded_checkpoints import missing_shards

        checkpoint = _contents(local)
        folder = local.parent / Path(str(checkpoint[SHARDS])).name if SHARDS in checkpoint else None
        if folder is not None and (missing := missing_shards(folder)):
            rank_zero_warn(f"{local}: its shard folder lacks {len(missing)} file(s) here ({', '.join(missing[:3])}: "
                           "written by ranks of other nodes into their own mirrors): not uploaded; point "
                           "$CLASSIFIER_ENGINE_RUN_MIRROR at a folder every node shares, or use strategy fsdp2")
            return False
        parts = sorted(p for p in folder.iterdir() if mirrored(p) and not as_recorded(p)) if folder else []
        if not all(self.upload(part) is not None for part in parts) or self.upload(local, _records(checkpoint)) is None:
            return False
        if folder is not None:
            self.delete_shards(local, keep=folder.name)
        return True

    def sync(self, run_dir: Path) -> None:
        """Upload the run dir's files the store does not have as they are now (logs, config.yaml, a pending save)."""
        if self.taken_over():
            rank_zero_warn(self.taken_over())
            return
        for path in sorted(p for p in Path(run_dir).rglob("*") if p.is_file() and mirrored(p)):
            if not as_recorded(path) and not (self.store_checkpoint(path) if path.suffix == ".ckpt" and
                                               path.parent.name == CHECKPOINTS else self.upload(path) is not None):
                return  # the store is away: the rest waits for the next sync

    def delete(self, local: Path) -> None:
        """A removed checkpoint's object, and its shard folders."""
        try:
            self.client().delete_object(Bucket=self.bucket, Key=self.key(local))
        except Exception as error:  # noqa: BLE001  a stale best checkpoint left in the store costs space only
            rank_zero_warn(f"{self.store_error(error, f'deleting {local.name}')}")
            return
        self.delete_shards(local)

    def delete_shards(self, local: Path, keep: str = "") -> None:
        """The stored shard folders of checkpoint `local` but `keep`: strategies/fsdp.py remove_shards, in the store."""
        folders = f"{self.key(local.parent)}/"
        try:
            for key in self._list(f"{folders}.{local.name}."):
                folder = key[len(folders):].partition("/")[0]
                if folder != keep and folder.endswith(".shards") and folder[len(local.name) + 2:-7].isdigit():
                    self.client().delete_object(Bucket=self.bucket, Key=key)
        except Exception as error:  # noqa: BLE001  costs space only
            rank_zero_warn(f"{self.store_error(error, f'deleting the earlier shards of {local.name}')}")

    # -- one writer per run dir (remote_lease.py) --------------------------------------------------------------------
    def taken_over(self) -> Optional[str]:
        """The line a run says once another run took its lease over (then it stores nothing more), else None."""
        lost = self._lease.lost if self._lease is not None else None
        return None if lost is None else (
            f"trainer.default_root_dir {self.url}: {lost} took over this run's lease (its renewals missed for "
            f"{LEASE_TTL_S:.0f} s: a stalled node?); stopped, storing nothing more: its files stay in {self.mirror}")

    def claim(self, run_dir: Path, new: bool) -> None:
        """Take the run dir's lease until release(); VersionTaken when `new` and another start created it first,
        RunDirInUse when a run saved a checkpoint there since this start listed the store (it chose before that)."""
        self._lease = take_lease(self, run_dir, new)
        if not new and self._listed is not None:
            folder, key = f"{self.name(run_dir)}/{CHECKPOINTS}/", f"{self.key(run_dir)}/{CHECKPOINTS}/"
            try:
                now = {name[len(key):]: tag for name, tag in self._list(key).items()}
            except Exception as error:  # noqa: BLE001  botocore's
                self.release()
                raise self.store_error(error, "listing the run's checkpoints") from None
            before = {name[len(folder):]: tag for name, tag in self._listed.items() if name.startswith(folder)}
            if {n: t for n, t in now.items() if n.endswith(".ckpt") and "/" not in n} != {
                    n: t for n, t in before.items() if n.endswith(".ckpt") and "/" not in n}:
                self.release()
                raise RunDirInUse(f"run dir {self.url_of(run_dir)}: another run saved a checkpoint there after this "
                                  "start listed the store (a run ending while this one started); rerun: --ckpt_path "
                                  "last continues from the newest")

    def release(self) -> None:
        if self._lease is not None:
            self._lease, lease = None, self._lease
            lease.release()


def _below(name: str, folder: str) -> list[str]:
    """The parts of key `name` below `folder` ("": the root), [] when it is not under it."""
    return name.split("/") if not folder else name[len(folder) + 1:].split("/") if name.startswith(f"{folder}/") else []


def _contents(path: Path) -> dict[str, Any]:
    """A checkpoint file's own contents, memory-mapped (a sharded one's folder not read); {} when it does not load."""
    try:
        return load_checkpoint(path, mmap=True, shards=False)
    except CheckpointError:
        return {}


def _records(checkpoint: dict[str, Any]) -> tuple[float, ...]:
    """How far a checkpoint got by its own records (when it was saved, then progress()); (-1,) for another file."""
    try:
        return (float(checkpoint.get(SAVED_AT) or 0.0), *progress(checkpoint))
    except (KeyError, TypeError, ValueError):
        return (-1.0,)
