"""WebDataset tars read as they are (the Hugging Face ImageNet sets', timm's, OpenCLIP's), each indexed once into
data.cache_dir (every sample's image offset and label) for ShardDataModule to read as its own shards.

    python -m classifier_engine fit ... --data.class_path classifier_engine.ShardDataModule --data.init_args.shards DIR
"""

import hashlib
import json
import logging
import os
import re
import tarfile
from pathlib import Path
from typing import Any, Optional

from classifier_engine.data.listed_paths import inside
from classifier_engine.errors import ConfigError, shown
from classifier_engine.storage.files import atomic_write

logger = logging.getLogger(__name__)
IMAGES = ("jpg", "jpeg", "png", "webp")  # a sample's image: the first of these it has (timm reads jpg;png;webp)
# imagenet1k-train-0000.tar, imagenet1k-validation-00.tar (the Hugging Face sets), train-0000.tar (make_shards)
NAME = re.compile(r"(?:(.*)-)?(train|validation|val|test)-(\d+)\.tar")
INFO = "_info.json"  # timm's: each split's files and lengths; the class names when make_shards wrote it
WRITER = "python -m classifier_engine.data.make_shards"  # what the messages tell a user to run (shards too)
FIX = f"replace it with a good copy, or rewrite the set with {WRITER} --format webdataset"
Tars = dict[str, tuple[int, str]]  # file name -> (bytes, version: a local file's mtime, an object's ETag)
CACHED = "webdataset-index/1"  # the cached index's format: another is built again


def tar_index(store, listing: Tars) -> Optional[dict[str, Any]]:
    """The listing's *.tar files as a shard set's index (classes, splits of shards with offsets); None: no tars."""
    tars = {name: found for name, found in listing.items() if name.endswith(".tar")}
    if not tars:
        return None
    splits: dict[str, list[tuple]] = {}
    for name in sorted(tars):
        if (match := NAME.fullmatch(name)) is None:
            raise ConfigError(f"data.shards: {store.location}/{shown(name)}: expected WebDataset tars named "
                              "<set>-<train|validation|test>-<number>.tar, as the Hugging Face ImageNet sets are "
                              "(imagenet1k-train-0000.tar): rename it, or move it out")
        splits.setdefault("val" if match[2] == "validation" else match[2], []).append((match[1] or "", int(match[3]),
                                                                                         name))
    if "train" not in splits or "val" not in splits:
        raise ConfigError(f"data.shards: {store.location}: WebDataset tars of both splits expected, found "
                          f"{sorted(splits)}: add the *-train-*.tar and *-validation-*.tar files")
    try:  # timm's _info.json: the splits' files and lengths, and our class names (none, or not JSON: the file names)
        info = json.loads(store.read(INFO)) if INFO in listing else {}
    except (OSError, ValueError):
        info = {}
    info = info if isinstance(info, dict) else {}
    splits_of = info["splits"] if isinstance(info.get("splits"), dict) else {}
    listed = {split: record["filenames"] for split, record in splits_of.items()
              if isinstance(record, dict) and isinstance(record.get("filenames"), list)}
    for name in sorted(tars):  # a tar of an earlier set would be read as one of this set's (evaluation not exact)
        if (split := NAME.fullmatch(name)[2]) in listed and name not in listed[split]:
            raise ConfigError(f"data.shards: {store.location}/{shown(name)} is not one of the tars {INFO} lists for "
                              f"{split}: a tar of another set (an earlier make_shards?); remove it, or rewrite the set")
    entries = cached_entries(store, tars)
    check_info(store, info, entries)
    top = max((y for entry in entries.values() for y in entry["labels"]), default=0)
    names, labels = info.get("classes"), info.get("class_labels")  # make_shards writes them; HF's sets do not
    classes = names if is_names(names) and len(names) > top else [str(y) for y in range(top + 1)]
    return {"classes": classes, "class_labels": labels if is_names(labels) and len(labels) == len(classes) else classes,
            "splits": {split: [entries[name] for *_, name in sorted(found)] for split, found in splits.items()}}


def is_names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def cached_entries(store, tars: Tars) -> dict[str, dict[str, Any]]:
    """Each tar's index entry: the cached one when its size and version match, else built (by one process a node)."""
    identity = store.location if store.remote else str(store.cache.resolve())
    path = store.cache_root / "webdataset" / f"{hashlib.sha256(identity.encode()).hexdigest()[:16]}.json"
    with store.lock(path):
        try:
            cached = json.loads(path.read_text())
            cached = cached["tars"] if cached["format"] == CACHED else {}
        except (OSError, ValueError, TypeError, KeyError):
            cached = {}
        entries = {}
        for name, (size, version) in tars.items():
            old = cached.get(name) if isinstance(cached, dict) else None
            if isinstance(old, dict) and old.get("bytes") == size and old.get("version") == version:
                entries[name] = old
                continue
            if store.remote and old:  # another object under this name: its cached copy is stale
                (store.cache / name).unlink(missing_ok=True)
            where = f"data.shards: {store.location}/{shown(name)}"
            inside(store.cache, name, where)  # an object's name is untrusted too (the cache is written there)
            entries[name] = {**index_tar(store.local(name, size), where), "file": name, "bytes": size,
                             "version": version}
        if entries != cached:
            logger.info("indexed %d WebDataset tars of %s into %s", len(tars), store.location, path)
            atomic_write(path, lambda file: json.dump({"format": CACHED, "tars": entries}, file), mode="w", fsync=False,
                         fix="Free space there or pass another data.cache_dir")
    return entries


def index_tar(path: Path, where: str) -> dict[str, Any]:
    """keys, offsets, lengths and labels (.cls) of the tar's samples, from its untrusted headers (nothing extracted)."""
    members: dict[str, dict[str, tuple[int, int]]] = {}  # key -> extension -> (offset, size), in the tar's order
    size = path.stat().st_size
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                name = member.name
                if name.startswith("/") or ".." in name.split("/"):
                    raise ConfigError(f"{where}: member {name[:200]!r} names a path outside the tar: a crafted or "
                                      f"broken tar, not read; {FIX}")
                folder, _, base = name.rpartition("/")
                stem, dot, extension = base.partition(".")
                if not (member.isreg() and dot and stem):  # as WebDataset: folders, links, names without a suffix
                    continue
                key = f"{folder}/{stem}" if folder else stem
                if extension.lower() in members.setdefault(key, {}) or member.offset_data + member.size > size:
                    why = "is cut short" if member.offset_data + member.size > size else "appears twice"
                    raise ConfigError(f"{where}: member {name[:200]!r} {why}; {FIX}")
                members[key][extension.lower()] = (member.offset_data, member.size)
            end = tar.offset  # where the headers stopped: the end-of-archive zeros, or a damaged header
    except (tarfile.TarError, EOFError, UnicodeError) as error:
        raise ConfigError(f"{where}: unreadable as an uncompressed tar ({error}); {FIX}") from None
    found: dict[str, list] = {"keys": [], "offsets": [], "lengths": [], "labels": []}
    with open(path, "rb") as file:
        tail = os.pread(file.fileno(), 1024, end)
        if any(tail):
            raise ConfigError(f"{where}: a damaged tar header at byte {end}; {FIX}")
        if len(tail) < 1024:  # a copy cut where a member ended (a tar ends in two zero blocks)
            last = f" after member {name[:200]!r}" if members else ""
            raise ConfigError(f"{where}: cut short{last} (no end-of-archive blocks); {FIX}")
        for key, files in members.items():
            image = next((files[extension] for extension in IMAGES if extension in files), None)
            if image is None or "cls" not in files:
                missing = "image (.jpg, .jpeg, .png or .webp)" if image is None else ".cls (the class index as text)"
                raise ConfigError(f"{where}: sample {key!r} has no {missing}; {FIX}")
            text = os.pread(file.fileno(), min(files["cls"][1], 32), files["cls"][0]).strip()
            if files["cls"][1] > 32 or not text.isdigit():
                raise ConfigError(f"{where}: sample {key!r}: its .cls is {text[:32]!r}, expected a class index (ASCII "
                                  f"digits); {FIX}")
            for field, value in zip(found, (key, *image, int(text))):  # key, image offset and length, label
                found[field].append(value)
    return found


def check_info(store, info: dict[str, Any], entries: dict[str, Any]) -> None:
    """The tars timm's _info.json lists are all there, each with the samples it says (a cut download of a set)."""
    for split, record in (info["splits"] if isinstance(info.get("splits"), dict) else {}).items():
        record = record if isinstance(record, dict) else {}
        names, lengths = record.get("filenames"), record.get("shard_lengths")
        names, lengths = names if isinstance(names, list) else [], lengths if isinstance(lengths, list) else []
        for name, length in zip(names, [*lengths, *[None] * len(names)]):
            where = f"data.shards: {store.location}/{shown(str(name))}"
            if name not in entries:
                raise ConfigError(f"{where} is missing, and {INFO} lists it in {split}: copy the whole set again")
            if length is not None and len(entries[name]["labels"]) != length:
                raise ConfigError(f"{where} holds {len(entries[name]['labels'])} samples, and {INFO} says {length}: "
                                  "copy the whole set again")
