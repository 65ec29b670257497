"""Input pipeline images/s per core: stock torchvision (PIL + transforms v1) against ours with each decoder.

    python bench/input_pipeline.py              # 256 generated ImageNet-like JPEGs, 5 rounds, ~2 min on 2 cores
    python bench/input_pipeline.py --quick      # 24 images, 2 rounds: the CI smoke run, ~10 s after imports

One process, one thread: images per CPU-second of the process, so other jobs on the machine slow the wall clock but
barely the figures; pipelines alternate on the same files each round and the ratio is the median of the per-round ratios
against the first row of its preset (stock PIL + v1; for "decode", PIL's decode alone).
"decode" rows decode only, with each CPU decoder installed here (pil, torchvision, torchcodec). "ours, decoder=X" is
the data module's path with that decoder: decode and v2 on uint8 in the workers, collated; the GPU then normalizes the
batch. "ours + batch normalize on the CPU" is the same where there is no GPU (a CPU-only run), with data.decoder=auto's
choice; "float per image" is data.normalize_on_device=false. Every train/eval row decodes, crops, flips (train) and
collates batches of 64 with default_collate into shared memory, as a DataLoader worker does (float tensors for the
stock and float rows, uint8 for ours).
Results with the exact command: docs/benchmarks.md, "Input pipeline".
"""

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.utils.data._utils.worker as dataloader_worker
from PIL import Image
from torch.utils.data import default_collate
from torchvision import transforms as v1
from torchvision.datasets.folder import pil_loader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))
from classifier_engine.data.decoders import DEVICE_DECODERS, LOADERS, image_loader, unavailable  # noqa: E402
from classifier_engine.data.device_decode import DevicePipeline, TrainCrop, load_for_device  # noqa: E402
from classifier_engine.data.image_folders import EncodedBatch  # noqa: E402
from classifier_engine.data.transforms import IMAGENET_MEAN, IMAGENET_STD, NormalizeBatch, eval_preset, train_preset  # noqa: E402

from decode_libraries import library_rows  # noqa: E402

VERSIONS = ("torch", "torchvision", "pillow", "torchcodec", "nvidia-nvimgcodec-cu13", "simplejpeg",
            "nvidia-dali-cuda130")
# Today's pipeline (before partial decoding: data.decoder=auto decoded whole with TorchCodec) and its plain decode.
WHOLE = "torchcodec" if unavailable("torchcodec") is None else "torchvision"
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


def decoders_here() -> list[str]:
    """The CPU decoders this environment has, in data.decoder=auto's order (nvimgcodec, torchcodec: optional extras)."""
    return [name for name in LOADERS if unavailable(name) is None]


def pipelines(crop: int, small_crop: int, resize: int, device: str | None = None) -> dict[str, dict[str, callable]]:
    """{preset: {pipeline: function(list of paths) -> None}}, each doing all of its CPU work for those files."""
    normalize = v1.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    stock = {
        "train": v1.Compose([v1.RandomResizedCrop(crop), v1.RandomHorizontalFlip(), v1.ToTensor(), normalize]),
        "train_small": v1.Compose([v1.RandomResizedCrop(small_crop), v1.RandomHorizontalFlip(), v1.ToTensor(),
                                   normalize]),
        "eval": v1.Compose([v1.Resize(resize), v1.CenterCrop(crop), v1.ToTensor(), normalize]),
    }
    presets = {"train": lambda normalize: train_preset(crop_size=crop, normalize=normalize),
               "train_small": lambda normalize: train_preset(crop_size=small_crop, normalize=normalize),
               "eval": lambda normalize: eval_preset(resize_size=resize, crop_size=crop, normalize=normalize)}
    float_presets = {name: build(True) for name, build in presets.items()}
    uint8_presets = {name: build(False) for name, build in presets.items()}
    decoders = decoders_here()
    libraries = library_rows(crop, small_crop, resize)

    def batches(paths, make):
        for start in range(0, len(paths), BATCH):
            default_collate([(make(str(p)), 0) for p in paths[start : start + BATCH]])

    # Decoding alone: each decoder's whole image (PIL or uint8 tensor), nothing else.
    table = {"decode": {f"decode: {name}": (lambda paths, d=LOADERS[name]: [d(str(p)) for p in paths])
                        for name in sorted(decoders, key=lambda name: name != "pil")}}  # the stock loader first
    table["decode"].update(libraries["decode"])
    tv = LOADERS["torchvision"]
    for preset in ("train", "train_small", "eval"):
        uint8_preset, normalize_batch = uint8_presets[preset], NormalizeBatch(IMAGENET_MEAN, IMAGENET_STD)
        rows = {
            "stock PIL + v1": lambda paths, t=stock[preset]: batches(paths, lambda p: t(pil_loader(p))),
            "torchvision.io + v2, float per image":
                lambda paths, t=float_presets[preset]: batches(paths, lambda p: t(tv(p))),
        }
        for name in decoders:  # the data module's path with each decoder (nvimgcodec: in part), collated
            rows[f"ours, decoder={name}"] = (lambda paths, t=uint8_preset, d=image_loader(name, partial=True):
                                             batches(paths, lambda p: t(d(p))))

        def run_ours_cpu(paths, t=uint8_preset, norm=normalize_batch, d=image_loader(decoders[0], partial=True)):
            for start in range(0, len(paths), BATCH):
                norm(default_collate([(t(d(str(p))), 0) for p in paths[start : start + BATCH]])[0])

        rows[f"ours + batch normalize on the CPU, decoder={decoders[0]}"] = run_ours_cpu
        rows.update(libraries["train small" if preset == "train_small" else preset])
        if device is not None and preset != "train_small":
            for name, cpu_name in DEVICE_DECODERS.items():
                if cpu_name in decoders:
                    rows[f"{name}: decode + augment on {device}"] = device_run(name, crop, uint8_presets, preset,
                                                                               device)
        table[preset] = rows
    return table


def device_run(decoder: str, crop_size: int, presets: dict, preset: str, device: str) -> callable:
    """A device decoder's whole path: read the bytes and draw the crops (the worker's part), decode and augment."""
    train_crop = TrainCrop.for_options(crop_size=crop_size)
    device_pipeline = DevicePipeline(train_crop, presets["eval"], decoder=decoder)
    crop = train_crop if preset == "train" else None
    normalize = NormalizeBatch(IMAGENET_MEAN, IMAGENET_STD)

    def run(paths):
        for start in range(0, len(paths), BATCH):
            chunk = [str(p) for p in paths[start : start + BATCH]]
            loaded = [load_for_device(p, device_pipeline.decoder.cpu_decode) for p in chunk]
            crops = [crop.draw(*size) if crop else None for _, size in loaded]
            batch = EncodedBatch.pack([payload for payload, _ in loaded], torch.zeros(len(chunk), dtype=torch.long),
                                      chunk, crops)
            images, _ = device_pipeline(batch, torch.device(device), training=preset == "train")
            normalize(images)
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    return run


def measure(paths: list[Path], rounds: int, crop: int, small_crop: int, resize: int,
            device: str | None = None) -> dict:
    """Every row of every preset in each round, one after the other: ratios between any two rows are per round."""
    torch.set_num_threads(1)
    table = pipelines(crop, small_crop, resize, device)
    runs = {(preset, name): run for preset, rows in table.items() for name, run in rows.items()}
    for run in runs.values():
        run(paths[:4])  # warm-up: first-call allocations, lazy imports, DALI's pipelines
    rates, wall = {key: [] for key in runs}, {key: 0.0 for key in runs}
    for _ in range(rounds):
        for key, run in runs.items():
            cpu0, wall0 = time.process_time(), time.perf_counter()
            with collating_as_a_worker():
                run(paths)
            rates[key].append(len(paths) / (time.process_time() - cpu0))
            wall[key] += time.perf_counter() - wall0
    plain = ("decode", f"decode: {WHOLE}")  # the decode that a pipeline decoding whole cannot pass

    def ratio(key, against):
        return round(statistics.median(r / a for r, a in zip(rates[key], rates[against])), 3) if against in rates \
            else None

    return {preset: {name: {"img_per_cpu_s": round(statistics.median(rates[preset, name]), 1),
                            "img_per_wall_s": round(len(paths) * rounds / wall[preset, name], 1),
                            "ratio_vs_stock": ratio((preset, name), (preset, next(iter(rows)))),
                            "ratio_vs_decode": ratio((preset, name), plain),
                            "ratio_vs_today": ratio((preset, name), (preset, f"ours, decoder={WHOLE}"))}
                     for name in rows} for preset, rows in table.items()}


def versions() -> dict[str, str]:
    found = {}
    for name in VERSIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


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
    parser.add_argument("--data", type=Path,
                        default=Path(os.environ.get("CLASSIFIER_ENGINE_CACHE")
                                     or Path.home() / ".cache" / "classifier-engine") / "bench-jpegs",
                        help="folder for the generated JPEGs (reused)")
    parser.add_argument("--crop", type=int, default=224)
    parser.add_argument("--small-crop", type=int, default=160, help="the second train crop (recipe/fast.yaml's)")
    parser.add_argument("--resize", type=int, default=256)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--device-decode", metavar="DEVICE",
                        help="add the device decoders' path on DEVICE (cuda: nvJPEG); "
                        "its img/s per core counts the CPU work only, the wall figure includes the device's")
    args = parser.parse_args(argv)
    images, rounds = (24, 2) if args.quick else (args.images, args.rounds)
    paths = generate(args.data, images)
    sizes = [Image.open(p).size for p in paths]
    info = {
        "command": "python bench/input_pipeline.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "versions": versions(),
        "images": images, "rounds": rounds,
        "mean_size": f"{np.mean([w for w, _ in sizes]):.0f}x{np.mean([h for _, h in sizes]):.0f}",
        "mean_kb": round(float(np.mean([p.stat().st_size for p in paths])) / 1e3, 1),
    }
    results = measure(paths, rounds, args.crop, args.small_crop, args.resize, args.device_decode)
    print(f"{info['command']}\n{info['machine']}; {images} JPEGs, mean {info['mean_size']}, {info['mean_kb']} KB; "
          f"{rounds} rounds; one thread; {info['versions']}")
    print(f"| preset | pipeline | img/s per core (CPU time) | img/s (wall) | vs stock | vs plain decode ({WHOLE}) "
          f"| vs today (decoder={WHOLE}) |\n|---|---|---|---|---|---|---|")
    label = {"train": f"train {args.crop}", "train_small": f"train {args.small_crop}",
             "eval": f"eval {args.resize}/{args.crop}", "decode": "decode"}
    for preset, rows in results.items():
        for name, row in rows.items():
            ratios = [f"{row[key]:.2f}x" if row[key] is not None else "" for key in
                      ("ratio_vs_stock", "ratio_vs_decode", "ratio_vs_today")]
            print(f"| {label[preset]} | {name} | {row['img_per_cpu_s']} | {row['img_per_wall_s']} | "
                  f"{' | '.join(ratios)} |")
    if args.json:
        args.json.write_text(json.dumps({**info, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
