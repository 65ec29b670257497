"""A checkpoint of the room's model meets data under other class names: the one-line refusal names the room's own way
to start from its weights with a new head (its weights_option, the contract's). The refusal itself, on any model:
engine/tests/test_class_names.py.

    python -m pytest tests/test_class_names.py
"""

import shutil

import pytest

from conftest import cli_main, project_in_process, tiny_args
from project import ImageClassifier

LAST = "lightning_logs/version_0/checkpoints/last.ckpt"


@pytest.fixture(scope="module")
def trained(tiny_root, tmp_path_factory):
    """One step on {cat, dog, fox}, in-process."""
    run_dir = tmp_path_factory.mktemp("trained")
    cli_main(["fit", *tiny_args(tiny_root, run_dir, "--trainer.limit_train_batches=1",
                                "--trainer.limit_val_batches=1")])
    return run_dir / LAST


@pytest.fixture(scope="module")
def renamed_root(tiny_root, tmp_path_factory):
    """The same images with fox/ renamed ant/: three classes again, now {ant, cat, dog}."""
    root = tmp_path_factory.mktemp("renamed") / "data"
    shutil.copytree(tiny_root, root)
    for split in ("train", "val"):
        (root / split / "fox").rename(root / split / "ant")
    return root


@pytest.mark.parametrize("subcommand", ["validate", "predict"])  # fit: the run is complete first (exit 0)
def test_data_under_other_names_is_refused_naming_the_rooms_fine_tuning_option(subcommand, trained, renamed_root,
                                                                              tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    code, out, err = project_in_process([subcommand, *tiny_args(renamed_root, run_dir), f"--ckpt_path={trained}"],
                                        monkeypatch, capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        f"error: checkpoint {trained} was trained on other classes: class 0 is 'cat' there and 'ant' in the data; use "
        "data with the checkpoint's class folders (names and order), or fine-tune from its weights with a new head: "
        f"--{ImageClassifier.weights_option} {trained} (no --ckpt_path)"]
    assert not (run_dir / "lightning_logs").exists() or not any((run_dir / "lightning_logs").iterdir())
