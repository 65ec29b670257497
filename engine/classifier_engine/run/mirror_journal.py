"""What an object store's node-local mirror knows of each file (remote_runs.py): its journal, one per folder, records
every file as last uploaded or downloaded (size, mtime, URL, a checkpoint's ETag), so a start tells the store's copies
from files written since, and a file read from the mirror from one written here.

    python -m classifier_engine fit --config CONFIG --trainer.default_root_dir s3://bucket/runs --ckpt_path last
"""

import json
from pathlib import Path
from typing import Optional

from classifier_engine.storage.files import atomic_write

JOURNAL = ".uploaded.json"  # in each mirror folder: {name: [size, mtime_ns, URL, (ETag of a checkpoint)]}


def journal(folder: Path) -> dict[str, list]:
    try:
        entries = json.loads((folder / JOURNAL).read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def record(path: Path, url: str, etag: Optional[str] = None) -> None:
    """`path` is now as object `url` (`etag`) holds it: just uploaded or downloaded."""
    entries = journal(path.parent)
    entries[path.name] = [*_stamp(path), url, *([etag] if etag else [])]
    atomic_write(path.parent / JOURNAL, lambda file: file.write(json.dumps(entries)), mode="w", fsync=False)


def as_recorded(path: Path, etag: Optional[str] = None) -> bool:
    """Whether `path` is as last uploaded or downloaded (else: pending, or written since), as object `etag` if given."""
    entry = journal(path.parent).get(path.name)
    return isinstance(entry, list) and entry[:2] == _stamp(path) and (etag is None or entry[3:4] == [etag])


def stored_origin(path: Path) -> Optional[str]:
    """The URL of a file of an object store's mirror (a folder with a journal: untrusted, as anyone with write access
    to the bucket may have put it there); None for any other."""
    path = Path(path)
    entries = journal(path.parent)  # (each entry's URL is its folder's, then its name)
    urls = [str(entry[2]) for entry in entries.values() if isinstance(entry, list) and len(entry) > 2]
    if not entries:
        return None
    return f"{urls[0].rpartition('/')[0]}/{path.name}" if urls else f"the object store mirrored in {path.parent}"


def mirrored(path: Path) -> bool:
    """The run's own files (a shard folder's .metadata too): not the journal, lock, lease, partial save or download."""
    return (path.parent.name.endswith(".shards") or not path.name.startswith(".")) and not path.name.startswith(
        JOURNAL) and not path.name.endswith((".partial", ".download"))


def _stamp(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]
