"""Export a trained network for inference without this package: model.pt2 (torch.export), model.onnx, model.json.

    python -m project.export --ckpt_path RUN/checkpoints/best.ckpt [--config RUN/config.yaml] [--out_dir DIR]

Running the export needs torch only (plus Pillow to read an image here); neither this package nor Lightning:

    # --- run model.pt2 ---
    import json, sys
    import torch
    import torch.nn.functional as F
    from PIL import Image

    folder, image_path = sys.argv[1], sys.argv[2]
    meta = json.load(open(f"{folder}/model.json"))
    model = torch.export.load(f"{folder}/model.pt2").module()
    pre = meta["preprocessing"]

    image = Image.open(image_path).convert("RGB")
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(image.height, image.width, 3)
    x = pixels.permute(2, 0, 1).unsqueeze(0)  # 1 x 3 x H x W uint8, RGB
    # As torchvision's Resize(int) + CenterCrop on uint8 (the evaluation transform of training): short side to
    # pre["resize"], then the central pre["crop"] square, then [0, 1] floats normalised by mean and std.
    (h, w), side = x.shape[-2:], pre["resize"]
    size = [side, int(side * w / h)] if h <= w else [int(side * h / w), side]
    x = F.interpolate(x, size=size, mode=pre["interpolation"], antialias=True, align_corners=False)
    top, left = round((x.shape[-2] - pre["crop"]) / 2), round((x.shape[-1] - pre["crop"]) / 2)
    x = x[..., top:top + pre["crop"], left:left + pre["crop"]].float() / 255
    x = (x - torch.tensor(pre["mean"]).view(1, 3, 1, 1)) / torch.tensor(pre["std"]).view(1, 3, 1, 1)
    with torch.no_grad():
        probs = model(x).softmax(dim=1)[0]
    for p, i in zip(*probs.topk(min(5, len(probs)))):
        print(f"{meta['class_names'][i]}: {p:.3f}")
    # --- end ---

Any batch size works (the batch dimension is dynamic). model.onnx takes the same input ("images", float32 NCHW) in
onnxruntime: `onnxruntime.InferenceSession("model.onnx").run(None, {"images": x.numpy()})[0]`.
"""

import argparse
import copy
import importlib
import inspect
import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence

import lightning as L
import torch
import yaml
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from project.run.checkpoint_io import load_trusted_format
from project.data.transforms import IMAGENET_MEAN, IMAGENET_STD

PREPROCESSING_KEYS = ("resize", "crop", "mean", "std")


def _importable(*names: str) -> bool:
    try:
        for name in names:
            importlib.import_module(name)
    except ImportError:
        return False
    return True


def onnx_available() -> bool:
    """torch.onnx's exporter needs both onnx and onnxscript."""
    return _importable("onnx", "onnxscript")


def _check_close(name: str, got: torch.Tensor, expected: torch.Tensor, atol: float) -> None:
    difference = (got.float() - expected.float()).abs().max().item()
    if got.shape != expected.shape or not math.isfinite(difference) or difference > atol:
        raise RuntimeError(
            f"the exported {name} does not reproduce the network: logits differ by up to {difference:.3g} "
            f"(shape {tuple(got.shape)} vs {tuple(expected.shape)}, allowed {atol:g}); the network may branch on "
            "its input or on global state, which export fixes at trace time"
        )


def _export_onnx(program: torch.export.ExportedProgram, example: torch.Tensor, path: Path, eager: nn.Module) -> bool:
    """Write model.onnx from the exported program; check it with onnxruntime when installed (True if checked)."""
    torch.onnx.export(program, (example,), str(path), dynamo=True, input_names=["images"], output_names=["logits"],
                      verbose=False)
    if not _importable("onnxruntime"):
        return False
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (example, example[:1]):
        logits = torch.from_numpy(session.run(None, {"images": batch.numpy()})[0])
        with torch.no_grad():
            _check_close("ONNX model", logits, eager(batch), atol=1e-4)
    return True


def export_network(
    network: nn.Module,
    out_dir: str | Path,
    *,
    example: torch.Tensor,
    class_names: Sequence[str],
    preprocessing: dict[str, Any],
    onnx: bool = True,
    arch: Optional[str] = None,
    atol: float = 1e-5,
) -> dict[str, Path]:
    """Write model.pt2 (batch dimension dynamic), model.onnx (if `onnx` and the onnx packages are installed) and
    model.json into out_dir, after checking the saved program's logits against the eager network's on `example`.

    example: a float32 NCHW batch, preprocessed as the network expects (its values matter only for the check).
    preprocessing: resize, crop, mean, std (and optionally interpolation) of the evaluation transform.
    """
    missing = [key for key in PREPROCESSING_KEYS if key not in preprocessing]
    if missing:
        raise ValueError(f"preprocessing lacks {missing}: expected the keys {list(PREPROCESSING_KEYS)}")
    if example.ndim != 4 or example.shape[1] != 3:
        raise ValueError(f"example must be an N x 3 x H x W batch, got shape {tuple(example.shape)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # A CPU float32 copy in eval mode: the caller's network keeps its device and mode, the program runs anywhere.
    eager = copy.deepcopy(network).cpu().float().eval()
    example = example.detach().cpu().float()
    if example.shape[0] < 2:
        example = example.expand(2, -1, -1, -1).contiguous()  # torch.export specialises a batch of 1
    with torch.no_grad():
        expected = eager(example)
    if expected.ndim != 2 or expected.shape[1] != len(class_names):
        raise ValueError(
            f"the network gives logits of shape {tuple(expected.shape)} for {len(class_names)} class names"
        )

    program = torch.export.export(eager, (example,), dynamic_shapes=({0: torch.export.Dim("batch", min=1)},))
    files = {"pt2": out_dir / "model.pt2"}
    torch.export.save(program, files["pt2"])
    reloaded = torch.export.load(files["pt2"]).module()
    with torch.no_grad():
        _check_close("program (model.pt2)", reloaded(example), expected, atol)
        _check_close("program (model.pt2) at batch 1", reloaded(example[:1]), eager(example[:1]), atol)

    onnx_checked = None
    if onnx and onnx_available():
        files["onnx"] = out_dir / "model.onnx"
        onnx_checked = _export_onnx(program, example, files["onnx"], eager)
    elif onnx:
        rank_zero_info("model.onnx skipped: `pip install onnx onnxscript` (and onnxruntime to check it) to write it")

    files["json"] = out_dir / "model.json"
    files["json"].write_text(json.dumps({
        "arch": arch or f"{type(network).__module__}.{type(network).__qualname__}",
        "num_classes": len(class_names),
        "class_names": list(class_names),
        "input": {"name": "images", "layout": "NCHW", "dtype": "float32", "channels": "RGB",
                  "values": "pixel / 255, then (x - mean) / std per channel"},
        "preprocessing": {"interpolation": "bilinear", **preprocessing},
        "files": {kind: path.name for kind, path in files.items() if kind != "json"},
        "checked": {"pt2_atol": atol, "onnx_atol": 1e-4 if onnx_checked else None},
        "torch_version": torch.__version__,
    }, indent=2) + "\n")
    rank_zero_info(f"exported {', '.join(p.name for p in files.values())} to {out_dir}")
    return files


def load_exported(folder: str | Path) -> tuple[nn.Module, dict[str, Any]]:
    """The exported network (a callable nn.Module) and its model.json, with torch alone (no project, no Lightning)."""
    folder = Path(folder)
    return torch.export.load(folder / "model.pt2").module(), json.loads((folder / "model.json").read_text())


def export_module(model, datamodule, out_dir: str | Path, *, onnx: bool = True) -> dict[str, Path]:
    """Export an ImageClassifier's network with the data module's class names and evaluation preprocessing.

    The recommended entry point: the caller builds both (from a run's config and checkpoint, or in a notebook).
    """
    from project.callbacks.prediction_writer import class_names_of

    network = model.network
    crop = datamodule.hparams.eval_crop_size
    torchvision_net = type(network).__module__.startswith("torchvision.")
    generator = torch.Generator().manual_seed(0)
    return export_network(
        network,
        out_dir,
        example=torch.randn(2, 3, crop, crop, generator=generator),  # normalised-image-like values for the check
        class_names=class_names_of(datamodule, model.hparams.get("num_classes")),
        preprocessing={"resize": datamodule.hparams.eval_resize_size, "crop": crop, "interpolation": "bilinear",
                       "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)},
        onnx=onnx,
        arch=model.hparams.get("arch") if torchvision_net else None,
    )


def build_from_run(ckpt_path: Path, config: Path):
    """The run's ImageClassifier and data module from its saved config, with the checkpoint's weights loaded."""
    from project.cli import cli_main

    settings = yaml.safe_load(config.read_text())
    # The saved config is `fit`'s: the options LightningCLI made of Trainer.fit's arguments (ckpt_path, weights_only)
    # do not exist without a subcommand. It skips the model, data module and loaders (those are sections, or none).
    for option in set(inspect.signature(L.Trainer.fit).parameters) - LightningCLI.subcommands()["fit"]:
        settings.pop(option, None)
    settings["trainer"] = {**(settings.get("trainer") or {}), "accelerator": "cpu", "devices": 1, "logger": False}
    cli = cli_main(settings, run=False)
    # With EMA the checkpoint's state_dict holds the averaged weights: those are the ones exported.
    state = load_trusted_format(ckpt_path)["state_dict"]
    cli.model.load_state_dict(state)
    return cli.model, cli.datamodule


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Path]:
    """`python -m project.export`: export a run's checkpoint next to it (RUN/export/ by default)."""
    parser = argparse.ArgumentParser(prog="python -m project.export", description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt_path", type=Path, required=True, help="RUN/checkpoints/best.ckpt or last.ckpt")
    parser.add_argument("--config", type=Path, help="the run's config.yaml (default: RUN/config.yaml)")
    parser.add_argument("--out_dir", type=Path, help="where to write (default: RUN/export)")
    parser.add_argument("--onnx", action=argparse.BooleanOptionalAction, default=True, help="also write model.onnx")
    args = parser.parse_args(argv)
    if not args.ckpt_path.is_file():
        parser.error(f"--ckpt_path {args.ckpt_path} is not a file")
    run_dir = args.ckpt_path.resolve().parent.parent  # RUN/checkpoints/x.ckpt
    config = args.config or run_dir / "config.yaml"
    if not config.is_file():
        parser.error(f"no config at {config}: pass --config RUN/config.yaml, the config the run saved")
    model, datamodule = build_from_run(args.ckpt_path, config)
    return export_module(model, datamodule, args.out_dir or run_dir / "export", onnx=args.onnx)


if __name__ == "__main__":
    from project.errors import exit_on_user_error

    exit_on_user_error(main)
