"""ShardDataModule: shards written by make_shards.py, or WebDataset tars (tar_shards.py), read from a folder or from
s3://bucket/prefix through a node-local cache, with every option of the folder module (docs/data-at-scale.md).

    python -m classifier_engine fit --config CONFIG --data.class_path classifier_engine.data.ShardDataModule \
        --data.init_args.shards s3://my-bucket/imagenet-256 --data.init_args.cache_dir /local/nvme/shards
"""

import bisect
import contextlib
import fcntl
import functools
import hashlib
import io
import itertools
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import torch
from PIL import Image
from torch.utils.data import Dataset, get_worker_info

from classifier_engine.data.decoders import DEVICE_DECODERS, ImageReadMode, decode_image
from classifier_engine.data.image_data import ImageDataModule
from classifier_engine.data.listed_paths import inside
from classifier_engine.data.partial_decode import encoded_jpeg, nvimgcodec_decode
from classifier_engine.data.tar_shards import WRITER, tar_index
from classifier_engine.errors import ConfigError, DataUnavailable, UnreadableImageError
from classifier_engine.options import PositiveInt
from classifier_engine.samplers import ResumableSampler
from classifier_engine.seeds import SeededSamples
from classifier_engine.storage.cache import cache_dir as data_cache
from classifier_engine.storage.files import atomic_write
from classifier_engine.storage.object_store import BUCKET, passing_failure, s3_client, split_url

logger = logging.getLogger(__name__)
INDEX = "index.json"  # written last, atomically, by make_shards.py: a folder without it is not a shard set
FORMAT = "classifier-engine-shards/1"
OLD_FORMATS = ("project-shards/1",)  # the same layout under its name before 0.2 (a template's word), still read
# A shard download failing in a way that may pass (a 5xx, a cut or stalled transfer) is tried TRIES times, BACKOFF_S,
# then twice that... apart: at most ~70 s, then one line (last.ckpt saved at the step reached: run/last_checkpoint.py).
TRIES, BACKOFF_S = 4, 1.0


class MissingIndex(ConfigError):
    """A location without our index.json: not a shard set, unless it holds WebDataset tars."""


def s3_error(error: Exception, url: str, tries: int = 1, option: str = "") -> Exception:
    """A botocore error as one line naming the fix and the `option` that gave the URL, never the (secret) endpoint or
    keys; a failure that may pass: ConfigError at start (the setting, most likely), DataUnavailable mid-run (outage)."""
    import botocore.exceptions as be

    where = f"{option}: {url}" if option else url
    if (why := passing_failure(error)) is not None:  # (their own text names the endpoint: never printed)
        kind = DataUnavailable if tries > 1 else ConfigError
        return kind(f"{where}: {why}{f', {tries} tries' if tries > 1 else ''}: check the server behind "
                    "AWS_ENDPOINT_URL (or AWS's status when unset) and that variable, then rerun (--ckpt_path last "
                    "continues a run)")
    if isinstance(error, be.NoCredentialsError):
        return ConfigError(f"{where}: no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)")
    code = error.response.get("Error", {}).get("Code", "") if isinstance(error, be.ClientError) else ""
    if code == "NoSuchBucket":
        return ConfigError(f"{where}: bucket {split_url(url)[0]!r} does not exist: create it, or fix the s3:// URL")
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "ExpiredToken"):
        return ConfigError(f"{where}: the object store refused the credentials ({code}): check AWS_ACCESS_KEY_ID, "
                           "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and the bucket's permissions")
    if code in ("NoSuchKey", "404") and url.endswith(".shard"):
        return ConfigError(f"{where}: missing from the object store: copy the whole shard set again, or rewrite it "
                           f"with {WRITER}")
    if code in ("NoSuchKey", "404"):
        return MissingIndex(f"{where}: no {INDEX} there: not a finished shard set; write one with {WRITER} --source "
                            "ROOT --out URL")
    return error


class ShardStore:
    """A folder read in place, or s3://bucket/prefix: each shard one GET into `cache_dir`, never random reads there."""

    def __init__(self, location: str, cache_dir: Optional[str] = None):
        # A mistyped URL as one line naming data.shards (boto3's own is a traceback, or a folder not found).
        if re.match(r"(?i)s3:", location) and not location.startswith("s3://"):
            raise ConfigError(f"data.shards {location}: expected s3://bucket/prefix (or a folder)")
        self.location, self.remote = location, location.startswith("s3://")
        if self.remote and not BUCKET.fullmatch(split_url(location)[0]):
            raise ConfigError(f"data.shards {location}: {split_url(location)[0]!r} is not a bucket name (3-63 "
                              "lowercase letters, digits, dots and hyphens): expected s3://bucket/prefix")
        self.cache_root = Path(cache_dir or data_cache() / "shards").expanduser()  # also WebDataset tars' indexes
        self.cache = self.cache_root.joinpath(*split_url(location)) if self.remote else Path(location).expanduser()
        if self.remote:  # now, in one line, not at the first download (in a DataLoader worker); nothing written yet
            there = next(p for p in (self.cache, *self.cache.parents) if p.exists())
            if not there.is_dir() or not os.access(there, os.W_OK | os.X_OK):
                self.cache_error("a file is in the way" if not there.is_dir() else f"{there} is not writable")
        self._client, self._pid = None, None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None, "_pid": None}  # ddp_spawn, spawned workers: a new client there

    def cache_error(self, why: str) -> None:
        raise ConfigError(f"data.cache_dir {self.cache_root}: cannot write there ({why}): pass a writable node-local "
                          "folder with room for the shard set")

    def client(self):
        if self._pid != os.getpid():  # a client per process: DataLoader workers fork
            self._client, self._pid = s3_client(retries=0), os.getpid()  # ShardStore.get tries again itself
        return self._client

    def listing(self) -> dict[str, tuple[int, str]]:
        """(bytes, version) of each file directly in the folder (its mtime) or under the prefix (its ETag)."""
        if not self.remote:  # (no folder: no files)
            return {path.name: (path.stat().st_size, str(path.stat().st_mtime_ns)) for path in self.cache.glob("*")
                    if path.is_file()}
        bucket, prefix = split_url(self.location)
        try:  # one try at start-up, as the index's read
            pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Delimiter="/",
                                                                            Prefix=f"{prefix}/".lstrip("/"))
            return {item["Key"].rpartition("/")[2]: (item["Size"], item["ETag"]) for page in pages
                    for item in page.get("Contents", [])}
        except Exception as error:  # noqa: BLE001  botocore's, sorted by s3_error
            raise s3_error(error, self.location, option="data.shards") from None

    def read(self, name: str) -> bytes:
        """A file read at start-up: a server that is not there is said at once (mid-run a shard's download retries)."""
        return self.get(name, tries=1) if self.remote else (self.cache / name).read_bytes()

    def read_index(self) -> dict[str, Any]:
        try:
            body = self.read(INDEX)
        except FileNotFoundError:
            why = "no such folder" if not self.cache.exists() else f"no {INDEX}: a conversion not finished"
            raise MissingIndex(f"data.shards: {self.location}: {why}; write the shards with {WRITER} --source ROOT "
                               f"--out {self.location}") from None
        except OSError as error:
            raise ConfigError(f"data.shards: cannot read {self.cache / INDEX} ({error.strerror or error})") from None
        where = f"data.shards: {self.location}/{INDEX}"
        try:
            index = json.loads(body)
        except ValueError as error:
            raise ConfigError(f"{where} is not JSON ({error}): rewrite it with {WRITER}") from None
        if not isinstance(index, dict) or index.get("format") not in (FORMAT, *OLD_FORMATS):
            found = index.get("format") if isinstance(index, dict) else type(index).__name__
            raise ConfigError(f"{where} is {found!r}, expected {FORMAT}: rewrite it with {WRITER}")
        check_index(index, where, self.cache)
        if not self.remote:  # a missing or cut shard now, in one line, not in the first worker that reads it
            for shard in (shard for shards in index["splits"].values() for shard in shards):
                path = self.cache / shard["file"]
                if (size := path.stat().st_size if path.is_file() else None) != shard["bytes"]:
                    state = "is missing" if size is None else f"has {size} bytes, not {shard['bytes']}"
                    raise ConfigError(f"data.shards: {path} {state}: copy the whole shard set again, or rewrite it "
                                      f"with {WRITER}")
        return index

    @contextlib.contextmanager
    def lock(self, path: Path) -> Iterator[None]:
        """Held by one process of the node at a time (its other workers and ranks wait), `path`'s folder made first."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(path.parent / f".{path.name}.lock", "w")
        except OSError as error:
            self.cache_error(error.strerror or str(error))
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def local(self, name: str, size: int, sha256: Optional[str] = None) -> Path:
        """The file's path on this node; a remote one downloaded first, once per node, checked against `sha256`."""
        path = self.cache / name
        if not self.remote or (path.is_file() and path.stat().st_size == size):
            return path
        with self.lock(path):
            if not (path.is_file() and path.stat().st_size == size):
                data = self.get(name)
                if sha256 and hashlib.sha256(data).hexdigest() != sha256:
                    raise ConfigError(f"{self.location}/{name} is not the shard its {INDEX} lists (sha256 differs): "
                                      f"delete {name} and {name}.json there and rerun {WRITER}")
                atomic_write(path, lambda file: file.write(data), fsync=False,
                             fix="Free space there or pass another data.cache_dir")
        return path

    def get(self, name: str, tries: int = TRIES) -> bytes:
        """The object's bytes; a failure that may pass is tried again (with backoff), then one line."""
        bucket, prefix = split_url(self.location)
        for attempt in range(tries):
            try:
                return self.client().get_object(Bucket=bucket, Key=f"{prefix}/{name}".lstrip("/"))["Body"].read()
            except Exception as error:  # noqa: BLE001  botocore's and urllib3's, sorted by s3_error
                if attempt + 1 == tries or passing_failure(error) is None:
                    raise s3_error(error, f"{self.location}/{name}" if name != INDEX else self.location,
                                   attempt + 1, "data.shards") from None
                time.sleep(BACKOFF_S * 2 ** attempt)


def check_index(index: dict[str, Any], where: str, folder: Path) -> None:
    """An untrusted index.json's classes and shards (each file inside `folder`, where the S3 cache writes), checked."""
    classes, splits = index.get("classes"), index.get("splits")
    if not (isinstance(classes, list) and classes and all(isinstance(c, str) for c in classes)):
        raise ConfigError(f"{where}: 'classes' is not a list of class names: rewrite it with {WRITER}")
    if not (isinstance(splits, dict) and isinstance(splits.get("train"), list) and isinstance(splits.get("val"), list)):
        raise ConfigError(f"{where}: 'splits' lacks the train and val lists of shards: rewrite it with {WRITER}")
    for split, shards in splits.items():
        for k, shard in enumerate(shards if isinstance(shards, list) else [None]):
            entry = f"{where}, splits.{split}[{k}]"
            if not isinstance(shard, dict) or not all(key in shard for key in ("file", "bytes", "lengths", "labels")):
                raise ConfigError(f"{entry}: expected an object with file, bytes, lengths and labels: rewrite it with "
                                  f"{WRITER}")
            inside(folder, shard["file"], entry)
            lengths, labels = shard["lengths"], shard["labels"]
            sizes_ok = (isinstance(lengths, list) and all(type(n) is int and n > 0 for n in lengths)
                        and type(shard["bytes"]) is int and sum(lengths) == shard["bytes"])
            labels_ok = (isinstance(labels, list) and len(labels) == len(lengths)
                         and all(type(y) is int and 0 <= y < len(classes) for y in labels))
            if not (sizes_ok and labels_ok):
                raise ConfigError(f"{entry} ({shard['file']}): its lengths, labels and bytes do not agree (a label per "
                                  f"image below {len(classes)}, lengths summing to bytes): rewrite it with {WRITER}")
            shard["file"] = os.path.normpath(shard["file"])


def decode_bytes(data: bytes, decoder: str, where: str, partial: bool = False):
    """RGB uint8 tensor (PIL image for pil) of encoded bytes; partial: a JPEG left for the preset to decode in part."""
    if partial and decoder == "nvimgcodec":
        if (jpeg := encoded_jpeg(data, functools.partial(decode_bytes, data, decoder, where))) is not None:
            return jpeg
    try:
        if decoder == "pil":
            with Image.open(io.BytesIO(data)) as image:
                return image.convert("RGB")
        if decoder == "nvimgcodec":
            return nvimgcodec_decode(data)
        tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if decoder == "torchcodec":
            from torchcodec.decoders import decode_image as torchcodec_decode
            return torchcodec_decode(tensor, mode="RGB")
        return decode_image(tensor, mode=ImageReadMode.RGB)
    except (OSError, RuntimeError, ValueError) as error:
        raise UnreadableImageError(f"cannot decode {where} ({str(error).strip()[:200]}); rewrite the shard set with "
                                   f"{WRITER}, or set data.on_corrupt=skip") from error


class ShardImages(Dataset):
    """(image, label) of every sample of one split's shards, by global index (shard after shard, as listed)."""

    def __init__(self, store: ShardStore, shards: list[dict[str, Any]], transform=None, *, decoder: str,
                 on_corrupt: str = "error", window: int = 4, partial: bool = False):
        self.store, self.shards, self.transform, self.partial = store, shards, transform, partial  # as DecodedImages
        self.decoder, self.on_corrupt, self.window = decoder, on_corrupt, window  # window: read by ShardOrderSampler
        self.starts = [0, *itertools.accumulate(len(shard["labels"]) for shard in shards)]
        # Each image's first byte: given for a tar's members, back to back in our shards.
        self.offsets = [shard["offsets"] if "offsets" in shard else [0, *itertools.accumulate(shard["lengths"][:-1])]
                        for shard in shards]
        self._files: dict[int, Any] = {}
        self._pid = None

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_files": {}, "_pid": None}

    def _read(self, shard: int, item: int) -> bytes:  # (bench/shards.py times it alone)
        if self._pid != os.getpid():  # file handles are per process (DataLoader workers fork)
            self._files, self._pid = {}, os.getpid()
        entry = self.shards[shard]
        if shard not in self._files:
            self._files[shard] = open(self.store.local(entry["file"], entry["bytes"], entry.get("sha256")), "rb")
        return os.pread(self._files[shard].fileno(), entry["lengths"][item], self.offsets[shard][item])

    def __getitem__(self, index: int):
        shard = bisect.bisect_right(self.starts, index) - 1
        item, entry = index - self.starts[shard], self.shards[shard]
        sample = f"key {entry['keys'][item]!r}" if entry.get("keys") else f"image {item}"  # a tar's key names it
        where = f"{self.store.location}/{entry['file']} ({sample})"
        try:  # the transform decodes a JPEG in part (nvimgcodec): a bad one is found there
            image = decode_bytes(self._read(shard, item), self.decoder, where, self.partial)
            image = self.transform(image) if self.transform is not None else image
        except UnreadableImageError as error:
            if self.on_corrupt == "error":
                raise
            worker = get_worker_info()
            logger.warning("skipped %s [%s]", error, f"worker {worker.id}" if worker else "main process")
            return None
        return image, entry["labels"][item]


class ShardOrderSampler(ResumableSampler):
    """ResumableSampler whose (seed, epoch) shuffle orders the shards, then shuffles each `window` of them together:
    each shard is read once per epoch, a window at a time."""

    def permutation(self, generator: torch.Generator) -> list[int]:
        images = self.dataset.dataset if isinstance(self.dataset, SeededSamples) else self.dataset
        shards = torch.randperm(len(images.shards), generator=generator).tolist()
        order = []
        for first in range(0, len(shards), images.window):
            members = torch.cat([torch.arange(images.starts[s], images.starts[s + 1])
                                 for s in shards[first:first + images.window]])
            order += members[torch.randperm(len(members), generator=generator)].tolist()
        return order


class ShardDataModule(ImageDataModule):
    """The classes and splits of a shard set written by make_shards.py, or of WebDataset tars (their .cls indices)."""

    train_sampler_class = ShardOrderSampler

    def __init__(self, shards: Optional[str] = None, cache_dir: Optional[str] = None, shuffle_window: PositiveInt = 4,
                 **options):
        """
        Args:
            shards: folder or s3://bucket/prefix written by python -m classifier_engine.data.make_shards, or of
                WebDataset tars (<set>-train-0000.tar, <set>-validation-0000.tar); the object store's endpoint and
                keys come from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (never from the config).
            cache_dir: node-local folder with room for the whole set, for s3:// shards and WebDataset tars' indexes
                (default: shards/ in the library's cache, $CLASSIFIER_ENGINE_CACHE).
            shuffle_window: shards whose images are shuffled together (more: a better shuffle, more open shards).
            **options: the options every image data module has (classifier_engine.data.image_data.ImageDataModule).
        """
        super().__init__(**options)
        if shards is None:
            raise ConfigError(f"data.shards is not set: pass --data.shards DIR or s3://bucket/prefix (written by "
                              f"{WRITER})")
        if self.decoder in DEVICE_DECODERS:
            raise ConfigError(f"data.decoder={self.decoder}: shards decode in the DataLoader workers: choose auto, "
                              "torchvision, torchcodec or pil")
        self.store = ShardStore(shards, cache_dir)
        try:  # now, not in setup(): the CLI links num_classes into the model
            self.index = self.store.read_index()
        except MissingIndex:  # a location of WebDataset tars (tar_shards.py), if it holds some
            if (tars := tar_index(self.store, self.store.listing())) is None:
                raise
            self.index = tars
        self.class_names = list(self.index["classes"])
        self.num_classes = len(self.class_names)
        self.class_labels = list(self.index.get("class_labels") or self.class_names)
        self.shuffle_window = shuffle_window

    def _images(self, split: str, transform) -> ShardImages:  # the base's setup builds the splits from these
        shards = self.index["splits"].get(split) or self.index["splits"]["val"]  # no test split: test on val
        return ShardImages(self.store, shards, transform, decoder=self.decoder, on_corrupt=self.hparams.on_corrupt,
                           window=self.shuffle_window, partial=self._in_part(split, transform))

    def predict_images(self) -> list[Path]:
        raise ConfigError("predict with shards reads a folder of images: pass --data.predict_root DIR")
