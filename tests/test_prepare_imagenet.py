"""prepare_imagenet on miniature ILSVRC2012 archives with the real structure: tar of class tars, flat val tar, devkit.

    python -m pytest tests/test_prepare_imagenet.py
"""

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import scipy.io
from PIL import Image

from conftest import skip_if_deleted

skip_if_deleted("tools/prepare_imagenet.py")
from tools.prepare_imagenet import main  # noqa: E402  (the module a user may delete)

REPO = Path(__file__).resolve().parents[1]  # the template
# Devkit ids deliberately not in wnid order: the class index must follow the sorted folders, not the devkit ids.
CLASSES = {  # wnid: (devkit id, words, train images)
    "n02119789": (1, "kit fox, Vulpes macrotis", 5),
    "n01440764": (2, "tench, Tinca tinca", 4),
    "n03126707": (3, "crane", 3),
    "n02012849": (4, "crane", 2),  # ImageNet really has two "crane"s: names are labels, wnids are keys
}
VAL_IDS = [2, 1, 1, 3, 4, 2, 1, 3, 4, 2, 1]  # ground truth, line k = class of ILSVRC2012_val_<k>.JPEG
COUNTS = ["--expect-train", "14", "--expect-val", "11", "--expect-classes", "4"]


def jpeg_bytes(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (12, 16, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_devkit(path: Path, classes: dict, val_ids: list[int]) -> None:
    fields = ["ILSVRC2012_ID", "WNID", "words", "gloss", "num_children", "children", "wordnet_height",
              "num_train_images"]
    synsets = np.zeros((len(classes) + 1,), dtype=[(f, "O") for f in fields])
    for row, (wnid, (ident, words, n_train)) in enumerate(classes.items()):
        synsets[row] = (ident, wnid, words, "a gloss", 0, np.zeros(0), 0, n_train)
    # A non-leaf synset, as in the real meta.mat (1,860 synsets, 1,000 leaves): it is not a class.
    synsets[-1] = (len(classes) + 1, "n00001740", "entity", "root", 2, np.array([1, 2]), 19, 0)
    meta = io.BytesIO()
    scipy.io.savemat(meta, {"synsets": synsets})
    truth = "".join(f"{i}\n" for i in val_ids).encode()
    with tarfile.open(path, "w:gz") as tar:
        add_bytes(tar, "ILSVRC2012_devkit_t12/data/meta.mat", meta.getvalue())
        add_bytes(tar, "ILSVRC2012_devkit_t12/data/ILSVRC2012_validation_ground_truth.txt", truth)
        add_bytes(tar, "ILSVRC2012_devkit_t12/readme.txt", b"miniature devkit\n")


def write_archives(folder: Path, classes: dict = CLASSES, val_ids: list[int] = VAL_IDS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(folder / "ILSVRC2012_img_train.tar", "w") as outer:
        for wnid, (_ident, _words, n_train) in classes.items():
            inner = io.BytesIO()
            with tarfile.open(fileobj=inner, mode="w") as tar:
                for k in range(n_train):
                    add_bytes(tar, f"{wnid}_{k}.JPEG", jpeg_bytes(zlib.crc32(f"{wnid}_{k}".encode())))
            add_bytes(outer, f"{wnid}.tar", inner.getvalue())
    with tarfile.open(folder / "ILSVRC2012_img_val.tar", "w") as tar:
        for k in range(1, len(val_ids) + 1):
            add_bytes(tar, f"ILSVRC2012_val_{k:08d}.JPEG", jpeg_bytes(k))
    write_devkit(folder / "ILSVRC2012_devkit_t12.tar.gz", classes, val_ids)
    return folder


@pytest.fixture(scope="module")
def archives(tmp_path_factory) -> Path:
    return write_archives(tmp_path_factory.mktemp("ilsvrc2012"))


def files_in(folder: Path) -> dict[str, int]:
    return {d.name: len(list(d.iterdir())) for d in sorted(folder.iterdir())}


@pytest.mark.slow  # another process
def test_cli_builds_the_layout_the_mapping_and_checks_counts(archives, tmp_path, capsys):
    root = tmp_path / "imagenet"
    command = [sys.executable, "-m", "tools.prepare_imagenet", "--archives", str(archives), "--out", str(root)]
    # Real ImageNet counts by default: the miniature set must be reported as incomplete, saying what is missing.
    first = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert first.returncode == 1, first.stderr
    assert "train holds 14 images, expected 1,281,167" in first.stderr
    assert "val holds 11 images, expected 50,000" in first.stderr
    assert "the devkit defines 4 classes, expected 1000" in first.stderr

    assert main(["--archives", str(archives), "--out", str(root), *COUNTS]) == 0  # in-process: saves ~8 s of imports
    assert "4 of 4 classes already done, 0 to extract" in capsys.readouterr().out  # the first run's classes were kept
    assert files_in(root / "train") == {w: n for w, (_i, _words, n) in sorted(CLASSES.items())}
    by_id = {ident: wnid for wnid, (ident, _words, _n) in CLASSES.items()}
    expected_val: dict[str, int] = {}
    for k, ident in enumerate(VAL_IDS, start=1):
        expected_val[by_id[ident]] = expected_val.get(by_id[ident], 0) + 1
        # Bytes unchanged: each val file lands in the folder its ground-truth line names.
        assert (root / "val" / by_id[ident] / f"ILSVRC2012_val_{k:08d}.JPEG").read_bytes() == jpeg_bytes(k)
    assert files_in(root / "val") == dict(sorted(expected_val.items()))
    assert not (root / ".prepare_partial").exists()

    index = json.loads((root / "class_index.json").read_text())
    assert [e["wnid"] for e in index] == sorted(CLASSES)  # index = sorted folder position, as ImageFolder numbers them
    assert [e["index"] for e in index] == [0, 1, 2, 3]
    assert [e["name"] for e in index] == ["tench", "crane", "kit fox", "crane"]
    assert index[2]["words"] == "kit fox, Vulpes macrotis"


def test_torchvision_imagenet_reads_the_prepared_folder(archives, tmp_path):
    from torchvision.datasets import ImageNet

    root = tmp_path / "imagenet"
    assert main(["--archives", str(archives), "--out", str(root), *COUNTS]) == 0
    val = ImageNet(str(root), split="val")  # torchvision's own meta.bin reader: no archives needed in ROOT
    assert val.wnids == sorted(CLASSES)
    assert val.classes[0] == ("tench", "Tinca tinca")
    assert len(val) == len(VAL_IDS)


def test_data_module_exposes_human_names_and_keeps_wnids_as_class_names(archives, tmp_path, tiny_root):
    from project.data import ImageNetDataModule

    root = tmp_path / "imagenet"
    assert main(["--archives", str(archives), "--out", str(root), *COUNTS]) == 0
    module = ImageNetDataModule(str(root), num_workers=0)
    assert module.class_names == sorted(CLASSES) and module.num_classes == 4
    assert module.class_labels == ["tench", "crane", "kit fox", "crane"]
    # no class_index.json
    assert ImageNetDataModule(str(tiny_root), num_workers=0).class_labels == ["cat", "dog", "fox"]


def test_truncated_train_archive_names_the_file_and_a_rerun_resumes(archives, tmp_path, capsys):
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in ("ILSVRC2012_img_val.tar", "ILSVRC2012_devkit_t12.tar.gz"):
        os.symlink(archives / name, partial / name)
    data = (archives / "ILSVRC2012_img_train.tar").read_bytes()
    # Cut inside the third class tar, as an interrupted download would.
    with tarfile.open(archives / "ILSVRC2012_img_train.tar") as tar:
        third = tar.getmembers()[2]
    (partial / "ILSVRC2012_img_train.tar").write_bytes(data[: third.offset_data + third.size // 2])
    root = tmp_path / "imagenet"

    assert main(["--archives", str(partial), "--out", str(root), *COUNTS]) == 2
    err = capsys.readouterr().err
    assert f"{partial / 'ILSVRC2012_img_train.tar'} ends after 2 whole class tars" in err and "truncated" in err
    done = sorted(d.name for d in (root / "train").iterdir())
    assert done == sorted(list(CLASSES)[:2])  # whole classes extracted, the cut one left out
    stamp = {w: (root / "train" / w).stat().st_ino for w in done}

    (partial / "ILSVRC2012_img_train.tar").write_bytes(data)  # the re-downloaded archive
    assert main(["--archives", str(partial), "--out", str(root), *COUNTS]) == 0
    assert "2 of 4 classes already done, 2 to extract" in capsys.readouterr().out
    assert {w: (root / "train" / w).stat().st_ino for w in done} == stamp  # finished classes were not redone
    assert sum(files_in(root / "train").values()) == 14


def test_corrupt_class_tar_is_named_and_the_other_classes_are_kept(archives, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("ILSVRC2012_img_val.tar", "ILSVRC2012_devkit_t12.tar.gz"):
        os.symlink(archives / name, broken / name)
    data = bytearray((archives / "ILSVRC2012_img_train.tar").read_bytes())
    with tarfile.open(archives / "ILSVRC2012_img_train.tar") as tar:
        second = tar.getmembers()[1]
    data[second.offset_data : second.offset_data + 512] = b"\x5a" * 512  # the class tar's first header: garbage
    (broken / "ILSVRC2012_img_train.tar").write_bytes(data)
    root = tmp_path / "imagenet"
    assert main(["--archives", str(broken), "--out", str(root), "--workers", "1", *COUNTS]) == 2
    assert f"is truncated or corrupt at {second.name}" in capsys.readouterr().err
    assert not (root / "train" / second.name[:-4]).exists()  # never a half-written class folder
    assert (root / "train" / list(CLASSES)[0]).is_dir()


def test_missing_archive_is_named_with_where_to_get_it(archives, tmp_path, capsys):
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    os.symlink(archives / "ILSVRC2012_img_train.tar", incomplete / "ILSVRC2012_img_train.tar")
    assert main(["--archives", str(incomplete), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "lacks ILSVRC2012_img_val.tar, ILSVRC2012_devkit_t12.tar.gz" in err and "image-net.org" in err
    assert not (tmp_path / "out").exists()


def test_devkit_that_does_not_match_the_train_archive_is_an_error(tmp_path, capsys):
    archives = write_archives(tmp_path / "archives")
    other = {"n09999999": (1, "not an imagenet class", 1), **{w: v for w, v in CLASSES.items() if v[0] != 1}}
    write_devkit(archives / "ILSVRC2012_devkit_t12.tar.gz", other, VAL_IDS)
    assert main(["--archives", str(archives), "--out", str(tmp_path / "out")]) == 2
    assert "n02119789" in (err := capsys.readouterr().err) and "devkit does not match the train archive" in err


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs: a real full disk. Needs root (mount); skipped elsewhere."""
    mount = tmp_path / "small_disk"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_output_disk_too_small_is_reported_before_writing_images(tmp_path, small_disk, capsys):
    big = {w: (ident, words, 40) for w, (ident, words, _n) in CLASSES.items()}  # ~160 KiB of train images
    archives = write_archives(tmp_path / "archives", big)
    assert main(["--archives", str(archives), "--out", str(small_disk / "imagenet")]) == 2
    err = capsys.readouterr().err
    assert f"{small_disk / 'imagenet'} has 0.00 GB free" in err and "rerun" in err
    assert not any((small_disk / "imagenet" / "train").iterdir())


def test_a_val_file_cut_short_by_a_killed_run_is_never_counted_and_a_rerun_completes_it(archives, tmp_path):
    from classifier_engine.storage.files import partial_path

    root = tmp_path / "imagenet"
    assert main(["--archives", str(archives), "--out", str(root), *COUNTS]) == 0
    dest = next((root / "val").rglob("ILSVRC2012_val_00000001.JPEG"))
    # What kill -9 during its copy leaves: no file under the real name, half of it under the writer's temp name.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    temp = partial_path(dest).with_name(partial_path(dest).name.replace(f"-{os.getpid()}.", f"-{dead.stdout.strip()}."))
    temp.write_bytes(dest.read_bytes()[:100])
    dest.unlink()
    assert main(["--archives", str(archives), "--out", str(root), *COUNTS]) == 0
    assert dest.read_bytes() == jpeg_bytes(1) and not temp.exists()
    assert sum(files_in(root / "val").values()) == len(VAL_IDS)
