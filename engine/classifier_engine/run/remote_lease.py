"""One writer per run dir in an object store: a lease object, <run dir>/.lease, created only where there is none and
taken over only as it was read, by the store's conditional writes (docs/reliability.md#run-dirs-on-object-storage).

    python -m classifier_engine fit --config CONFIG --trainer.default_root_dir s3://bucket/runs --ckpt_path last
"""

import contextlib
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.utilities import rank_zero_info

from classifier_engine.errors import ConfigError, RunDirInUse
from classifier_engine.storage.files import alive

LEASE, LEASE_RENEW_S, LEASE_TTL_S = ".lease", 10.0, 30.0  # renewed while it trains; unrenewed for TTL: a dead run
# What S3 answers a conditional write that lost (If-None-Match: the object exists; If-Match: it changed or went away)
LOST = ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey")


class VersionTaken(Exception):
    """A new version dir's lease was created by another start first: that version is the other start's."""


@dataclass
class Lease:
    """A taken lease, renewed by a thread until release()."""

    remote: Any  # the RemoteRoot
    key: str
    stop: threading.Event = field(default_factory=threading.Event)
    lost: Optional[str] = None  # who took it over, once a renewal found the lease replaced

    def release(self) -> None:
        self.stop.set()
        if self.lost is None:  # (else the other writer's now)
            with contextlib.suppress(Exception):  # it lapses on its own
                self.remote.client().delete_object(Bucket=self.remote.bucket, Key=self.key)


def take_lease(remote, run_dir: Path, new: bool) -> Lease:
    """Take the run dir's lease, renewed every LEASE_RENEW_S until release(). Another writer's is watched for up to
    LEASE_TTL_S: renewed, RunDirInUse; not, taken over (kill -9, a preempted node; a dead pid of this host: at once).
    Of two starts at once one wins: a `new` version's loser raises VersionTaken, a resume's RunDirInUse."""
    url, key = remote.url_of(run_dir), f"{remote.key(run_dir)}/{LEASE}"
    me = f"pid {os.getpid()} on {socket.gethostname()}"
    held = _read(remote, key, url)
    if held is not None and new and held[0] != me:
        raise _taken(url, held[0])  # written since this start listed the store: another start's new run
    pid, _, host = (held[0] if held else "").removeprefix("pid ").partition(" on ")
    lapsed = host == socket.gethostname() and pid.isdigit() and not alive(int(pid))  # a dead process of this host
    if held is not None and held[0] != me and not lapsed:
        held = _wait_for(remote, key, url, held)
    etag = _put(remote, key, me, {"IfMatch": held[1]} if held is not None else {"IfNoneMatch": "*"})
    if etag is None:
        theirs = _read(remote, key, url)
        if theirs is None or theirs[0] != me:  # (one's own write whose answer was lost, then retried: it won)
            holder = theirs[0] if theirs is not None else "another start"
            if new:
                raise _taken(url, holder)
            raise RunDirInUse(f"run dir {url} was claimed by {holder} at the same moment; wait for that run to end, "
                              "or write elsewhere with --trainer.default_root_dir")
    lease = Lease(remote, key)

    def renew(etag: str) -> None:
        # Each renewal only over this run's own last write: a run that stalled past LEASE_TTL_S (a frozen node) and
        # was taken over must not write over the new holder's lease, nor store anything more (RemoteRoot.upload).
        while not lease.stop.wait(LEASE_RENEW_S):
            renewed = _put(remote, key, me, {"IfMatch": etag} if etag else {}, quiet=True)
            if renewed is None:
                theirs = None
                with contextlib.suppress(Exception):  # (who holds it is for the line: the store may fail again)
                    theirs = _read(remote, key, url) if not lease.stop.is_set() else None
                if theirs is not None and theirs[0] == me:  # its own renewal, whose answer was lost, then retried
                    etag = theirs[1]
                    continue
                lease.lost = theirs[0] if theirs is not None else "another run"
                return
            etag = renewed or etag

    threading.Thread(target=renew, args=(etag,), name="run-lease", daemon=True).start()
    return lease


def _wait_for(remote, key: str, url: str, held: tuple[str, str]) -> Optional[tuple[str, str]]:
    """Another writer's lease, watched for LEASE_TTL_S: renewed, RunDirInUse; released, None; else as it was
    (lapsed)."""
    rank_zero_info(f"run dir {url} has a lease from {held[0]}: waiting up to {LEASE_TTL_S:.0f} s for it to be "
                   "renewed (a live run) or to lapse (a killed one)")
    deadline = time.monotonic() + LEASE_TTL_S
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = _read(remote, key, url)
        if now is None:  # released
            return None
        if now[1] != held[1]:  # each renewal is another object
            raise RunDirInUse(f"run dir {url} is in use by {now[0]} (its lease is renewed); wait for that run to end, "
                              "or write elsewhere with --trainer.default_root_dir")
    return held


def _taken(url: str, holder: str) -> VersionTaken:
    rank_zero_info(f"run dir {url} was claimed by {holder} at the same moment: taking the next version")
    return VersionTaken(holder)


def _read(remote, key: str, url: str) -> Optional[tuple[str, str]]:
    """(holder, ETag) of the lease, None when there is none; ConfigError for one this library did not write."""
    try:
        answer = remote.client().get_object(Bucket=remote.bucket, Key=key)
        body = answer["Body"].read()
    except Exception as error:  # noqa: BLE001  botocore's
        if _code(error) in ("NoSuchKey", "404"):
            return None
        raise remote.store_error(error, "reading the run's lease") from None
    try:
        lease = json.loads(body)
    except ValueError:
        lease = None
    # (the bucket is shared: anything may be there, and a lease that cannot be read blocks every start in the run dir)
    if not (isinstance(lease, dict) and isinstance(lease.get("holder"), str) and
            type(lease.get("renewed")) in (int, float)):
        raise ConfigError(f"run dir {url}: its lease s3://{remote.bucket}/{key} is not one this library writes "
                          f'(expected {{"holder": "pid N on HOST", "renewed": SECONDS}}, found '
                          f"{body[:80].decode(errors='replace')!r}); if no run writes there now, delete it (aws s3 rm "
                          f"s3://{remote.bucket}/{key}) and rerun")
    return lease["holder"], answer["ETag"]


def _put(remote, key: str, holder: str, condition: dict[str, str], quiet: bool = False) -> Optional[str]:
    """Write the lease (a new object each time); its ETag, None when its condition lost, "" if a `quiet` one failed."""
    body = json.dumps({"holder": holder, "renewed": time.time()}).encode()
    try:
        return remote.client().put_object(Bucket=remote.bucket, Key=key, Body=body, **condition).get("ETag", "")
    except Exception as error:  # noqa: BLE001
        if condition and _code(error) in LOST:
            return None
        if not quiet:
            raise remote.store_error(error, "writing the run's lease") from None
    return ""


def _code(error: Exception) -> str:
    """The store's error code; "" for none (botocore's connection errors carry response=None)."""
    return str((getattr(error, "response", None) or {}).get("Error", {}).get("Code", ""))
