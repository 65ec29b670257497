"""A checkpoint meets data by class name: the same count under other names, or in another order, is refused in one
line naming the first class that differs (before: val/acc1 1.0 -> 0.0, predictions under the wrong names, no word).

    python -m pytest tests/test_class_names.py
"""

import shutil

import pytest
import torch

from conftest import project_in_process, tiny_args

LAST = "lightning_logs/version_0/checkpoints/last.ckpt"


@pytest.fixture(scope="module")
def trained(tiny_root, tmp_path_factory):
    """One step on {cat, dog, fox}, in-process."""
    from conftest import cli_main

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


def test_every_checkpoint_holds_the_class_names_it_was_trained_on(trained):
    checkpoint = torch.load(trained, map_location="cpu", weights_only=True)
    assert checkpoint["class_names"] == ["cat", "dog", "fox"]
    assert "_class_path" not in checkpoint["hyper_parameters"] and "_instantiator" not in checkpoint["hyper_parameters"]


@pytest.mark.parametrize("subcommand", ["validate", "predict", "fit"])
def test_data_with_the_same_count_under_other_names_is_refused_in_one_line(subcommand, trained, renamed_root,
                                                                          tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    more = ["--trainer.max_epochs=2"] if subcommand == "fit" else []  # (a fit of a finished run ends before the data)
    args = [subcommand, *tiny_args(renamed_root, run_dir, *more), f"--ckpt_path={trained}"]
    code, out, err = project_in_process(args, monkeypatch, capsys)
    assert code == 2
    hint = "your model's own loading (no --ckpt_path)"  # plain_model names no weights_option (the contract)
    assert err.strip().splitlines() == [
        f"error: checkpoint {trained} was trained on other classes: class 0 is 'cat' there and 'ant' in the data; use "
        "data with the checkpoint's class folders (names and order), or fine-tune from its weights with a new head: "
        + hint]
    assert not (run_dir / "lightning_logs").exists() or not any((run_dir / "lightning_logs").iterdir())
