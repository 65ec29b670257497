"""ManifestDataModule: the embedded digits listed in CSV / JSON Lines manifests train, predict and export; a val split
lacking a class, in another order, is labelled by name; a bad manifest is one line before anything is written.

    python -m pytest tests/test_manifest.py
"""

import csv
import json
import os
import shutil
from pathlib import Path

import pytest

from classifier_engine import ManifestDataModule
from classifier_engine.data.embedded import resolve_root
from classifier_engine.errors import ConfigError
from classifier_engine.export import main as export_main
from conftest import QUICKSTART, SHRINK, project_in_process

# Class names whose sorted order is not the digits' order: a label mapped by position would show.
NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
MANIFEST = "classifier_engine.data.ManifestDataModule"


def write_manifest(path: Path, rows: list[tuple[str, str]], columns=("path", "label")) -> Path:
    """rows of (image path, label), the paths written relative to the manifest; CSV, or JSON Lines for .jsonl. An image
    outside the manifest's folder is copied into it first (a manifest names files inside its folder only)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [(os.path.relpath(_beside(Path(image), path.parent), path.parent) if os.path.isfile(image) else image, label)
            for image, label in rows]
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(dict(zip(columns, row))) + "\n" for row in rows))
    else:
        with open(path, "w", newline="") as file:
            csv.writer(file).writerows([columns, *rows])
    return path


def _beside(image: Path, folder: Path) -> Path:
    if folder.resolve() in image.resolve().parents:
        return image
    copy = folder / "images" / image.parent.parent.name / image.parent.name / image.name  # images/val/3/0001.jpg
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(image, copy)
    return copy


def digits(split: str, per_class: int, skip: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(image, class name) of the first `per_class` digits of each class of the embedded split, classes reversed."""
    root = resolve_root("embedded:digits") / split
    return [(str(image), NAMES[int(digit)]) for digit in sorted(os.listdir(root), reverse=True)
            if NAMES[int(digit)] not in skip for image in sorted((root / digit).iterdir())[:per_class]]


@pytest.fixture(scope="module")
def manifests(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("manifests")
    return {"train": write_manifest(folder / "lists" / "train.csv", digits("train", 4)),
            "val": write_manifest(folder / "val.jsonl", digits("val", 3, skip=("three",)))}


def manifest_args(run_dir: Path, train: Path, val: Path, *extra: str) -> list[str]:
    return ["--config", str(QUICKSTART), *SHRINK, f"--data.class_path={MANIFEST}", f"--data.train_manifest={train}",
            f"--data.val_manifest={val}", f"--trainer.default_root_dir={run_dir}", *extra]


def test_a_val_split_lacking_a_class_in_another_order_is_labelled_by_name(manifests):
    data = ManifestDataModule(train_manifest=str(manifests["train"]), val_manifest=str(manifests["val"]),
                              batch_size=4, num_workers=0, pin_memory=False)
    assert data.class_names == sorted(NAMES) and data.num_classes == 10
    data.setup("validate")
    labels = {Path(path).relative_to(manifests["val"].parent / "images").as_posix(): label
              for path, label in data.datasets["val"].samples}
    assert len(labels) == 27 and not any(path.startswith("val/3/") for path in labels)
    seven, zero = (min(p for p in labels if p.startswith(f"val/{digit}/")) for digit in (7, 0))
    assert data.class_names[labels[seven]] == "seven" and labels[seven] == 5  # eight five four nine one SEVEN
    assert data.class_names[labels[zero]] == "zero" and labels[zero] == 9
    assert data.eval_preprocessing().crop == 224 and data.image_sizes()["data.train_crop_size"] == 224


def test_a_manifest_saved_by_excel_with_a_byte_order_mark_is_read(manifests):
    # Excel's "CSV UTF-8" starts the file with U+FEFF, which csv reads into the first column's name.
    for name in ("train.csv", "val.jsonl"):
        with_bom = manifests["train" if name.endswith("csv") else "val"].with_name(f"bom_{name}")
        with_bom.write_bytes(b"\xef\xbb\xbf" + with_bom.with_name(name).read_bytes())
    data = ManifestDataModule(train_manifest=str(manifests["train"].with_name("bom_train.csv")),
                              val_manifest=str(manifests["val"].with_name("bom_val.jsonl")), batch_size=4)
    assert data.class_names == sorted(NAMES) and len(data.samples("train")) == 40 and len(data.samples("val")) == 27


def test_a_manifest_trains_predicts_and_exports(manifests, tmp_path, monkeypatch, capsys):
    run = tmp_path / "runs"
    code, _, err = project_in_process(["fit", *manifest_args(run, manifests["train"], manifests["val"])],
                                      monkeypatch, capsys)
    assert code == 0, err[-3000:]
    checkpoint = run / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    predictions = tmp_path / "predictions.csv"
    code, _, err = project_in_process(["predict", *manifest_args(run, manifests["train"], manifests["val"]),
                                       f"--ckpt_path={checkpoint}", f"--predictions.output={predictions}"],
                                      monkeypatch, capsys)
    assert code == 0, err[-3000:]
    rows = list(csv.reader(predictions.open()))
    assert len(rows) == 1 + 27 and {row[1] for row in rows[1:]} <= set(NAMES)  # the val manifest's images, by name
    exported = export_main(["--ckpt_path", str(checkpoint), "--no-onnx"])
    meta = json.loads(next(path for path in exported.values() if Path(path).name == "model.json").read_text())
    assert meta["class_names"] == sorted(NAMES)
    assert meta["preprocessing"]["crop"] == 32 and meta["preprocessing"]["mean"] == [0.485, 0.456, 0.406]


def write_bytes(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


# (what is wrong, how the manifest is written, the text of the one line)
BAD = {
    "missing file": (lambda d: d / "nowhere.csv", "data.val_manifest: {val} does not exist"),
    "unknown column": (lambda d: write_manifest(d / "val.csv", digits("val", 1), ("path", "class")),
                       "manifest {val}: its header has the columns ['path', 'class'], expected exactly path, label"),
    "missing column": (lambda d: write_manifest(d / "val.jsonl", [(p, "x") for p, _ in digits("val", 1)], ("path",)),
                       "manifest {val}: line 1 has the columns ['path'], expected exactly path, label"),
    "label absent from train": (lambda d: write_manifest(d / "val.csv", [*digits("val", 1), ("x.jpg", "ten")]),
                                "data.val_manifest: label(s) ['ten'] are not in the train manifest"),
    "empty split": (lambda d: write_manifest(d / "val.csv", []), "manifest {val} lists no images (data.val_manifest)"),
    "duplicated path": (lambda d: write_manifest(d / "val.csv", digits("val", 2)[:1] * 2),
                        "is listed twice (lines 2 and 3): list each image once"),
    "not UTF-8 (Excel's cp1252)": (lambda d: write_bytes(d / "val.csv", b"path,label\n" + b"".join(
        b"a%d.png,one\n" % k for k in range(2000)) + b"caf\xe9.jpg,one\n"),  # past the reader's first chunk
                                   "manifest {val}: not UTF-8 text (invalid continuation byte on line 2002): save it "
                                   "as UTF-8 (Excel: CSV UTF-8)"),
    "a device outside": (lambda d: write_manifest(d / "val.csv", [("/dev/zero", "one")]),
                         "manifest {val}, line 2: '/dev/zero' names a file outside"),
    "a file outside": (lambda d: write_manifest(d / "val.jsonl", [("../../elsewhere/a.png", "one")]),
                       "manifest {val}, line 1: '../../elsewhere/a.png' names a file outside"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_manifest_is_one_line_and_nothing_is_written(case, manifests, tmp_path, monkeypatch, capsys):
    make, expected = BAD[case]
    val = make(tmp_path / "bad")
    run = tmp_path / "runs"
    code, _, err = project_in_process(["fit", *manifest_args(run, manifests["train"], val)], monkeypatch, capsys)
    assert code == 2, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert expected.format(val=val) in line and len(line) < 400, line
    assert not run.exists()
    with pytest.raises(ConfigError, match="data.train_manifest and data.val_manifest not set"):
        ManifestDataModule()
