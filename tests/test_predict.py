"""`python -m project predict` writes one CSV: path, top-k class names and probabilities, in sorted path order.

    python -m pytest tests/test_predict.py --durations=0
"""

import csv
import os
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import run_project, tiny_args

from project import ImageClassifier, cli_main
from project.data.decoders import image_loader
from project.data.predict import ImagePathDataset, list_images
from project.data.transforms import eval_preset


def read_csv(path: Path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def in_process(args: list[str]) -> None:
    # The CLI seeds and sets PL_GLOBAL_SEED; keep that out of the environment of the tests that follow.
    with mock.patch.dict(os.environ):
        cli_main(args)


@pytest.fixture(scope="module")
def checkpoint(tiny_root, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("predict_fit")
    in_process(["fit", *tiny_args(tiny_root, run_dir)])
    return run_dir / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def image_folder(tiny_root, tmp_path_factory) -> Path:
    """The 17 val images at two depths, one with an upper-case extension, beside files predict must skip."""
    folder = tmp_path_factory.mktemp("to_predict")
    shutil.copytree(tiny_root / "val", folder / "nested")
    for source in sorted((tiny_root / "val" / "fox").glob("*.jpg"))[:2]:
        shutil.move(folder / "nested" / "fox" / source.name, folder / source.name.upper())
    (folder / "notes.txt").write_text("not an image")
    (folder / ".thumbnails").mkdir()
    shutil.copy(source, folder / ".thumbnails" / "hidden.jpg")
    return folder


@pytest.fixture(scope="module")
def single_process_csv(tiny_root, checkpoint, image_folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("predict_single") / "predictions.csv"
    run_dir = out.parent / "run"
    in_process(["predict", *tiny_args(tiny_root, run_dir), f"--ckpt_path={checkpoint}",
                f"--data.predict_root={image_folder}", f"--predictions.output={out}"])
    return out


def test_predict_lists_images_at_any_depth_in_sorted_path_order(image_folder):
    paths = list_images(image_folder)
    relative = [path.relative_to(image_folder).as_posix() for path in paths]
    assert len(paths) == 17
    assert relative == sorted(relative)
    assert relative[0] == "FOX_000.JPG" and "notes.txt" not in relative
    assert not any(part.startswith(".") for path in relative for part in path.split("/"))
    image, index = ImagePathDataset(image_folder)[5]
    assert index == 5 and image.dtype == torch.uint8 and image.shape == (3, 32, 32)


def test_predict_root_without_images_names_the_flag(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no images"):
        list_images(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="--data.predict_root"):
        list_images(tmp_path / "missing")


@pytest.mark.slow  # its fixtures fit and predict in-process: ~20 s
def test_predict_csv_holds_each_images_top_classes_by_name_with_the_models_probabilities(
    single_process_csv, checkpoint, image_folder
):
    header, *rows = read_csv(single_process_csv)
    assert header == ["path", "class_1", "prob_1", "class_2", "prob_2", "class_3", "prob_3"]  # 3 classes: top-3
    assert [row[0] for row in rows] == [str(path) for path in list_images(image_folder)]
    # Recompute every row with the checkpoint's network: each row belongs to its path, names in index order.
    model = ImageClassifier.load_from_checkpoint(checkpoint, map_location="cpu").eval()
    transform = eval_preset(resize_size=32, crop_size=32)
    names = ["cat", "dog", "fox"]
    with torch.no_grad():
        batch = torch.stack([transform(image_loader("auto")(row[0])) for row in rows])  # data.decoder's default
        expected = model(batch).softmax(dim=1).sort(dim=1, descending=True)
    for row, probs, classes in zip(rows, expected.values.tolist(), expected.indices.tolist()):
        assert row[1::2] == [names[c] for c in classes]
        assert [float(p) for p in row[2::2]] == pytest.approx(probs, abs=2e-6)


@pytest.mark.slow
def test_ddp_two_ranks_gather_into_one_csv_equal_to_the_single_process_one(
    tiny_root, checkpoint, image_folder, single_process_csv, tmp_path
):
    # 17 images over 2 ranks: shards of 9 and 8. No --predictions.output: the file goes into the run's log dir.
    result = run_project(["predict", *tiny_args(tiny_root, tmp_path, "--trainer.strategy=ddp", "--trainer.devices=2"),
                          f"--ckpt_path={checkpoint}", f"--data.predict_root={image_folder}"])
    assert result.returncode == 0, result.stderr[-3000:]
    written = sorted(tmp_path.rglob("*.csv"))
    assert written == [tmp_path / "lightning_logs" / "version_0" / "predictions.csv"]
    assert (result.stdout + result.stderr).count("predictions for 17 images written to") == 1
    ddp_rows, single_rows = read_csv(written[0]), read_csv(single_process_csv)
    assert [[row[0], *row[1::2]] for row in ddp_rows] == [[row[0], *row[1::2]] for row in single_rows]  # paths, names
    for ddp_row, single_row in zip(ddp_rows[1:], single_rows[1:]):
        assert [float(p) for p in ddp_row[2::2]] == pytest.approx([float(p) for p in single_row[2::2]], abs=2e-6)
