"""Pack an ImageNet-layout folder (or CSV manifests) into the shards classifier_engine.data.ShardDataModule reads.

    python -m classifier_engine.data.make_shards --source /datasets/imagenet --out s3://bucket/imagenet-256 --workers 16
    python -m classifier_engine.data.make_shards --source /datasets/imagenet --out /data/in1k-wds --format webdataset

Both formats, and a rerun keeping every finished shard: docs/data-at-scale.md.
"""

import argparse
import errno
import hashlib
import io
import json
import os
import sys
import tarfile
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from multiprocessing import Pool
from pathlib import Path
from typing import Optional

from PIL import Image, ImageOps

from classifier_engine.data.decoders import as_rgb
from classifier_engine.data.layout import check_layout, folder_samples, read_class_labels
from classifier_engine.data.manifest import read_manifests
from classifier_engine.data.shards import FORMAT, INDEX, s3_error
from classifier_engine.data.tar_shards import INFO, WRITER
from classifier_engine.errors import ConfigError, DiskFullError
from classifier_engine.storage.files import atomic_write
from classifier_engine.storage.object_store import s3_client, split_url


@dataclass(frozen=True)
class Options:
    max_short_side: int = 256
    quality: int = 90
    keep_original: bool = False
    shard_size: int = 1024

    def __post_init__(self) -> None:
        # Checked before anything is read: 0 stored 1x1 px images and a negative size an empty set, both with exit 0.
        for flag, value, high in (("--max-short-side", self.max_short_side, None), ("--quality", self.quality, 100),
                                  ("--shard-size", self.shard_size, None)):
            if not 1 <= value <= (high or value):
                raise ConfigError(f"{flag} {value}: expected an integer {f'from 1 to {high}' if high else '>= 1'}")


class Output:
    """A folder (each file written atomically) or s3://bucket/prefix (a PUT is all or nothing)."""

    def __init__(self, location: str):
        self.location, self.remote, self._client = location, location.startswith("s3://"), None

    def __getstate__(self):
        return {**self.__dict__, "_client": None}  # a client does not pickle: one per worker

    def s3(self, method: str, name: str, **args):
        """The object store's answer to `method` on the object `name` (a get: its bytes; None when there is no such
        key to get or head); a failure, the body's transfer included, as one line."""
        bucket, prefix = split_url(self.location)
        self._client = self._client or s3_client()
        try:
            answer = getattr(self._client, method)(Bucket=bucket, Key=f"{prefix}/{name}".lstrip("/"), **args)
            return answer["Body"].read() if method == "get_object" else answer
        except Exception as error:
            if method in ("get_object", "head_object") and ("NoSuchKey" in str(error) or "(404)" in str(error)):
                return None
            raise s3_error(error, self.location) from None

    def read(self, name: str) -> Optional[bytes]:
        if self.remote:
            return self.s3("get_object", name)
        path = Path(self.location) / name
        return path.read_bytes() if path.is_file() else None

    def write(self, name: str, data: bytes) -> None:
        if self.remote:
            self.s3("put_object", name, Body=data)
        else:
            atomic_write(Path(self.location) / name, lambda file: file.write(data),
                         fix="Free space or pass another --out, then rerun: finished shards are kept")

    def size(self, name: str) -> Optional[int]:
        """The file's size in bytes; None when there is none."""
        if self.remote:
            return (self.s3("head_object", name) or {}).get("ContentLength")
        path = Path(self.location) / name
        return path.stat().st_size if path.is_file() else None

    def remove(self, name: str) -> None:
        if self.remote:
            self.s3("delete_object", name)
        else:
            (Path(self.location) / name).unlink(missing_ok=True)


def encode(path: str, options: Options) -> tuple[bytes, Optional[str]]:
    """The image's bytes (resized to max_short_side as JPEG unless kept), and what else a re-encoding changed."""
    data = Path(path).read_bytes()
    try:
        with Image.open(io.BytesIO(data)) as image:
            scale = options.max_short_side / min(image.size)
            if options.keep_original or scale >= 1 and image.format == "JPEG":  # (small: no second lossy encoding)
                image.load()  # its pixels decode: a broken file is named now, not by a fit that meets it
                return data, None
            changed = [f"{image.format} as JPEG" if image.format != "JPEG" else "",
                       f"{image.mode} as RGB" if image.mode != "RGB" else ""]
            # The pixels auto's decoders read (a JPEG kept as it is keeps its orientation tag for them)
            image = as_rgb(ImageOps.exif_transpose(image))
            if scale < 1:
                image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))),
                                     Image.Resampling.BILINEAR, reducing_gap=3.0)
            out = io.BytesIO()
            image.save(out, format="JPEG", quality=options.quality)
            return out.getvalue(), ", ".join(filter(None, changed)) or None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        raise ConfigError(f"cannot decode {path} ({error}): replace or delete it, then rerun") from None


WEBDATASET_SPLITS = {"train": "train", "val": "validation", "test": "test"}  # the Hugging Face sets' split names


def image_extension(data: bytes, path: str) -> str:
    """The WebDataset member extension of an encoded image: jpg, png or webp (what timm and the readers decode)."""
    if data.startswith(b"\xff\xd8\xff"):
        return "jpg"
    if data.startswith(b"\x89PNG"):
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    raise ConfigError(f"{path}: --format webdataset stores JPEG, PNG or WEBP images, and --keep-original kept another "
                      "format: drop --keep-original (it is then re-encoded as JPEG)")


def tar_bytes(images: list[bytes], samples: list[tuple[str, int]], first: int) -> bytes:
    """A WebDataset tar: for sample i, `<first+i as %08d>.<jpg|png|webp>` then `.cls` (its label as text)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i, (data, (path, label)) in enumerate(zip(images, samples)):
            key = f"{first + i:08d}"
            for member, body in ((f"{key}.{image_extension(data, path)}", data), (f"{key}.cls", str(label).encode())):
                info = tarfile.TarInfo(member)  # mtime 0, no owner: the same images give the same bytes
                info.size, info.mode = len(body), 0o644
                tar.addfile(info, io.BytesIO(body))
    return out.getvalue()


def as_record(data: Optional[bytes]) -> Optional[dict]:
    """A record or index as a conversion wrote it; None when there is none or it is not one (cut short by a full disk,
    damaged, another tool's file): then it is written again."""
    try:
        value = json.loads(data) if data is not None else None
    except (ValueError, RecursionError):  # (not JSON, not UTF-8, nested past Python's stack)
        return None
    return value if isinstance(value, dict) else None


def intact(output: Output, name: str) -> Optional[dict]:
    """The record of the shard `name` when the shard is there whole (its recorded size); else None."""
    record = as_record(output.read(f"{name}.json"))
    return record if record is not None and output.size(name) == record.get("bytes") else None


def write_shard(job: tuple[Output, Options, str, str, list[tuple[str, int]], str, int]) -> tuple[bool, dict]:
    """(written, record) of one shard: written, then its record, unless a record with its fingerprint is there."""
    output, options, _, name, samples, print_, first = job
    if (old := intact(output, name)) is not None and old.get("fingerprint") == print_:
        return False, old
    encoded = [encode(path, options) for path, _ in samples]
    images, changed = [data for data, _ in encoded], [what for _, what in encoded if what]
    data = tar_bytes(images, samples, first) if name.endswith(".tar") else b"".join(images)
    output.write(name, data)
    record = {"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
              "lengths": list(map(len, images)), "labels": [label for _, label in samples], "fingerprint": print_,
              "changed": dict(Counter(changed))}
    output.write(f"{name}.json", json.dumps(record).encode())
    return True, record


def read_source(source: str, val_source: Optional[str]) -> tuple[list[str], list[str], dict[str, list]]:
    """(class names, class labels, {split: [(path, label)]}) of an ImageNet-layout folder or of CSV/JSONL manifests."""
    root = Path(source).expanduser()
    if not root.exists():
        raise ConfigError(f"--source {source} does not exist: pass an ImageNet-layout folder (train/<class>/, "
                          "val/<class>/) or a train manifest (CSV with the columns path,label) and --val-source")
    if root.is_dir():
        classes = check_layout(root)
        splits = {split: folder_samples(root / split, classes) for split in ("train", "val", "test")
                  if (root / split).is_dir()}
        return classes, read_class_labels(root, classes), splits
    if val_source is None:
        raise ConfigError(f"--source {source} is a manifest: pass the validation one too (--val-source val.csv)")
    classes, splits = read_manifests({"train_manifest": source, "val_manifest": val_source},
                                     flags={"train_manifest": "--source", "val_manifest": "--val-source"})
    return classes, classes, splits


def plan(splits: dict[str, list], options: Options, webdataset: bool = False) -> list[tuple[str, str, list, str, int]]:
    """(split, name, samples, fingerprint, first sample's number) of every shard, a split's samples in order; the
    fingerprint is of the options and of each image's path, label, size and modification time."""
    jobs = []
    for split, samples in splits.items():
        for k, first in enumerate(range(0, len(samples), options.shard_size)):
            chunk = [(str(path), int(label)) for path, label in samples[first:first + options.shard_size]]
            name = f"{split}-{k:05d}.shard" if not webdataset else f"{WEBDATASET_SPLITS[split]}-{k:04d}.tar"
            files = [(os.stat(path).st_size, os.stat(path).st_mtime_ns) for path, _ in chunk]  # an image replaced
            print_ = hashlib.sha256(json.dumps([asdict(options), chunk, files]).encode()).hexdigest()[:16]
            jobs.append((split, name, chunk, print_, first))
    return jobs


def convert(source: str, out: str, options: Options, *, val_source: Optional[str] = None, workers: int = 1,
            webdataset: bool = False) -> dict:
    classes, labels, splits = read_source(source, val_source)
    jobs = plan(splits, options, webdataset)
    output = Output(out)
    try:  # now, in one line, when the output cannot be written
        output.write(".probe", b"")
        output.remove(".probe")
    except OSError as error:
        raise ConfigError(f"--out {out}: cannot write there ({error.strerror or error}): pass a writable folder or "
                          "s3:// URL") from None
    whole = hashlib.sha256("".join(job[3] for job in jobs).encode()).hexdigest()[:16]
    last = INFO if webdataset else INDEX  # the file that makes the set whole, written last
    if (found := output.read(last)) is not None:
        old = as_record(found)
        same = old is not None and old.get("fingerprint") == whole
        broken = next((job[1] for job in jobs if intact(output, job[1]) is None), None) if same else None
        if same and broken is None:
            log(f"{out} is complete already ({len(jobs)} shards): nothing to do")
            return old
        log(f"{out}/{last} is not an index (cut short or damaged): written again, after the shards its records do "
            "not match" if old is None else f"{out}/{broken} is missing or cut short: written again" if same else
            f"{out} holds another shard set (other images or options): starting over, shards rewritten")
        remove_old_shards(output, old, {job[1] for job in jobs})
        output.remove(last)  # never an index naming shards that are being rewritten
    started, tasks = time.time(), [(output, options, *job) for job in jobs]
    with Pool(workers) if workers > 1 else nullcontext() as pool:  # one worker: this process, no fork
        done = list(pool.imap(write_shard, tasks) if pool else map(write_shard, tasks))
    written = sum(fresh for fresh, _ in done)
    log(f"{written} shards written, {len(jobs) - written} kept from an earlier run, in {time.time() - started:.1f} s")
    records = {split: [record for job, (_, record) in zip(jobs, done) if job[0] == split] for split in splits}
    changed = sum((Counter(r.get("changed") or {}) for shards in records.values() for r in shards), Counter())
    if changed:  # JPEG quality Q: a loss the user did not ask for by name
        kinds = ", ".join(f"{n}: {what}" for what, n in changed.most_common())
        log(f"{changed.total()} images re-encoded as JPEG quality {options.quality} beyond resizing ({kinds}); "
            "--keep-original stores them as they are")
    if webdataset:  # timm's _info.json (its reader takes the splits' files and lengths from it), plus the class names
        names = {split: WEBDATASET_SPLITS[split] for split in records}
        index = {"name": Path(out.rstrip("/")).name, "classes": classes, "class_labels": labels, "fingerprint": whole,
                 "splits": {names[split]: {"name": names[split], "filenames": [r["file"] for r in shards],
                                           "shard_lengths": [len(r["labels"]) for r in shards],
                                           "num_samples": sum(len(r["labels"]) for r in shards)}
                            for split, shards in records.items()}}
    else:
        keys = ("file", "bytes", "sha256", "lengths", "labels")
        index = {"format": FORMAT, "classes": classes, "class_labels": labels, "options": asdict(options),
                 "fingerprint": whole, "splits": {split: [{k: r[k] for k in keys} for r in shards]
                                                  for split, shards in records.items()}}
    output.write(last, json.dumps(index).encode())
    return index


def remove_old_shards(output: Output, old: Optional[dict], kept: set[str]) -> None:
    """The old index's shards the new set lacks (ours: a record beside each), removed before that index goes (a reader
    would take an old tar for one of this set's; a kill after the index went would leave them for good)."""
    for name in sorted(set(listed_files(old)) - kept):
        if output.read(f"{name}.json") is not None:
            output.remove(name)
            output.remove(f"{name}.json")


def listed_files(index: Optional[dict]) -> list[str]:
    """The shard files an index.json or _info.json lists (none when it is not one)."""
    splits = (index or {}).get("splits")
    found = [shard.get("file") if isinstance(shard, dict) else None for shards in splits.values()
             for shard in (shards if isinstance(shards, list) else [])] if isinstance(splits, dict) else []
    found += [name for record in (splits.values() if isinstance(splits, dict) else ()) if isinstance(record, dict)
              for name in (record.get("filenames") if isinstance(record.get("filenames"), list) else ())]
    return [name for name in found if isinstance(name, str) and "/" not in name and not name.startswith(".")]


def log(message: str) -> None:
    print(f"make_shards: {message}", flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=WRITER, description=__doc__.split("\n")[0])
    parser.add_argument("--source", required=True, help="ImageNet-layout folder, or the train manifest (CSV/JSONL)")
    parser.add_argument("--val-source", help="the validation manifest, when --source is a manifest")
    parser.add_argument("--out", required=True, help="folder, or s3://bucket/prefix (endpoint and keys: AWS_* vars)")
    parser.add_argument("--max-short-side", type=int, default=256, help="resize larger images down to this short side")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality of the re-encoded images")
    parser.add_argument("--keep-original", action="store_true", help="store each file's bytes as they are")
    parser.add_argument("--shard-size", type=int, default=1024, help="images per shard")
    parser.add_argument("--format", choices=["shards", "webdataset", "project"], default="shards",
                        help="our shards (index.json), or WebDataset tars named as the Hugging Face ImageNet sets "
                             "(`project`: the name of `shards` before 0.2)")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="processes encoding shards (default: the cores this process may use)")
    args = parser.parse_args(argv)
    try:
        options = Options(args.max_short_side, args.quality, args.keep_original, args.shard_size)
        index = convert(args.source, args.out, options, val_source=args.val_source, workers=args.workers,
                        webdataset=args.format == "webdataset")
    except (ConfigError, DiskFullError) as error:
        print(f"make_shards: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        fix = "free space" if error.errno == errno.ENOSPC else "check the path"
        print(f"make_shards: {error.filename or args.out}: {error.strerror or error}: {fix}, then rerun "
              "(finished shards are kept)", file=sys.stderr)
        return 2
    counts = {split: shards["num_samples"] if isinstance(shards, dict) else sum(len(s["labels"]) for s in shards)
              for split, shards in index["splits"].items()}  # _info.json's splits, or index.json's
    log(f"{args.out}: {len(index['classes'])} classes, {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
