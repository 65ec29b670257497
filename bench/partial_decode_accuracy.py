"""Does decoding only what the crop keeps move a training run's accuracy? ResNet-18 at 224 px on generated JPEGs,
decoded whole (data.decoder=torchcodec) against in part (nvimgcodec), same seed; a second seed decoded whole gives the
run-to-run spread to read the difference against.

    python bench/partial_decode_accuracy.py      # 4 classes x 64 train / 24 val JPEGs, 3 epochs; ~12 min on 2 cores

Half the images are ImageNet-shaped (~500x375: a 224 crop is decoded as its region, bit-identical to the whole decode),
half 1024x768 (most crops decode at a DCT scale, within the documented tolerance). Classes differ by tint and by the
direction of a fine texture, which a DCT-scaled decode blurs first. Results: docs/benchmarks.md, "Decoders".
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from project import cli_main  # noqa: E402

TINTS = [(40, 0, 0), (0, 40, 0), (0, 0, 40), (30, 30, 0)]


def image(rng: np.random.Generator, label: int, width: int, height: int) -> Image.Image:
    """Smooth blobs + grain + a tint and a 3-px stripe texture (vertical or horizontal) that carry the class."""
    coarse = rng.integers(0, 200, size=(max(2, height // 48), max(2, width // 48), 3), dtype=np.uint8)
    pixels = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC), dtype=np.float32)
    stripes = 12 * np.sin(np.arange(width if label % 2 else height) * 2 * np.pi / 3)
    pixels += stripes[None, :, None] if label % 2 else stripes[:, None, None]
    pixels += np.array(TINTS[label]) + rng.normal(0, 10, pixels.shape)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def write(root: Path, train: int, val: int) -> Path:
    rng = np.random.default_rng(0)
    for split, count in (("train", train), ("val", val)):
        for label in range(len(TINTS)):
            folder = root / split / f"class{label}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                scale = float(rng.uniform(0.9, 1.1))
                size = (500, 375) if i % 2 else (1024, 768)
                image(rng, label, int(size[0] * scale), int(size[1] * scale)).save(folder / f"{i:04d}.JPEG", quality=90)
    return root


def fit(root: Path, run_dir: Path, decoder: str, seed: int, epochs: int) -> dict[str, float]:
    args = ["fit", "--config", "configs/quickstart.yaml", f"--data.root={root}", f"--data.decoder={decoder}",
            f"--seed_everything={seed}", f"--trainer.max_epochs={epochs}", f"--trainer.default_root_dir={run_dir}",
            "--trainer.enable_progress_bar=false", "--data.batch_size=16", "--data.train_crop_size=224",
            "--data.train_crop_scale=[0.25, 1.0]", "--data.hflip_prob=0.5", "--data.eval_resize_size=256",
            "--data.eval_crop_size=224", "--model.optim.lr_per_256=0.4"]
    cli = cli_main(args)
    return {key: round(float(value), 4) for key, value in cli.trainer.callback_metrics.items() if key.startswith("val")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/partial_decode_accuracy.py", description=__doc__.split("\n")[0])
    parser.add_argument("--train", type=int, default=64, help="training images per class")
    parser.add_argument("--val", type=int, default=24, help="validation images per class")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="partial_decode_accuracy_"))
    root = write(work / "data", args.train, args.val)
    arms = {"decoded whole (torchcodec), seed 0": ("torchcodec", 0), "in part (nvimgcodec), seed 0": ("nvimgcodec", 0),
            "decoded whole (torchcodec), seed 1": ("torchcodec", 1)}
    results = {name: fit(root, work / f"{decoder}-{seed}", decoder, seed, args.epochs)
               for name, (decoder, seed) in arms.items()}
    print("| run | val/acc1 | val/loss |\n|---|---|---|")
    for name, metrics in results.items():
        print(f"| {name} | {metrics.get('val/acc1')} | {metrics.get('val/loss')} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
