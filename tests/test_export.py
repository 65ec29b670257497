"""Exported networks give the eager logits back (model.pt2, model.onnx) and run without this package.

    python -m pytest tests/test_export.py
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from torchvision import models

import project.export
from conftest import tiny_args
from project.data.transforms import IMAGENET_MEAN, IMAGENET_STD, eval_preset
from project.export import export_network, load_exported, main, onnx_available

PRE = {"resize": 36, "crop": 32, "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)}
NAMES = ["cat", "dog", "fox"]


class TinyNet(nn.Module):
    """A custom backbone, as --model.backbone would bring one."""

    def __init__(self, num_classes: int = 3):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.BatchNorm2d(8), nn.GELU(),
                                      nn.AdaptiveAvgPool2d(1))
        self.classifier = nn.Linear(8, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


def trained_like(network: nn.Module) -> nn.Module:
    """Non-trivial BatchNorm statistics, so eval mode matters."""
    with torch.no_grad():
        network.train()(torch.randn(8, 3, 32, 32) * 2 + 1)
    return network


@pytest.mark.parametrize("make", [lambda: models.resnet18(num_classes=3), TinyNet], ids=["resnet18", "custom"])
def test_the_exported_program_gives_the_eager_logits_at_any_batch_size(tmp_path, make):
    torch.manual_seed(0)
    network = trained_like(make())
    arch = "resnet18" if isinstance(network, models.ResNet) else None
    files = export_network(network, tmp_path, example=torch.randn(2, 3, 32, 32), class_names=NAMES,
                           preprocessing=PRE, onnx=False, arch=arch)
    assert sorted(files) == ["json", "pt2"] and not (tmp_path / "model.onnx").exists()
    assert network.training  # the caller's network keeps its mode
    exported, meta = load_exported(tmp_path)
    network.eval()
    for batch in (1, 5):
        images = torch.randn(batch, 3, 32, 32)
        with torch.no_grad():
            torch.testing.assert_close(exported(images), network(images), rtol=0, atol=1e-5)
    assert meta["class_names"] == NAMES and meta["preprocessing"]["crop"] == 32
    assert meta["input"]["layout"] == "NCHW" and meta["files"] == {"pt2": "model.pt2"}
    assert meta["arch"] == ("resnet18" if isinstance(network, models.ResNet) else "test_export.TinyNet")


@pytest.mark.skipif(not (onnx_available() and importlib.util.find_spec("onnxruntime")),
                    reason="needs onnx, onnxscript and onnxruntime")
def test_the_onnx_file_gives_the_eager_logits_in_onnxruntime(tmp_path):
    import onnxruntime

    torch.manual_seed(0)
    network = trained_like(models.resnet18(num_classes=3)).eval()
    files = export_network(network, tmp_path, example=torch.randn(2, 3, 32, 32), class_names=NAMES, preprocessing=PRE)
    assert files["onnx"] == tmp_path / "model.onnx"
    assert json.loads(files["json"].read_text())["checked"]["onnx_atol"] == 1e-4
    session = onnxruntime.InferenceSession(str(files["onnx"]), providers=["CPUExecutionProvider"])
    images = torch.randn(3, 3, 32, 32)  # another batch size than the example's
    with torch.no_grad():
        expected = network(images)
    torch.testing.assert_close(torch.from_numpy(session.run(None, {"images": images.numpy()})[0]), expected,
                               rtol=0, atol=1e-4)


def test_without_the_onnx_packages_only_the_program_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # `import onnxscript` now fails, as when not installed
    files = export_network(TinyNet(), tmp_path, example=torch.randn(2, 3, 32, 32), class_names=NAMES, preprocessing=PRE)
    assert sorted(files) == ["json", "pt2"]


class CountsCalls(nn.Module):
    """Output depends on Python state that export freezes at trace time: the check must catch it."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.linear(x.mean(dim=(2, 3))) + self.calls


def test_a_program_that_does_not_reproduce_the_network_is_an_error(tmp_path):
    with pytest.raises(RuntimeError, match="does not reproduce the network: logits differ by up to"):
        export_network(CountsCalls(), tmp_path, example=torch.randn(2, 3, 8, 8), class_names=NAMES,
                       preprocessing=PRE, onnx=False)


def test_bad_arguments_say_what_was_expected(tmp_path):
    with pytest.raises(ValueError, match=r"preprocessing lacks \['mean', 'std'\]"):
        export_network(TinyNet(), tmp_path, example=torch.randn(2, 3, 32, 32), class_names=NAMES,
                       preprocessing={"resize": 36, "crop": 32})
    with pytest.raises(ValueError, match="logits of shape \\(2, 3\\) for 2 class names"):
        export_network(TinyNet(), tmp_path, example=torch.randn(2, 3, 32, 32), class_names=NAMES[:2],
                       preprocessing=PRE)


def readme_snippet() -> str:
    docstring = project.export.__doc__
    start = docstring.rindex("\n", 0, docstring.index("# --- run model.pt2 ---")) + 1
    return textwrap.dedent(docstring[start:docstring.index("# --- end ---")])


@pytest.mark.slow  # another process
def test_the_documented_snippet_runs_the_export_without_this_package(tmp_path):
    torch.manual_seed(0)
    network = trained_like(models.resnet18(num_classes=3)).eval()
    export_network(network, tmp_path / "export", example=torch.randn(2, 3, 32, 32), class_names=NAMES,
                   preprocessing=PRE, onnx=False)
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (45, 61, 3), dtype=np.uint8)).save(tmp_path / "photo.jpg", quality=90)
    script = tmp_path / "predict.py"
    # Any import of the project or Lightning fails in that process.
    script.write_text("import sys\nsys.modules['project'] = None\nsys.modules['lightning'] = None\n" + readme_snippet())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "export"), str(tmp_path / "photo.jpg")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    printed = dict(re.findall(r"^(\w+): ([0-9.]+)$", result.stdout, flags=re.M))

    # The project's own evaluation transform and eager network give the same classes and probabilities.
    image = eval_preset(resize_size=PRE["resize"], crop_size=PRE["crop"])(Image.open(tmp_path / "photo.jpg"))
    with torch.no_grad():
        probs = network(image.unsqueeze(0)).softmax(dim=1)[0]
    assert printed == {name: f"{p:.3f}" for name, p in zip(NAMES, probs.tolist())}


@pytest.mark.slow  # a real fit first: 3-15 s on 2 shared cores
def test_main_exports_a_trained_run_from_its_checkpoint_and_config(tiny_root, tmp_path):
    from project.cli import cli_main

    with mock.patch.dict(os.environ):  # the CLI seeds and sets PL_GLOBAL_SEED: keep it out of later tests
        cli_main(["fit", *tiny_args(tiny_root, tmp_path, "--model.arch=resnet18")])
        run = tmp_path / "lightning_logs" / "version_0"
        files = main(["--ckpt_path", str(run / "checkpoints" / "last.ckpt"), "--no-onnx"])
    assert files["pt2"] == run / "export" / "model.pt2"
    exported, meta = load_exported(run / "export")
    assert meta["class_names"] == ["cat", "dog", "fox"] and meta["arch"] == "resnet18"
    assert (meta["preprocessing"]["resize"], meta["preprocessing"]["crop"]) == (32, 32)  # the quickstart's eval sizes

    state = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    network = models.resnet18(num_classes=3)
    network.load_state_dict({k.removeprefix("network."): v for k, v in state.items() if k.startswith("network.")})
    images = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(exported(images), network.eval()(images), rtol=0, atol=1e-5)
