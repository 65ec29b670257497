"""ImageFolderDataModule on a tiny ImageFolder: classes read from folders, batch shapes, one clear error per bad layout.

    python -m pytest tests/test_datamodule.py
"""

import re
import shutil
import threading
from pathlib import Path

import pytest
import torch

from classifier_engine import ImageFolderDataModule
from classifier_engine.contract import EvalPreprocessing
from classifier_engine.data.embedded import materialize_digits, resolve_root
from classifier_engine.data.layout import DataLayoutError
from classifier_engine.errors import ConfigError
from conftest import project_in_process, tiny_args, write_image_folder

SIZES = dict(train_crop_size=24, eval_resize_size=32, eval_crop_size=28)  # distinct, so a mixed-up preset shows


def _datamodule(root, **overrides) -> ImageFolderDataModule:
    kwargs = dict(root=str(root), batch_size=4, num_workers=0, pin_memory=False, **SIZES)
    return ImageFolderDataModule(**{**kwargs, **overrides})


def _copy(tiny_root: Path, tmp_path: Path) -> Path:
    root = tmp_path / "data"
    shutil.copytree(tiny_root, root)
    return root


def test_classes_are_read_from_the_train_folders(tiny_root):
    dm = _datamodule(tiny_root)
    assert dm.class_names == ["cat", "dog", "fox"]
    assert dm.num_classes == 3


def test_batches_have_the_configured_shapes_and_labels(tiny_root):
    dm = _datamodule(tiny_root)
    dm.setup("fit")
    # The hook Lightning runs on the device: it finishes batches the workers may leave as uint8.
    images, labels = dm.on_after_batch_transfer(next(iter(dm.train_dataloader())), 0)
    assert images.shape == (4, 3, 24, 24) and images.dtype == torch.float32
    assert labels.shape == (4,) and set(labels.tolist()) <= {0, 1, 2}
    val_batches = list(dm.val_dataloader())
    assert [b[0].shape[1:] for b in val_batches] == [(3, 28, 28)] * len(val_batches)
    assert sum(len(b[1]) for b in val_batches) == 17  # each val image exactly once, no padding
    assert torch.cat([b[1] for b in val_batches]).tolist() == [0] * 6 + [1] * 6 + [2] * 5


def test_unset_root_names_the_flag():
    with pytest.raises(ValueError, match=r"data.root is not set: pass --data.root"):
        ImageFolderDataModule(root=None)


def test_missing_root_names_the_path_and_the_layout(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(DataLayoutError) as error:
        _datamodule(missing)
    message = str(error.value)
    assert f"data root {missing} does not exist" in message
    assert "ROOT/train/<class>/" in message and "--data.root" in message
    assert not missing.exists()


@pytest.mark.parametrize("split", ["train", "val"])
def test_missing_split_says_which(tiny_root, tmp_path, split):
    root = _copy(tiny_root, tmp_path)
    shutil.rmtree(root / split)
    with pytest.raises(DataLayoutError, match=rf"data root {re.escape(str(root))} has no '{split}/' folder; expected"):
        _datamodule(root)


def test_train_without_class_folders(tmp_path):
    root = write_image_folder(tmp_path / "data", {"cat": (2, 2)})
    for image in (root / "train" / "cat").iterdir():  # images straight in train/, the classic mistake
        image.rename(root / "train" / image.name)
    (root / "train" / "cat").rmdir()
    with pytest.raises(DataLayoutError, match=rf"{re.escape(str(root / 'train'))} holds no class folders; expected"):
        _datamodule(root)


@pytest.mark.parametrize("split", ["train", "val"])
def test_empty_class_folder_is_named(tiny_root, tmp_path, split):
    root = _copy(tiny_root, tmp_path)
    (root / split / "emu").mkdir()
    if split == "val":
        (root / "train" / "emu").mkdir()
        shutil.copy(next((root / "train" / "cat").iterdir()), root / "train" / "emu" / "one.jpg")
    with pytest.raises(DataLayoutError, match=r"1 class folder\(s\) without images \(emu\).*Fill or remove the empty"):
        _datamodule(root)


def test_a_hidden_folder_counts_as_a_class_as_imagefolder_counts_it(tiny_root, tmp_path):
    root = _copy(tiny_root, tmp_path)
    (root / "train" / ".ipynb_checkpoints").mkdir()
    with pytest.raises(DataLayoutError, match=r"without images \(\.ipynb_checkpoints\).*Fill or remove"):
        _datamodule(root)


def test_hidden_files_below_a_class_folder_are_not_data_in_fit_or_predict(tiny_root, tmp_path):
    # macOS writes an AppleDouble `._name.jpg` (not a JPEG) beside each file it copies to a foreign disk.
    root = _copy(tiny_root, tmp_path)
    for split in ("train", "val"):
        (root / split / "cat" / "._cat_000.jpg").write_bytes(b"\x00\x05\x16\x07" + bytes(80))
    (root / "train" / "dog" / ".thumbnails").mkdir()
    shutil.copy(root / "train" / "dog" / "dog_000.jpg", root / "train" / "dog" / ".thumbnails" / "dog_000.jpg")
    dm = _datamodule(root, predict_root=str(root / "val"))
    dm.setup("fit")
    assert sum(len(labels) for _, labels in dm.train_dataloader()) == 40  # every batch decodes; none hidden
    assert sum(len(labels) for _, labels in dm.val_dataloader()) == 17
    dm.setup("predict")
    assert len(dm.datasets["predict"].paths) == 17
    (root / "train" / "emu").mkdir()
    (root / "train" / "emu" / "._emu_000.jpg").write_bytes(b"\x00\x05\x16\x07" + bytes(80))
    with pytest.raises(DataLayoutError, match=r"1 class folder\(s\) without images \(emu\)"):
        _datamodule(root)


def test_a_file_as_root_is_named(tmp_path):
    archive = tmp_path / "imagenet.tar"
    archive.write_bytes(b"")
    with pytest.raises(DataLayoutError, match=f"data root {re.escape(str(archive))} is a file, not a folder"):
        _datamodule(archive)


def test_a_val_class_that_train_lacks_is_refused_in_one_line(tiny_root, tmp_path):
    root = _copy(tiny_root, tmp_path)
    (root / "val" / "fox").rename(root / "val" / "wolf")
    with pytest.raises(DataLayoutError) as error:
        _datamodule(root)
    message = str(error.value)
    assert f"{root / 'val'} holds class folders that {root / 'train'} lacks: ['wolf']" in message
    assert "\n" not in message


def test_a_val_split_lacking_a_class_is_labelled_by_name(tiny_root, tmp_path):
    root = _copy(tiny_root, tmp_path)
    shutil.rmtree(root / "val" / "dog")  # cat stays 0 and fox stays 2, as in train/
    dm = _datamodule(root)
    dm.setup("validate")
    assert dm.class_names == ["cat", "dog", "fox"]
    labels = {Path(path).name: label for path, label in dm.datasets["val"].samples}
    assert labels["cat_000.jpg"] == 0 and labels["fox_004.jpg"] == 2 and len(labels) == 11
    assert torch.cat([b[1] for b in dm.val_dataloader()]).tolist() == [0] * 6 + [2] * 5


def test_the_incomplete_last_training_batch_is_dropped(tmp_path):
    # 13 images, batch 4: a last batch of one image would make BatchNorm raise in training.
    root = write_image_folder(tmp_path / "data", {"cat": (7, 1), "dog": (6, 1)})
    dm = _datamodule(root)
    dm.setup("fit")
    assert [len(batch[1]) for batch in dm.train_dataloader()] == [4, 4, 4]
    dm = _datamodule(root, drop_last=False)
    dm.setup("fit")
    assert [len(batch[1]) for batch in dm.train_dataloader()] == [4, 4, 4, 2]  # see the next test


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_kept_last_training_batch_is_never_one_image_and_every_image_is_seen(tmp_path, world_size):
    # data.drop_last=false, 13 images per process in batches of 4: a last batch of one image would make BatchNorm raise
    # in training ("Expected more than 1 value per channel"); it takes an image from the start of the epoch instead.
    from types import SimpleNamespace

    root = write_image_folder(tmp_path / "data", {"cat": (7 * world_size, 1), "dog": (6 * world_size, 1)})
    batches, seen = [], []
    for rank in range(world_size):
        dm = _datamodule(root, drop_last=False)
        dm.trainer = SimpleNamespace(world_size=world_size, global_rank=rank)
        dm.setup("fit")
        batches += [len(labels) for _, labels in dm.train_dataloader()]
        seen += [index for index, _, _ in dm.train_sampler]
    assert batches == [4, 4, 4, 2] * world_size
    assert sorted(set(seen)) == list(range(13 * world_size)) and len(seen) == 14 * world_size  # one image twice
    torch.nn.BatchNorm2d(3).train()(torch.randn(batches[-1], 3, 2, 2))


def test_fewer_training_images_than_a_batch_still_train_one_batch(tmp_path):
    root = write_image_folder(tmp_path / "data", {"cat": (2, 1), "dog": (1, 1)})
    dm = _datamodule(root)
    dm.setup("fit")
    assert [len(batch[1]) for batch in dm.train_dataloader()] == [3]


def test_one_training_image_per_process_is_one_line_not_a_batchnorm_error_in_the_first_step(tmp_path):
    from types import SimpleNamespace

    root = write_image_folder(tmp_path / "data", {"cat": (1, 1), "dog": (1, 1)})
    dm = _datamodule(root)
    dm.trainer = SimpleNamespace(world_size=2, global_rank=0)  # as under ddp x2: one image each
    dm.setup("fit")
    with pytest.raises(ConfigError, match=r"2 training images over 2 processes leave 1 per process: a training batch "
                                          r"needs 2 or more"):
        dm.train_dataloader()


def test_eval_preprocessing_and_image_sizes_follow_the_options(tiny_root):
    dm = _datamodule(tiny_root, mean=(0.5, 0.5, 0.5), std=[0.25, 0.25, 0.25])
    assert dm.eval_preprocessing() == EvalPreprocessing(resize=32, crop=28, mean=(0.5,) * 3, std=(0.25,) * 3)
    assert dm.image_sizes() == {"data.train_crop_size": 24, "data.eval_crop_size": 28}
    dm.setup("validate")
    images = dm.on_after_batch_transfer(next(iter(dm.val_dataloader())), 0)[0]
    assert images.min() >= -2 and images.max() <= 2  # (x - 0.5) / 0.25 for x in [0, 1]
    with pytest.raises(ConfigError, match=r"data.std: expected a float > 0, got 0"):
        _datamodule(tiny_root, std=(0.2, 0, 0.2))
    with pytest.raises(ConfigError, match=r"data.mean: expected 3 values, got \(0.5, 0.5\)"):
        _datamodule(tiny_root, mean=(0.5, 0.5))


def test_bad_root_on_the_command_line_fails_with_the_same_message(tmp_path, monkeypatch, capsys):
    missing = tmp_path / "nowhere"
    code, _, err = project_in_process(["fit", *tiny_args(missing, tmp_path / "run")], monkeypatch, capsys)
    assert code == 2 and f"data root {missing} does not exist" in err.strip().splitlines()[-1]
    assert not (tmp_path / "run").exists()


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def digits_twice(tmp_path_factory) -> tuple[Path, Path]:
    """The session's cached digits (the quickstart's) and a second, independent materialization."""
    return resolve_root("embedded:digits"), materialize_digits(tmp_path_factory.mktemp("digits") / "again")


def test_embedded_digits_materialize_byte_for_byte_the_same(digits_twice):
    first, second = (_tree(root) for root in digits_twice)
    assert first == second
    jpegs = [name for name in first if name.endswith(".jpg")]
    assert len(jpegs) == 1797
    assert sum(name.startswith("val/") for name in jpegs) == 355  # every 5th of each class
    assert sorted({Path(name).parts[1] for name in jpegs}) == [str(d) for d in range(10)]


def test_embedded_digits_leave_nothing_half_written(digits_twice):
    root = digits_twice[0]
    assert (root / ".complete").exists()
    assert [p.name for p in root.parent.iterdir() if p.name.startswith(".")] == []  # no staging folder left
    dm = _datamodule(root)
    assert dm.class_names == [str(d) for d in range(10)]


def test_a_partial_embedded_folder_is_replaced_not_reused(digits_twice, tmp_path):
    target = tmp_path / "digits"
    (target / "train" / "3").mkdir(parents=True)  # what a run killed mid-write would have left without staging
    (target / "train" / "3" / "0003.jpg").write_bytes(b"truncated")
    materialize_digits(target)
    assert _tree(target) == _tree(digits_twice[0])


def test_racing_materializations_agree(digits_twice, tmp_path):
    target, errors = tmp_path / "digits", []

    def materialize():
        try:
            materialize_digits(target)
        except Exception as exc:  # noqa: BLE001  re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=materialize) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert _tree(target) == _tree(digits_twice[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["digits"]


def test_a_resume_mid_epoch_continues_the_uninterrupted_batches_with_the_last_one_dropped(tiny_root):
    # 40 images in batches of 6: 6 full batches, the last 4 images left out; stopped after 2, resumed for the other 4.
    def batches(state=None, stop=None):
        dm = _datamodule(tiny_root, batch_size=6)
        if state is not None:
            dm.load_state_dict(state)
        dm.setup("fit")
        loader = iter(dm.train_dataloader())
        taken = [next(loader) for _ in range(stop)] if stop else list(loader)
        return taken, dm.state_dict()

    uninterrupted, _ = batches()
    first, state = batches(stop=2)
    rest, _ = batches(state)
    assert [len(labels) for _, labels in uninterrupted] == [6] * 6 and len(rest) == 4
    for (images, labels), (expected_images, expected_labels) in zip(first + rest, uninterrupted):
        assert torch.equal(images, expected_images) and torch.equal(labels, expected_labels)
