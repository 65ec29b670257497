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

import pytest
import torch
import yaml
from torch import nn
from torchvision import models

from classifier_engine.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from classifier_engine.errors import CheckpointError, ConfigError
from classifier_engine.export import ExportCheckError, export_network, main, onnx_available
from conftest import tiny_args

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


def read_export(folder) -> tuple[nn.Module, dict]:
    """model.pt2 as a callable module, and model.json, as any reader of an export opens them (torch only)."""
    return torch.export.load(folder / "model.pt2").module(), json.loads((folder / "model.json").read_text())


def trained_like(network: nn.Module) -> nn.Module:
    """Non-trivial BatchNorm statistics, so eval mode matters."""
    with torch.no_grad():
        network.train()(torch.randn(8, 3, 32, 32) * 2 + 1)
    return network


@pytest.mark.parametrize("make", [lambda: models.resnet18(num_classes=3), TinyNet], ids=["resnet18", "custom"])
def test_the_exported_program_gives_the_eager_logits_at_any_batch_size(tmp_path, make):
    torch.manual_seed(0)
    network = trained_like(make())
    files = export_network(network, tmp_path, example=torch.randn(2, 3, 32, 32), class_names=NAMES,
                           preprocessing=PRE, onnx=False)
    assert sorted(files) == ["json", "pt2"] and not (tmp_path / "model.onnx").exists()
    assert network.training  # the caller's network keeps its mode
    exported, meta = read_export(tmp_path)
    network.eval()
    for batch in (1, 5):
        images = torch.randn(batch, 3, 32, 32)
        with torch.no_grad():
            torch.testing.assert_close(exported(images), network(images), rtol=0, atol=1e-5)
    assert meta["class_names"] == NAMES and meta["preprocessing"]["crop"] == 32
    assert meta["input"]["layout"] == "NCHW" and meta["files"] == {"pt2": "model.pt2"}
    assert meta["module"] == f"{type(network).__module__}.{type(network).__qualname__}"  # the network exported


@pytest.mark.skipif(not (onnx_available() and importlib.util.find_spec("onnxruntime")),
                    reason="needs onnx, onnxscript and onnxruntime")
def test_the_onnx_file_gives_the_eager_logits_in_onnxruntime(tmp_path):
    import onnxruntime

    torch.manual_seed(0)
    network = trained_like(models.resnet18(num_classes=3)).eval()
    files = export_network(network, tmp_path, example=torch.randn(2, 3, 32, 32), class_names=NAMES, preprocessing=PRE)
    assert files["onnx"] == tmp_path / "model.onnx"
    assert files["onnx_data"] == tmp_path / "model.onnx.data"  # the weights, beside model.onnx
    assert json.loads(files["json"].read_text())["checked"]["onnx"]["rtol"] == 1e-4
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


def head_scaled(network: nn.Module, factor: float) -> nn.Module:
    """Logits `factor` times larger, as after a few diverging steps (efficientnet_b0's reached ~1e7)."""
    with torch.no_grad():
        network.classifier.weight.mul_(factor)
        network.classifier.bias.mul_(factor)
    return network


def listing(folder) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


@pytest.mark.skipif(not (onnx_available() and importlib.util.find_spec("onnxruntime")),
                    reason="needs onnx, onnxscript and onnxruntime")
def test_large_logits_pass_the_check_relative_to_their_scale(tmp_path):
    torch.manual_seed(0)
    network = head_scaled(trained_like(TinyNet()), 1e6).eval()
    example = torch.randn(2, 3, 32, 32)
    files = export_network(network, tmp_path, example=example, class_names=NAMES, preprocessing=PRE)
    checked = json.loads(files["json"].read_text())["checked"]
    assert checked["onnx"]["max_abs_logit"] > 1e5
    # float32 rounding alone at that scale: more than any absolute tolerance of 1e-4 allows, far less than 1e-4 of it
    assert 1e-4 < checked["onnx"]["max_difference"] <= 1e-4 * checked["onnx"]["max_abs_logit"]
    exported, _ = read_export(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(exported(example), network(example), rtol=0,
                                   atol=1e-5 * checked["pt2"]["max_abs_logit"])


def test_a_failed_check_leaves_the_output_folder_as_it_was(tmp_path):
    earlier = export_network(TinyNet(), tmp_path / "export", example=torch.randn(2, 3, 32, 32), class_names=NAMES,
                             preprocessing=PRE, onnx=False)
    before = listing(tmp_path / "export")
    assert sorted(before) == ["model.json", "model.pt2"] and earlier["json"].is_file()
    with pytest.raises(ExportCheckError, match=r"^the exported model.pt2 does not reproduce the network: logits "
                                               r"differ by up to [0-9.e+-]+, .* nothing was written to "):
        export_network(CountsCalls(), tmp_path / "export", example=torch.randn(2, 3, 8, 8), class_names=NAMES,
                       preprocessing=PRE, onnx=False)
    assert listing(tmp_path / "export") == before  # no temp folder, no model.pt2 of the failed export
    with pytest.raises(ExportCheckError):
        export_network(CountsCalls(), tmp_path / "new" / "export", example=torch.randn(2, 3, 8, 8), class_names=NAMES,
                       preprocessing=PRE, onnx=False)
    assert not (tmp_path / "new" / "export").exists()


@pytest.mark.skipif(not (onnx_available() and importlib.util.find_spec("onnxruntime")),
                    reason="needs onnx, onnxscript and onnxruntime")
def test_an_onnx_file_that_fails_its_check_leaves_neither_it_nor_the_checked_program(tmp_path):
    export_network(TinyNet(), tmp_path, example=torch.randn(2, 3, 32, 32), class_names=NAMES, preprocessing=PRE)
    before = listing(tmp_path)
    assert sorted(before) == ["model.json", "model.onnx", "model.onnx.data", "model.pt2"]
    torch.manual_seed(1)
    network = head_scaled(trained_like(TinyNet()), 1e6)  # other weights: each file of this export would differ
    with pytest.raises(ExportCheckError, match=r"the exported model.onnx does not reproduce the network: logits differ "
                                               r"by up to [0-9.e+-]+, [0-9.e+-]+ of the largest logit [0-9.e+-]+ "
                                               r"\(allowed 0\); nothing was written to "):
        export_network(network, tmp_path, example=torch.randn(2, 3, 32, 32), class_names=NAMES, preprocessing=PRE,
                       onnx_rtol=0)  # ONNX Runtime's kernels round differently from torch's: forced to fail
    assert listing(tmp_path) == before
    # A later export without ONNX does not leave the earlier one's model.onnx beside its model.json.
    files = export_network(network, tmp_path, example=torch.randn(2, 3, 32, 32), class_names=NAMES, preprocessing=PRE,
                           onnx=False)
    assert sorted(listing(tmp_path)) == ["model.json", "model.pt2"]
    assert json.loads(files["json"].read_text())["files"] == {"pt2": "model.pt2"}


@pytest.mark.slow  # another process
def test_a_failed_check_ends_the_process_with_one_line_naming_the_file_and_the_difference(tmp_path):
    script = textwrap.dedent(f"""
        import torch
        from torch import nn
        from classifier_engine.errors import exit_on_user_error
        from classifier_engine.export import export_network

        class CountsCalls(nn.Module):  # its output changes with every call: no export reproduces it
            def __init__(self):
                super().__init__()
                self.linear, self.calls = nn.Linear(3, 3), 0

            def forward(self, x):
                self.calls += 1
                return self.linear(x.mean(dim=(2, 3))) + self.calls

        exit_on_user_error(lambda: export_network(CountsCalls(), {str(tmp_path / "export")!r},
                                                  example=torch.randn(2, 3, 8, 8), class_names=["a", "b", "c"],
                                                  preprocessing={PRE!r}, onnx=False))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert re.match(r"error: the exported model.pt2 does not reproduce the network: logits differ by up to [0-9.]+, ",
                    lines[0]), lines[0]
    assert f"nothing was written to {tmp_path / 'export'}" in lines[0]
    assert not (tmp_path / "export").exists()


@pytest.mark.slow  # a real fit first: 3-15 s on 2 shared cores
def test_main_exports_a_trained_run_from_its_checkpoint_and_config(tiny_root, tmp_path):
    from conftest import NETWORK, cli_main, model_class, new_model

    with mock.patch.dict(os.environ):  # the CLI seeds and sets PL_GLOBAL_SEED: keep it out of later tests
        cli_main(["fit", *tiny_args(tiny_root, tmp_path)])
        run = tmp_path / "lightning_logs" / "version_0"
        files = main(["--ckpt_path", str(run / "checkpoints" / "last.ckpt"), "--no-onnx"])
    assert files["pt2"] == run / "export" / "model.pt2"
    # Bad arguments: one line each before anything is built (argparse printed its usage block; a file as --out_dir
    # failed after the network was built and checked, with a traceback).
    (tmp_path / "a_file").write_text("")
    last = str(run / "checkpoints" / "last.ckpt")
    for argv, said in ((["--ckpt_path", "last"], "--ckpt_path last is not a file: pass a run's checkpoint, "),
                       (["--ckpt_path", last, "--out_dir", str(tmp_path / "a_file")],
                        f"--out_dir {tmp_path / 'a_file'} is a file: pass a folder"),
                       (["--ckpt_path", last, "--nope"], "unrecognized arguments: --nope (see "),
                       (["--ckpt_path", last, "--config", "a.yaml", "--config", "b.yaml"],
                        "--config given 2 times: export reads one, the run's saved config.yaml")):
        with pytest.raises(ConfigError, match=f"^export: {re.escape(said)}"):
            main(argv)
    # A config that names no model class builds the entry point's default, as fit does (it was "unrecognized
    # arguments: --model.width", an option never given).
    saved = yaml.safe_load((run / "config.yaml").read_text())
    (tmp_path / "no_class.yaml").write_text(yaml.safe_dump({**saved, "model": saved["model"]["init_args"]}))
    with mock.patch.dict(os.environ):
        files = main(["--ckpt_path", last, "--config", str(tmp_path / "no_class.yaml"), "--out_dir",
                      str(tmp_path / "default_class"), "--no-onnx"], model=model_class())
    assert files["pt2"] == tmp_path / "default_class" / "model.pt2"
    # A config of another network than the checkpoint's: the fit's one line, not load_state_dict's traceback.
    init = saved["model"]["init_args"]
    wider = {**saved, "model": {**saved["model"], "init_args": {**init, "width": 2 * init["width"]}}}
    (tmp_path / "wider.yaml").write_text(yaml.safe_dump(wider))
    with mock.patch.dict(os.environ), pytest.raises(CheckpointError, match=r"^checkpoint .*last.ckpt holds another "
                                                                           r"network \(its model.width is "):
        main(["--ckpt_path", last, "--config", str(tmp_path / "wider.yaml"), "--out_dir", str(tmp_path / "wider")])
    assert not (tmp_path / "wider").exists()
    exported, meta = read_export(run / "export")
    assert meta["class_names"] == ["cat", "dog", "fox"] and meta["module"] == "torch.nn.modules.container.Sequential"
    assert (meta["preprocessing"]["resize"], meta["preprocessing"]["crop"]) == (32, 32)  # the quickstart's eval sizes

    state = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    network = new_model(3).exportable()  # the quickstart model's network (plain_model.py)
    network.load_state_dict({k.removeprefix(NETWORK): v for k, v in state.items() if k.startswith(NETWORK)})
    images = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(exported(images), network.eval()(images), rtol=0, atol=1e-5)
