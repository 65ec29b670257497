"""Checkpoints carry values, the config names classes: a crafted checkpoint never makes us import or build anything.

    python -m pytest tests/test_checkpoint_security.py

A real run's checkpoint, with a user's own backbone (by config, as in README "Add your model"), is given hostile
hyperparameters: a `class_path` (with `init_args`: jsonargparse would build it), a dotted string where a class is
expected, Lightning's `_class_path` / `_instantiator`, a `class_path` deep inside a group. The module they name writes a
file when it is imported; it is on sys.path, so an import would succeed.
"""

import logging
import sys
from pathlib import Path

import pytest
import torch
import yaml
from classifier_engine.compat.ckpt_read_once import checkpoint_values

from conftest import QUICKSTART, SHRINK, project_in_process
from project import ImageClassifier, ImageNetDataModule, cli_main

MY_NET = '''
from torch import nn


class TinyNet(nn.Sequential):
    def __init__(self, num_classes: int, width: int = 6):
        super().__init__(nn.Conv2d(3, width, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))
'''
HOSTILE = "zen_hostile"  # writes MARKER when imported
ATTACKS = {
    # beside the class a CLI checkpoint names (Lightning 2.6.6 then runs its allowlisted instantiator: jsonargparse)
    "class_path with init_args": {"backbone": {"class_path": f"{HOSTILE}.Net", "init_args": {"width": 5}},
                                  "_class_path": "project.model.ImageClassifier"},
    "dotted string": {"backbone": f"{HOSTILE}.Net", "_class_path": "project.model.ImageClassifier"},
    "top-level _class_path": {"_class_path": f"{HOSTILE}.Net"},
    "deep in a group": {"optim": {"extra": {"class_path": f"{HOSTILE}.Net", "init_args": {}}}},
}


@pytest.fixture(scope="module")
def code(tmp_path_factory) -> Path:
    """A folder on sys.path with the user's network and the hostile module."""
    folder = tmp_path_factory.mktemp("code")
    (folder / "security_net.py").write_text(MY_NET)  # not my_net: the README snippet test's module
    marker = folder / "imported"
    (folder / f"{HOSTILE}.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\nclass Net:\n    pass\n")
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))
    sys.modules.pop("security_net", None)


@pytest.fixture(scope="module")
def run(code, tiny_root, tmp_path_factory) -> Path:
    """A real run with `model.backbone: {class_path: security_net.TinyNet}` (2 steps); its version dir."""
    (code / "net.yaml").write_text("model:\n  arch: null\n  backbone:\n    class_path: security_net.TinyNet\n")
    root = tmp_path_factory.mktemp("run")
    cli_main(["fit", "--config", str(QUICKSTART), "--config", str(code / "net.yaml"), *SHRINK,
              f"--data.root={tiny_root}", f"--trainer.default_root_dir={root}", "--trainer.max_steps=2",
              "--trainer.limit_val_batches=1"])
    return root / "lightning_logs" / "version_0"


@pytest.fixture(autouse=True)
def not_yet_imported(code):
    """Each case on its own: one that imported the module must not fail the next."""
    sys.modules.pop(HOSTILE, None)
    (code / "imported").unlink(missing_ok=True)


def crafted(run: Path, tmp_path: Path, attack: str) -> Path:
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    hparams = checkpoint["hyper_parameters"]
    for key, value in ATTACKS[attack].items():
        hparams[key] = {**hparams[key], **value} if isinstance(hparams.get(key), dict) else value
    hparams["_instantiator"] = "lightning.pytorch.cli.instantiate_module"  # allowlisted since Lightning 2.6.6
    checkpoint["datamodule_hyper_parameters"]["_instantiator"] = "lightning.pytorch.cli.instantiate_module"
    torch.save(checkpoint, tmp_path / "crafted.ckpt")
    return tmp_path / "crafted.ckpt"


def assert_never_imported(code: Path) -> None:
    assert HOSTILE not in sys.modules and not (code / "imported").exists(), "the checkpoint's module was imported"


@pytest.mark.parametrize("attack", ["class_path with init_args", "dotted string"])
@pytest.mark.parametrize("network", ["the user's, passed by the caller", "a torchvision arch"])
def test_load_from_checkpoint_takes_values_from_a_checkpoint_and_never_code(code, run, tmp_path, attack, network):
    from security_net import TinyNet

    path = crafted(run, tmp_path, attack)
    kwargs = {"backbone": TinyNet}  # the caller names the class: the checkpoint does not hold it
    if network == "a torchvision arch":
        checkpoint, kwargs = torch.load(path, weights_only=True), {}
        resnet = ImageClassifier(num_classes=3, arch="resnet18")
        checkpoint["hyper_parameters"]["arch"], checkpoint["state_dict"] = "resnet18", resnet.state_dict()
        torch.save(checkpoint, path)
    model = ImageClassifier.load_from_checkpoint(path, **kwargs)
    ImageNetDataModule.load_from_checkpoint(path)
    assert_never_imported(code)
    assert isinstance(model.network, TinyNet) == (network != "a torchvision arch")
    saved = torch.load(path, weights_only=True)["state_dict"]
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, saved[key])


@pytest.mark.parametrize(("subcommand", "attack"), [("validate", "class_path with init_args"),
                                                    ("validate", "dotted string"),
                                                    ("validate", "deep in a group"),
                                                    ("validate", "top-level _class_path"),
                                                    ("predict", "class_path with init_args"),
                                                    ("fit", "class_path with init_args")])
def test_the_cli_builds_the_configs_classes_and_never_the_checkpoints(code, run, tmp_path, monkeypatch, capsys, caplog,
                                                                      subcommand, attack):
    path = crafted(run, tmp_path, attack)
    extra = {"fit": ["--trainer.max_steps=3", "--trainer.limit_val_batches=1"],
             "predict": [f"--predictions.output={tmp_path / 'predictions.csv'}"]}.get(subcommand, [])
    args = [subcommand, "--config", str(run / "config.yaml"), f"--ckpt_path={path}", "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path / 'out'}", *extra]
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        code_, out, err = project_in_process(args, monkeypatch, capsys)
    assert_never_imported(code)
    assert code_ == 0, err[-2000:]
    if attack == "top-level _class_path":
        return  # the config's class, silently: every CLI checkpoint names one
    dropped = "model.optim" if attack == "deep in a group" else "model.backbone"
    plan = next(record.getMessage() for record in caplog.records if record.getMessage().startswith("plan of this"))
    assert f"  checkpoint values left out: {dropped} (checkpoints carry values, the config names classes)" in \
        plan.splitlines()


def test_only_values_for_value_typed_arguments_are_taken_from_a_checkpoint():
    hparams = {"arch": "resnet18", "num_classes": 3, "backbone": "x.Y", "optim": {"extra": {"init_args": {}}},
               "loss": {"name": "bce"}, "_class_path": "x.Y", "_instantiator": "x.y", "lr_per_256": 0.1}
    taken, dropped = checkpoint_values(ImageClassifier, hparams)
    # lr_per_256 (an option that moved) goes on to the parse, which names its new place
    assert taken == {"arch": "resnet18", "num_classes": 3, "loss": {"name": "bce"}, "lr_per_256": 0.1}
    assert dropped == ["backbone", "optim"]
    assert yaml.safe_dump(taken)  # plain values only
