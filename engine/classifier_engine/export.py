"""Export a network for use without this package: model.pt2, model.onnx, model.json (docs/how-it-works.md#export).

    python -m classifier_engine export --ckpt_path RUN/checkpoints/last.ckpt [--config RUN/config.yaml] [--out_dir DIR]
    python tools/preprocess.py RUN/export cat.jpg        # run it: torch, torchvision and Pillow only
"""

import argparse
import copy
import importlib.util
import inspect
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from classifier_engine import contract
from classifier_engine.contract import display_names, eval_preprocessing
from classifier_engine.errors import ConfigError, UserError, install_extra, load_config_file
from classifier_engine.run.checkpoint_checks import check_checkpoint_fits
from classifier_engine.run.checkpoint_io import load_checkpoint
from classifier_engine.run_plan import Decision, RunPlan

PREPROCESSING_KEYS = ("resize", "crop", "mean", "std")
# What an export writes besides model.json, by kind (model.onnx keeps its weights in model.onnx.data, beside it).
EXPORT_FILES = {"pt2": "model.pt2", "onnx": "model.onnx", "onnx_data": "model.onnx.data"}


class ExportCheckError(UserError, RuntimeError):
    """An exported file does not give the network's logits back; nothing was written."""


def onnx_available() -> bool:
    return all(importlib.util.find_spec(name) for name in ("onnx", "onnxscript"))  # torch.onnx's exporter needs both


def _check_close(file: str, got: torch.Tensor, expected: torch.Tensor, rtol: float, out_dir: Path) -> dict[str, float]:
    """Compare the logits relative to their scale: max |got - expected| <= rtol * max(1, max |expected|)."""
    scale = max(1.0, expected.abs().max().item())
    difference = (got.float() - expected.float()).abs().max().item() if got.shape == expected.shape else math.inf
    if not math.isfinite(difference) or difference > rtol * scale:
        shapes = "" if got.shape == expected.shape else f", shape {tuple(got.shape)} for {tuple(expected.shape)}"
        raise ExportCheckError(f"the exported {file} does not reproduce the network: logits differ by up to "
                               f"{difference:.3g}, {difference / scale:.2g} of the largest logit {scale:.3g} (allowed "
                               f"{rtol:g}{shapes}); nothing was written to {out_dir}. The network may branch on its "
                               "input or on global state, which export fixes at trace time")
    return {"max_difference": difference, "max_abs_logit": scale, "rtol": rtol}


def _check_file(file: str, run: Callable[[torch.Tensor], torch.Tensor], eager: nn.Module, example: torch.Tensor,
                expected: torch.Tensor, rtol: float, out_dir: Path) -> dict[str, float]:
    """`run` (an exported file) checked against the reference logits and at batch 1; model.json records the worse."""
    with torch.no_grad():
        checks = [_check_close(file, run(example), expected, rtol, out_dir),
                  _check_close(f"{file} (at batch 1)", run(example[:1]), eager(example[:1]), rtol, out_dir)]
    return max(checks, key=lambda check: check["max_difference"] / check["max_abs_logit"])


def _export_onnx(program: torch.export.ExportedProgram, example: torch.Tensor, expected: torch.Tensor, path: Path,
                 eager: nn.Module, rtol: float, out_dir: Path) -> Optional[dict[str, float]]:
    """Write model.onnx (and model.onnx.data) from the exported program; check it in onnxruntime when installed."""
    torch.onnx.export(program, (example,), str(path), dynamo=True, input_names=["images"], output_names=["logits"],
                      verbose=False)
    if importlib.util.find_spec("onnxruntime") is None:
        return None
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return _check_file(path.name, lambda batch: torch.from_numpy(session.run(None, {"images": batch.numpy()})[0]),
                       eager, example, expected, rtol, out_dir)


def _publish(staging: Path, out_dir: Path) -> None:
    """Move the checked files into out_dir, model.json last; files of an earlier export that this one lacks go."""
    # From here until the new model.json lands, out_dir holds no claim of a complete export.
    (out_dir / "model.json").unlink(missing_ok=True)
    for stale in EXPORT_FILES.values():
        if not (staging / stale).exists():
            (out_dir / stale).unlink(missing_ok=True)
    for file in sorted(staging.iterdir(), key=lambda f: f.name == "model.json"):
        os.replace(file, out_dir / file.name)


def _eager_reference(network: nn.Module, example: torch.Tensor, preprocessing: dict[str, Any],
                     num_classes: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A CPU float32 eval copy of the network, the example batch (>= 2: export specialises 1) and its logits."""
    missing = [key for key in PREPROCESSING_KEYS if key not in preprocessing]
    if missing:
        raise ValueError(f"preprocessing lacks {missing}: expected the keys {list(PREPROCESSING_KEYS)}")
    if example.ndim != 4 or example.shape[1] != 3:
        raise ValueError(f"example must be an N x 3 x H x W batch, got shape {tuple(example.shape)}")
    eager = copy.deepcopy(network).cpu().float().eval()
    example = example.detach().cpu().float()
    if example.shape[0] < 2:
        example = example.expand(2, -1, -1, -1).contiguous()
    with torch.no_grad():
        expected = eager(example)
    if expected.ndim != 2 or expected.shape[1] != num_classes:
        raise ValueError(f"the network gives logits of shape {tuple(expected.shape)} for {num_classes} class names")
    if not torch.isfinite(expected).all():
        raise ExportCheckError("the network's logits are not finite (inf or nan) on an ordinary input: its weights "
                               "diverged; export a checkpoint from before the loss did (RUN/checkpoints/)")
    return eager, example, expected


def export_network(network: nn.Module, out_dir: str | Path, *, example: torch.Tensor, class_names: Sequence[str],
                   preprocessing: dict[str, Any], onnx: bool = True, rtol: float = 1e-5,
                   onnx_rtol: float = 1e-4) -> dict[str, Path]:
    """Write model.pt2, model.onnx (if `onnx` and installed) and model.json into out_dir once their logits on `example`
    (a preprocessed NCHW batch) match the eager network's within rtol (onnx_rtol) of max(1, the largest eager logit)."""
    out_dir = Path(out_dir)
    eager, example, expected = _eager_reference(network, example, preprocessing, len(class_names))
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".export-", suffix=".partial", dir=out_dir))
    try:
        program = torch.export.export(eager, (example,), dynamic_shapes=({0: torch.export.Dim("batch", min=1)},))
        torch.export.save(program, staging / "model.pt2")
        reloaded = torch.export.load(staging / "model.pt2").module()
        checked = {"pt2": _check_file("model.pt2", reloaded, eager, example, expected, rtol, out_dir), "onnx": None}
        if onnx and onnx_available():
            checked["onnx"] = _export_onnx(program, example, expected, staging / "model.onnx", eager, onnx_rtol,
                                           out_dir)
        elif onnx:
            rank_zero_info(f"model.onnx skipped: onnx and onnxscript are not installed ({install_extra('export')})")
        written = {kind: name for kind, name in EXPORT_FILES.items() if (staging / name).exists()}
        (staging / "model.json").write_text(json.dumps({
            "module": f"{type(network).__module__}.{type(network).__qualname__}",
            "num_classes": len(class_names),
            "class_names": list(class_names),
            "input": {"name": "images", "layout": "NCHW", "dtype": "float32", "channels": "RGB",
                      "values": "pixel / 255, then (x - mean) / std per channel",
                      "checked_size": list(example.shape[2:])},  # resize and crop null: images come at this size
            "preprocessing": {"interpolation": "bilinear", **preprocessing},
            "files": written,
            # Each file's largest logit difference from the eager network, and the rule it passed.
            "checked": {**checked, "rule": "max |exported - eager| <= rtol * max(1, max |eager|)"},
            "torch_version": torch.__version__,
        }, indent=2) + "\n")
        _publish(staging, out_dir)
    except BaseException:
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    files = {kind: out_dir / name for kind, name in {**written, "json": "model.json"}.items()}
    rank_zero_info(f"exported {', '.join(p.name for p in files.values())} to {out_dir}")
    return files


def export_module(model, datamodule, out_dir: str | Path, *, onnx: bool = True) -> dict[str, Path]:
    """Export a model's network (contract.exportable) with its data module's class names and eval_preprocessing()."""
    offered = eval_preprocessing(datamodule)
    network, hparams = contract.exportable(model), getattr(model, "hparams", {})
    if offered is not None:
        crop, preprocessing = (offered.crop, offered.crop), offered.as_dict()
    else:  # the contract's default: pixels in [0, 1] at the size the data module's validation images have
        crop, preprocessing = validation_size(datamodule), {"resize": None, "crop": None, "mean": [0.0, 0.0, 0.0],
                                                            "std": [1.0, 1.0, 1.0]}
    example = torch.randn(2, 3, *crop, generator=torch.Generator().manual_seed(0))
    return export_network(network, out_dir, example=example, preprocessing=preprocessing, onnx=onnx,
                          class_names=display_names(datamodule, hparams.get("num_classes")))


def validation_size(datamodule) -> tuple[int, int]:
    """(height, width) of the data module's first validation batch: the input size of an export without
    eval_preprocessing() (the module's own loaders say what the network was trained on)."""
    datamodule.setup("validate")
    images = next(iter(datamodule.val_dataloader()))[0]
    if not (isinstance(images, torch.Tensor) and images.ndim == 4 and images.shape[1] == 3):
        raise ConfigError(f"data module {type(datamodule).__qualname__} offers no eval_preprocessing() and its "
                          f"validation batches are not N x 3 x H x W images: add eval_preprocessing() (the contract)")
    return int(images.shape[2]), int(images.shape[3])


def run_settings(config: Path, trusted: Sequence[str] = ()) -> dict[str, Any]:
    """The run's saved config as an export builds it: its model and data (a config from an object store may name only
    the `trusted` classes, the entry point's), no Trainer of the run's (callbacks, loggers, plugins)."""
    from classifier_engine.run.stored_config import check_stored_config

    settings = load_config_file(config)
    # The saved config is `fit`'s: the options LightningCLI made of Trainer.fit's arguments (ckpt_path, weights_only)
    # do not exist without a subcommand. It skips the model, data module and loaders (those are sections, or none).
    for option in set(inspect.signature(L.Trainer.fit).parameters) - LightningCLI.subcommands()["fit"]:
        settings.pop(option, None)
    settings["trainer"] = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_progress_bar": False}
    check_stored_config(settings, config, trusted)
    return settings


def export_plan(ckpt_path: Path, config: Path, given_config: bool, out_dir: Path, onnx: bool,
                trusted: Sequence[str], defaults: Mapping[str, Optional[type]] = {}) -> RunPlan:
    """What an export would read, build and write (--plan): read only."""
    checkpoint = load_checkpoint(ckpt_path, mmap=True)
    settings = run_settings(config, trusted)
    classes = {part: (settings.get(part) or {}).get("class_path") or (f"{cls.__module__}.{cls.__qualname__}" if (
        cls := defaults.get(part)) else None) for part in ("model", "data")}
    files = [*EXPORT_FILES.values()][: 3 if onnx and onnx_available() else 1] + ["model.json"]
    present = [name for name in files if (out_dir / name).exists()]
    return RunPlan("export", (
        Decision("checkpoint", str(ckpt_path), "--ckpt_path", text=f"{ckpt_path} (epoch {checkpoint.get('epoch')}, "
                 f"step {checkpoint.get('global_step')})"),
        Decision("config", str(config), "--config" if given_config else "the run's config.yaml beside the checkpoint"),
        Decision("classes", classes, "the config's (the entry point's defaults where it names none)"),
        Decision("out dir", str(out_dir), f"replacing its {', '.join(present)}" if present else "new files"),
        Decision("files", files, "each checked against the checkpoint's network before any is written" + (
            "" if "model.onnx" in files else "; model.onnx: --no-onnx, or onnx and onnxscript not installed"),
            text=", ".join(files))))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ConfigError(f"export: {message} (see {self.prog} --help)")  # one line, not argparse's usage block


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m classifier_engine",
         trusted: Sequence[str] = (), model: Optional[type] = None, data: Optional[type] = None) -> dict[str, Path]:
    """`PROG export`: export a run's checkpoint next to it (RUN/export/ by default); `model`, `data`: the entry point's
    classes, built for a config that names none (not its passes: a run's saved config holds what they decided)."""
    parser = _Parser(prog=f"{prog} export", description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt_path", type=Path, required=True, help="RUN/checkpoints/best.ckpt or last.ckpt")
    parser.add_argument("--config", type=Path, action="append", help="the run's config.yaml (default: RUN/config.yaml)")
    parser.add_argument("--out_dir", type=Path, help="where to write (default: RUN/export)")
    parser.add_argument("--onnx", action=argparse.BooleanOptionalAction, default=True, help="also write model.onnx")
    parser.add_argument("--plan", action="store_true", help="print what it would read, build and write, and exit")
    args = parser.parse_args(argv)
    if not args.ckpt_path.is_file():
        parser.error(f"--ckpt_path {args.ckpt_path} is not a file: pass a run's checkpoint, RUN/checkpoints/last.ckpt")
    run_dir = args.ckpt_path.resolve().parent.parent  # RUN/checkpoints/x.ckpt
    if len(args.config or ()) > 1:
        parser.error(f"--config given {len(args.config)} times: export reads one, the run's saved config.yaml (what "
                     "its configs composed); pass that one")
    config = args.config[0] if args.config else run_dir / "config.yaml"
    if not config.is_file():
        parser.error(f"no config at {config}: pass --config RUN/config.yaml, the config the run saved")
    out_dir = args.out_dir or run_dir / "export"
    if out_dir.exists() and not out_dir.is_dir():
        parser.error(f"--out_dir {out_dir} is a file: pass a folder (new, or one to write the files into)")
    if args.plan:
        plan = export_plan(args.ckpt_path, config, args.config is not None, out_dir, args.onnx, trusted,
                           {"model": model, "data": data})
        print("\n".join(["plan of export (dry: nothing was built, written or downloaded):",
                         *(f"  {line}" for line in plan.lines())]), flush=True)
        return {}
    from classifier_engine.cli import cli_main

    cli = cli_main(run_settings(config, trusted), run=False, model=model, data=data)
    checkpoint = load_checkpoint(args.ckpt_path)
    check_checkpoint_fits(args.ckpt_path, checkpoint, cli.model, cli.datamodule)  # (one line, as a fit's)
    cli.model.load_state_dict(checkpoint["state_dict"])  # EMA's averaged weights, if any
    return export_module(cli.model, cli.datamodule, out_dir, onnx=args.onnx)
