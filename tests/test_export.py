"""`python -m project export` of a trained quickstart run: the room's ResNet from its checkpoint and config, as
torchvision builds it.

    python -m pytest tests/test_export.py
"""

import json
import os
from unittest import mock

import pytest
import torch
from classifier_engine.export import main
from torchvision import models

from conftest import cli_main, tiny_args


def read_export(folder) -> tuple[torch.nn.Module, dict]:
    """model.pt2 as a callable module, and model.json, as any reader of an export opens them (torch only)."""
    return torch.export.load(folder / "model.pt2").module(), json.loads((folder / "model.json").read_text())


@pytest.mark.slow  # a real fit first: 3-15 s on 2 shared cores
def test_main_exports_a_trained_run_from_its_checkpoint_and_config(tiny_root, tmp_path):
    with mock.patch.dict(os.environ):  # the CLI seeds and sets PL_GLOBAL_SEED: keep it out of later tests
        cli_main(["fit", *tiny_args(tiny_root, tmp_path, "--model.arch=resnet18")])
        run = tmp_path / "lightning_logs" / "version_0"
        files = main(["--ckpt_path", str(run / "checkpoints" / "last.ckpt"), "--no-onnx"])
    assert files["pt2"] == run / "export" / "model.pt2"
    exported, meta = read_export(run / "export")
    assert meta["class_names"] == ["cat", "dog", "fox"] and meta["module"] == "torchvision.models.resnet.ResNet"
    assert (meta["preprocessing"]["resize"], meta["preprocessing"]["crop"]) == (32, 32)  # the quickstart's eval sizes

    state = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    network = models.resnet18(num_classes=3)
    network.load_state_dict({k.removeprefix("network."): v for k, v in state.items() if k.startswith("network.")})
    images = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(exported(images), network.eval()(images), rtol=0, atol=1e-5)
