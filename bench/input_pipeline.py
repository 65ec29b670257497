"""Input pipeline images/s per core: stock torchvision (PIL + transforms v1) against ours, train and eval, in one run.

    python bench/input_pipeline.py              # 256 generated ImageNet-like JPEGs, 5 rounds, ~1 min on 2 cores
    python bench/input_pipeline.py --quick      # 24 images, 2 rounds: the CI smoke run, ~5 s after imports

One process, one thread: images per CPU-second of the process, so other jobs on the machine slow the wall clock but
barely the figures; pipelines alternate on the same files each round and the ratio is the median of the per-round ratios.
"ours" is the data module's default: torchvision.io decode and v2 on uint8 tensors in the workers, collated; the GPU
then normalizes the batch. "ours + batch normalize on the CPU" is the same where there is no GPU (a CPU-only run);
"float per image" is data.normalize_on_device=false. Every row decodes, crops, flips (train) and collates batches of
64 with default_collate into shared memory, as a DataLoader worker does (float tensors for the stock and float
rows, uint8 for ours).
Results with the exact command: docs/benchmarks.md, "Input pipeline".
"""

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import PIL
import torch
import torchvision
from PIL import Image
import torch.utils.data._utils.worker as dataloader_worker
from torch.utils.data import default_collate
from torchvision import transforms as v1
from torchvision.datasets.folder import pil_loader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from project.data.decoders import decode_torchvision  # noqa: E402
from project.data.device_decode import DeviceDecoder, EncodedBatch, load_for_device  # noqa: E402
from project.data.device_normalize import split_normalize  # noqa: E402
from project.data.transforms import IMAGENET_MEAN, IMAGENET_STD, eval_preset, train_preset  # noqa: E402

# ImageNet's commonest shapes (landscape and portrait 4:3, 3:2), jittered: "around 500x375".
SHAPES = [(500, 375), (375, 500), (500, 333), (500, 400), (333, 500), (640, 480)]
BATCH = 64  # images per collated batch (and per NormalizeBatch call)


def photo_like(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """Smooth colour regions + texture + noise: compresses like a photo (~90 KB at 500x375, quality 90)."""
    low = rng.integers(0, 256, (int(rng.integers(3, 9)), int(rng.integers(3, 9)), 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(low).resize((width, height), Image.BICUBIC), dtype=np.float32)
    grain = rng.integers(0, 256, (height // 2 + 1, width // 2 + 1, 3), dtype=np.uint8)
    texture = np.asarray(Image.fromarray(grain).resize((width, height), Image.BILINEAR), dtype=np.float32)
    pixels = 0.6 * base + 0.4 * texture + rng.normal(0, 8, (height, width, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def generate(folder: Path, count: int, seed: int = 0) -> list[Path]:
    """count JPEGs in folder/, reused when already there."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        width, height = SHAPES[i % len(SHAPES)]
        jitter = float(rng.uniform(0.85, 1.15))
        path = folder / f"img_{i:05d}.JPEG"
        if not path.exists():
            photo_like(rng, int(width * jitter), int(height * jitter)).save(path, quality=90)
        paths.append(path)
    return paths


@contextlib.contextmanager
def collating_as_a_worker():
    """Inside a DataLoader worker default_collate stacks each batch into fresh shared memory, to hand it to the main
    process; it checks get_worker_info(), which this sets for the measurement (float batches pay more: 4x the bytes)."""
    saved = dataloader_worker._worker_info
    dataloader_worker._worker_info = dataloader_worker.WorkerInfo(id=0, num_workers=1, seed=0, dataset=None)
    try:
        yield
    finally:
        dataloader_worker._worker_info = saved


def pipelines(crop: int, resize: int, device: str | None = None) -> dict[str, dict[str, callable]]:
    """{preset: {pipeline: function(list of paths) -> None}}, each doing all of its CPU work for those files."""
    normalize = v1.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    stock = {
        "train": v1.Compose([v1.RandomResizedCrop(crop), v1.RandomHorizontalFlip(), v1.ToTensor(), normalize]),
        "eval": v1.Compose([v1.Resize(resize), v1.CenterCrop(crop), v1.ToTensor(), normalize]),
    }
    float_presets = {"train": train_preset(crop_size=crop), "eval": eval_preset(resize_size=resize, crop_size=crop)}
    table = {}
    for preset in ("train", "eval"):
        uint8_preset, normalize_batch = split_normalize(float_presets[preset])

        def run_stock(paths, t=stock[preset]):
            for start in range(0, len(paths), BATCH):
                default_collate([(t(pil_loader(str(p))), 0) for p in paths[start : start + BATCH]])

        def run_tv_float(paths, t=float_presets[preset]):
            for start in range(0, len(paths), BATCH):
                default_collate([(t(decode_torchvision(str(p))), 0) for p in paths[start : start + BATCH]])

        def run_ours(paths, t=uint8_preset):
            for start in range(0, len(paths), BATCH):
                default_collate([(t(decode_torchvision(str(p))), 0) for p in paths[start : start + BATCH]])

        def run_ours_cpu(paths, t=uint8_preset, norm=normalize_batch):
            for start in range(0, len(paths), BATCH):
                norm(default_collate([(t(decode_torchvision(str(p))), 0) for p in paths[start : start + BATCH]])[0])

        table[preset] = {"stock PIL + v1": run_stock, "torchvision.io + v2, float per image": run_tv_float,
                         "ours": run_ours, "ours + batch normalize on the CPU": run_ours_cpu}
        if device is not None:
            decoder = DeviceDecoder(uint8_preset, uint8_preset)

            def run_device(paths, decoder=decoder, norm=normalize_batch, training=preset == "train"):
                for start in range(0, len(paths), BATCH):
                    chunk = [str(p) for p in paths[start : start + BATCH]]
                    batch = EncodedBatch([load_for_device(p) for p in chunk], torch.zeros(len(chunk), dtype=torch.long), chunk)
                    images, _ = decoder(batch, torch.device(device), training=training)
                    norm(images)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()

            table[preset][f"decode + augment on {device}"] = run_device
    return table


def measure(paths: list[Path], rounds: int, crop: int, resize: int, device: str | None = None) -> dict:
    torch.set_num_threads(1)
    results = {}
    for preset, runs in pipelines(crop, resize, device).items():
        for run in runs.values():
            run(paths[:4])  # warm-up: first-call allocations, lazy imports
        per_round = {name: [] for name in runs}
        wall = {name: 0.0 for name in runs}
        for _ in range(rounds):
            for name, run in runs.items():
                cpu0, wall0 = time.process_time(), time.perf_counter()
                with collating_as_a_worker():
                    run(paths)
                per_round[name].append(len(paths) / (time.process_time() - cpu0))
                wall[name] += time.perf_counter() - wall0
        stock = per_round[next(iter(runs))]
        results[preset] = {
            name: {
                "img_per_cpu_s": round(statistics.median(rates), 1),
                "img_per_wall_s": round(len(paths) * rounds / wall[name], 1),
                "ratio_vs_stock": round(statistics.median(r / s for r, s in zip(rates, stock)), 3),
            }
            for name, rates in per_round.items()
        }
    return results


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores visible"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/input_pipeline.py", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="24 images, 2 rounds: a smoke run")
    parser.add_argument("--images", type=int, default=256, help="generated JPEGs")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per pipeline")
    parser.add_argument("--data", type=Path, default=Path(os.environ.get("PROJECT_DATA_CACHE", Path.home() / ".cache" / "project"))
                        / "bench-jpegs", help="folder for the generated JPEGs (reused)")
    parser.add_argument("--crop", type=int, default=224)
    parser.add_argument("--resize", type=int, default=256)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--device-decode", metavar="DEVICE", help="add decoder=nvjpeg's path on DEVICE (cuda: nvJPEG); "
                        "its img/s per core counts the CPU work only, the wall figure includes the device's")
    args = parser.parse_args(argv)
    images, rounds = (24, 2) if args.quick else (args.images, args.rounds)
    paths = generate(args.data, images)
    sizes = [Image.open(p).size for p in paths]
    info = {
        "command": "python bench/input_pipeline.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "versions": {"torch": torch.__version__, "torchvision": torchvision.__version__, "pillow": PIL.__version__},
        "images": images, "rounds": rounds,
        "mean_size": f"{np.mean([w for w, _ in sizes]):.0f}x{np.mean([h for _, h in sizes]):.0f}",
        "mean_kb": round(float(np.mean([p.stat().st_size for p in paths])) / 1e3, 1),
    }
    results = measure(paths, rounds, args.crop, args.resize, args.device_decode)
    print(f"{info['command']}\n{info['machine']}; {images} JPEGs, mean {info['mean_size']}, {info['mean_kb']} KB; "
          f"{rounds} rounds; one thread")
    print("| preset | pipeline | img/s per core (CPU time) | img/s (wall) | ratio vs stock |\n|---|---|---|---|---|")
    for preset, rows in results.items():
        for name, row in rows.items():
            print(f"| {preset} | {name} | {row['img_per_cpu_s']} | {row['img_per_wall_s']} | {row['ratio_vs_stock']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({**info, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
