"""Turn the three official ILSVRC2012 archives into the train/<wnid>/ and val/<wnid>/ layout the data module reads.

    python -m tools.prepare_imagenet --archives ~/Downloads/ilsvrc2012 --out /datasets/imagenet

Reads ILSVRC2012_img_train.tar (a tar of 1,000 per-class tars), ILSVRC2012_img_val.tar (50,000 flat files) and
ILSVRC2012_devkit_t12.tar.gz (meta.mat + validation ground truth). Each class tar is streamed straight into its
folder (never unpacked to disk first, so no 2x space) and renamed into place when whole: a rerun after an interruption
skips finished classes and val files. Writes ROOT/class_index.json (index -> wnid -> human name, index = the sorted
folder position the data module uses) and torchvision's ROOT/meta.bin, so torchvision.datasets.ImageNet(ROOT) works too.
"""

import argparse
import errno
import functools
import io
import json
import os
import re
import shutil
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from classifier_engine.data.layout import CLASS_INDEX_FILE
from classifier_engine.errors import DiskFullError
from classifier_engine.storage.files import atomic_write, remove_stale_partials
from torchvision.datasets.imagenet import ARCHIVE_META, META_FILE
from torchvision.datasets.utils import check_integrity

TRAIN_IMAGES, VAL_IMAGES, NUM_CLASSES = 1_281_167, 50_000, 1_000
DEVKIT_DATA = "ILSVRC2012_devkit_t12/data"
VAL_NAME = re.compile(r"ILSVRC2012_val_(\d{8})\.JPEG")
DOWNLOAD = "https://image-net.org/challenges/LSVRC/2012/2012-downloads.php (free account needed)"
# Class folders are staged inside ROOT (same filesystem: the final rename is atomic) but outside train/, whose
# sub-folders ImageFolder would take for classes. Files (val images, the index) are written by atomic_write.
PARTIAL = ".prepare_partial"
DISK_FULL_FIX = "Free space or pass another --out, then rerun: finished classes are kept"


class PrepareError(RuntimeError):
    """An archive is missing, truncated or inconsistent, or the output disk is full; the message names the fix."""


@dataclass
class Devkit:
    wnids: list[str]  # the 1,000 classes, sorted: list position = class index (ImageFolder's sorted folders)
    words: dict[str, str]  # wnid -> "tench, Tinca tinca"
    val_wnids: list[str]  # ground truth: val_wnids[k - 1] is the class of ILSVRC2012_val_<k>.JPEG


def log(message: str) -> None:
    print(f"prepare_imagenet: {message}", flush=True)


def archive_paths(archives: Path) -> dict[str, Path]:
    paths = {split: archives / name for split, (name, _md5) in ARCHIVE_META.items()}
    missing = [p.name for p in paths.values() if not p.is_file()]
    if missing:
        raise PrepareError(
            f"{archives} lacks {', '.join(missing)}; expected the three ILSVRC2012 archives "
            f"({', '.join(p.name for p in paths.values())}) there. Download them from {DOWNLOAD} or pass "
            "--archives DIR."
        )
    return paths


def verify_md5(paths: dict[str, Path]) -> None:
    for split, path in paths.items():
        log(f"checking the md5 of {path.name} ...")
        if not check_integrity(str(path), ARCHIVE_META[split][1]):
            raise PrepareError(f"{path} does not have the official md5 {ARCHIVE_META[split][1]}: it is truncated or "
                               f"not the ILSVRC2012 file. Download it again from {DOWNLOAD}.")


def read_devkit(path: Path) -> Devkit:
    """torchvision's parse_devkit_archive parsing (leaf synsets of meta.mat, ground-truth ids), read in place."""
    import scipy.io  # installed with scikit-learn; only preparation needs it

    try:
        with tarfile.open(path, "r:gz") as tar:
            meta = io.BytesIO(tar.extractfile(f"{DEVKIT_DATA}/meta.mat").read())
            truth = tar.extractfile(f"{DEVKIT_DATA}/ILSVRC2012_validation_ground_truth.txt").read().decode()
    except KeyError as missing:
        raise PrepareError(f"{path} has no {missing}: not the ILSVRC2012 devkit ({ARCHIVE_META['devkit'][0]} "
                           f"from {DOWNLOAD})") from None
    except (tarfile.TarError, EOFError, OSError) as error:
        raise PrepareError(f"{path} is truncated or corrupt ({error}); download it again from {DOWNLOAD}") from error
    synsets = scipy.io.loadmat(meta, squeeze_me=True)["synsets"]
    leaves = [s for s in synsets if int(s["num_children"]) == 0]
    id_to_wnid = {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in leaves}
    words = {str(s["WNID"]): str(s["words"]) for s in leaves}
    try:
        val_wnids = [id_to_wnid[int(line)] for line in truth.split()]
    except KeyError as bad_id:
        raise PrepareError(f"{path}: ground truth names class id {bad_id}, which meta.mat does not define; "
                           "the devkit is inconsistent, download it again") from None
    return Devkit(sorted(words), words, val_wnids)


def write_class_index(root: Path, devkit: Devkit) -> None:
    entries = [{"index": i, "wnid": w, "name": devkit.words[w].split(", ")[0], "words": devkit.words[w]}
               for i, w in enumerate(devkit.wnids)]
    atomic_write(root / CLASS_INDEX_FILE, lambda file: file.write(json.dumps(entries, indent=1)), mode="w",
                 fix=DISK_FULL_FIX)
    # torchvision's meta file format, so torchvision.datasets.ImageNet(root) reads this folder without its archives.
    meta = ({w: tuple(devkit.words[w].split(", ")) for w in devkit.wnids}, devkit.val_wnids)
    atomic_write(root / META_FILE, lambda file: torch.save(meta, file), fix=DISK_FULL_FIX)


def check_space(root: Path, needed: int) -> None:
    free = shutil.disk_usage(root).free
    if free < needed:
        raise PrepareError(f"{root} has {free / 1e9:.2f} GB free but the images still to write need "
                           f"{needed / 1e9:.2f} GB: "
                           "free some space or pass another --out, then rerun (finished classes are kept)")


def copy_member(source, dest: Path) -> None:
    with open(dest, "wb") as out:
        shutil.copyfileobj(source, out, length=1 << 20)


def extract_class(train_tar: Path, member: tarfile.TarInfo, root: Path) -> int:
    """Stream one class tar from inside the train archive into train/<wnid>/, renamed into place when whole."""
    wnid = member.name[: -len(".tar")]
    staging = root / PARTIAL / "train" / wnid
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    count = 0
    with tarfile.open(train_tar, "r:") as outer, tarfile.open(fileobj=outer.extractfile(member), mode="r|") as inner:
        for image in inner:
            if image.isfile():
                copy_member(inner.extractfile(image), staging / os.path.basename(image.name))
                count += 1
    os.replace(staging, root / "train" / wnid)
    return count


def list_class_tars(train_tar: Path) -> tuple[list[tarfile.TarInfo], bool]:
    """The class tars whose bytes are all present, and whether the archive is cut short (a partial download)."""
    members, truncated = [], False
    try:
        with tarfile.open(train_tar, "r:") as outer:
            for member in outer:
                members.append(member)
    except tarfile.ReadError as error:
        if not members:
            raise PrepareError(f"cannot read {train_tar} ({error}): truncated or not a tar; download it again "
                               f"from {DOWNLOAD}") from error
        truncated = True
    size = train_tar.stat().st_size
    whole = [m for m in members if m.isfile() and m.name.endswith(".tar") and m.offset_data + m.size <= size]
    return whole, truncated or len(whole) < sum(m.isfile() for m in members)


def prepare_train(train_tar: Path, root: Path, devkit: Devkit, workers: int) -> None:
    members, truncated = list_class_tars(train_tar)
    unknown = sorted({m.name[:-4] for m in members} - set(devkit.wnids))
    if unknown:
        raise PrepareError(f"{train_tar} holds classes the devkit does not define "
                           f"({', '.join(unknown[:5])}...): the devkit "
                           f"does not match the train archive; use the ILSVRC2012 pair ({ARCHIVE_META['devkit'][0]})")
    (root / "train").mkdir(parents=True, exist_ok=True)
    todo = [m for m in members if not (root / "train" / m.name[:-4]).is_dir()]
    log(f"train: {len(members) - len(todo)} of {len(members)} classes already done, {len(todo)} to extract")
    check_space(root, sum(m.size for m in todo))
    start, done = time.monotonic(), 0
    # Threads, not processes: the work is file I/O, which releases the GIL.
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(extract_class, train_tar, m, root): m for m in todo}
        try:
            for future, member in futures.items():
                try:
                    future.result()
                except tarfile.TarError as error:
                    raise PrepareError(f"{train_tar} is truncated or corrupt at {member.name} ({error}); download it "
                                       f"again from {DOWNLOAD} (--verify-md5 checks it) and rerun: finished "
                                       "classes are kept") from error
                done += 1
                if done % 50 == 0 or done == len(todo):
                    rate = done / (time.monotonic() - start)
                    log(f"train: {done}/{len(todo)} classes, {(len(todo) - done) / rate / 60:.1f} min left")
        except BaseException:  # a full disk, a bad member, Ctrl-C: classes not yet started never start
            pool.shutdown(cancel_futures=True)
            raise
    if truncated:
        raise PrepareError(f"{train_tar} ends after {len(members)} whole class tars (ILSVRC2012 has "
                           f"{NUM_CLASSES}): it is "
                           f"truncated; download it again from {DOWNLOAD} and rerun: the finished classes are kept")


def prepare_val(val_tar: Path, root: Path, devkit: Devkit) -> None:
    for wnid in set(devkit.val_wnids):
        (root / "val" / wnid).mkdir(parents=True, exist_ok=True)
        remove_stale_partials(root / "val" / wnid)  # temp files of writes a killed run on this host left
    written = kept = 0
    current = val_tar.name
    try:
        with tarfile.open(val_tar, "r:") as tar:
            for member in tar:
                current = member.name
                if not member.isfile():
                    continue
                match = VAL_NAME.fullmatch(os.path.basename(member.name))
                if match is None:
                    raise PrepareError(f"{val_tar} holds {member.name}, expected ILSVRC2012_val_NNNNNNNN.JPEG "
                                       "files only: "
                                       f"is this {ARCHIVE_META['val'][0]}?")
                number = int(match.group(1))
                if not 1 <= number <= len(devkit.val_wnids):
                    raise PrepareError(f"{val_tar}: {member.name} has no ground truth (the devkit lists "
                                       f"{len(devkit.val_wnids)} val images): the devkit does not match the val "
                                       "archive")
                dest = root / "val" / devkit.val_wnids[number - 1] / match.group(0)
                if dest.is_file() and dest.stat().st_size == member.size:
                    kept += 1
                    continue
                check_space(root, member.size)
                source = tar.extractfile(member)
                # No fsync: 50,000 small files, and a rerun rewrites any that a crash cut short.
                atomic_write(dest, functools.partial(shutil.copyfileobj, source, length=1 << 20), fsync=False,
                             fix=DISK_FULL_FIX)
                written += 1
    except (tarfile.TarError, EOFError) as error:
        raise PrepareError(f"{val_tar} is truncated or corrupt at {current} ({error}); download it again "
                           f"from {DOWNLOAD} "
                           "and rerun: val files already written are kept") from error
    log(f"val: {written} files written, {kept} already there")


def count_report(root: Path, devkit: Devkit, expect_train: int, expect_val: int, expect_classes: int) -> list[str]:
    """What is missing against the expected counts; empty when everything is there."""
    def count(split: str, wnid: str) -> int:
        folder = root / split / wnid
        # A hidden name is an unfinished write's temp file (atomic_write's), never an image.
        if not folder.is_dir():
            return 0
        return sum(1 for e in os.scandir(folder) if e.is_file() and not e.name.startswith("."))

    train = {w: count("train", w) for w in devkit.wnids}
    val = {w: count("val", w) for w in devkit.wnids}
    expected_val = {w: 0 for w in devkit.wnids}
    for w in devkit.val_wnids:
        expected_val[w] += 1
    problems = []
    if len(devkit.wnids) != expect_classes:
        problems.append(f"the devkit defines {len(devkit.wnids)} classes, expected {expect_classes}")
    no_train = [w for w, n in train.items() if n == 0]
    if no_train:
        problems.append(f"{len(no_train)} classes have no train images: "
                        + ", ".join(f"{w} ({devkit.words[w].split(', ')[0]})" for w in no_train[:10]))
    if sum(train.values()) != expect_train:
        problems.append(f"train holds {sum(train.values()):,} images, expected {expect_train:,}")
    short = [w for w in devkit.wnids if val[w] < expected_val[w]]
    if short:
        problems.append(f"{len(short)} classes miss val images: "
                        + ", ".join(f"{w} ({val[w]}/{expected_val[w]})" for w in short[:10]))
    if sum(val.values()) != expect_val:
        problems.append(f"val holds {sum(val.values()):,} images, expected {expect_val:,}")
    return problems


def prepare(archives: Path, root: Path, *, expect_train: int = TRAIN_IMAGES, expect_val: int = VAL_IMAGES,
            expect_classes: int = NUM_CLASSES, workers: int = 4, md5: bool = False) -> list[str]:
    """Prepare ROOT from the archives in ARCHIVES; returns the count problems (empty: complete)."""
    paths = archive_paths(archives)
    if md5:
        verify_md5(paths)
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(root / PARTIAL, ignore_errors=True)  # leftovers of an interrupted run; never finished data
    devkit = read_devkit(paths["devkit"])
    log(f"devkit: {len(devkit.wnids)} classes, {len(devkit.val_wnids):,} val labels")
    try:
        write_class_index(root, devkit)
        prepare_train(paths["train"], root, devkit, workers)
        prepare_val(paths["val"], root, devkit)
    except DiskFullError as full:  # atomic_write's: the file it names is as it was
        raise PrepareError(str(full)) from full
    except OSError as error:
        if error.errno == errno.ENOSPC:
            raise PrepareError(f"the disk of {root} is full ({error}); free space or pass another --out, then rerun: "
                               "finished classes are kept") from error
        raise
    shutil.rmtree(root / PARTIAL, ignore_errors=True)
    return count_report(root, devkit, expect_train, expect_val, expect_classes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.prepare_imagenet", description=__doc__.split("\n")[0])
    parser.add_argument("--archives", type=Path, required=True, help="folder holding the three ILSVRC2012 archives")
    parser.add_argument("--out", type=Path, required=True,
                        help="data root to fill: ROOT/train/<wnid>/, ROOT/val/<wnid>/")
    parser.add_argument("--workers", type=int, default=4, help="classes extracted in parallel (I/O bound)")
    parser.add_argument("--verify-md5", action="store_true",
                        help="check the archives' official md5 first (reads ~150 GB)")
    parser.add_argument("--expect-train", type=int, default=TRAIN_IMAGES, help="expected train images")
    parser.add_argument("--expect-val", type=int, default=VAL_IMAGES, help="expected val images")
    parser.add_argument("--expect-classes", type=int, default=NUM_CLASSES, help="expected classes")
    args = parser.parse_args(argv)
    try:
        problems = prepare(args.archives.expanduser(), args.out.expanduser(), expect_train=args.expect_train,
                           expect_val=args.expect_val, expect_classes=args.expect_classes, workers=args.workers,
                           md5=args.verify_md5)
    except PrepareError as error:
        print(f"prepare_imagenet: error: {error}", file=sys.stderr)
        return 2
    if problems:
        print("prepare_imagenet: incomplete:\n  " + "\n  ".join(problems), file=sys.stderr)
        print("prepare_imagenet: check the archives (--verify-md5), then rerun the same command to continue",
              file=sys.stderr)
        return 1
    log(f"done: {args.out} is complete (--data.root {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
