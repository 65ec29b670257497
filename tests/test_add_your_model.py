"""README "Add your model": a network defined outside project/ trains through `python -m project fit`, by config alone.

    python -m pytest tests/test_add_your_model.py --durations=0
"""

import math

import pytest
import torch
import yaml
from classifier_engine.export import main as export_main

from conftest import read_scalars, run_project, tiny_args

# What a user writes: a plain nn.Module whose first argument is num_classes (the CLI links it from the data).
MY_MODELS = '''
from torch import nn


class TinyConvNet(nn.Module):
    """Conv-BN-ReLU, global average pool, linear head."""

    def __init__(self, num_classes: int, width: int = 16):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(width, num_classes)

    def forward(self, images):
        return self.head(self.features(images))
'''

MY_CONFIG = """
model:
  backbone:
    class_path: my_models.TinyConvNet
    init_args:
      width: 12
"""


@pytest.mark.slow
def test_backbone_from_a_module_outside_the_project_trains_by_config_alone(tiny_root, tmp_path, monkeypatch):
    code = tmp_path / "code"
    code.mkdir()
    (code / "my_models.py").write_text(MY_MODELS)
    (code / "tiny_conv.yaml").write_text(MY_CONFIG)
    run_dir = tmp_path / "run"

    result = run_project(["fit", *tiny_args(tiny_root, run_dir, "--config", str(code / "tiny_conv.yaml"))],
                         env={"PYTHONPATH": str(code)})

    assert result.returncode == 0, result.stderr[-3000:]
    version = run_dir / "lightning_logs" / "version_0"
    saved = yaml.safe_load((version / "config.yaml").read_text())
    backbone = saved["model"]["init_args"]["backbone"]
    assert backbone == {"class_path": "my_models.TinyConvNet", "init_args": {"width": 12}}
    weights = torch.load(version / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    # The network is the user's, built with width 12 and the 3 classes linked from the data: no ResNet inside.
    assert weights["network.features.0.weight"].shape == (12, 3, 3, 3)
    assert weights["network.head.weight"].shape == (3, 12)
    assert not any(key.startswith("network.layer") for key in weights)
    scalars = read_scalars(version)
    assert len(scalars["train/loss"]) == 5  # 40 images / batch 8, logged every step
    assert all(math.isfinite(value) for _, value in scalars["train/loss"])
    assert 0.0 <= scalars["val/acc1"][-1][1] <= 1.0

    # Export finds the run's config.yaml beside its checkpoints/ and rebuilds the user's network from it (in this
    # process, with the user's folder on its path as the fit had it).
    monkeypatch.syspath_prepend(str(code))
    export_main([f"--ckpt_path={version / 'checkpoints' / 'last.ckpt'}"])
    program = torch.export.load(version / "export" / "model.pt2").module()
    from my_models import TinyConvNet

    network = TinyConvNet(3, width=12).eval()
    network.load_state_dict({k.removeprefix("network."): v for k, v in weights.items() if k.startswith("network.")})
    images = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(program(images), network(images), rtol=0, atol=1e-5)
