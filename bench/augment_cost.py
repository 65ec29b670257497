"""Recipe ingredients' CPU cost: images/s per core of the train preset with and without each one, in one run.

    python bench/augment_cost.py              # 256 generated ImageNet-like JPEGs, 5 rounds, ~1.5 min on 2 cores
    python bench/augment_cost.py --quick      # 24 images, 2 rounds: the CI smoke run

Auto-augment and random erasing run per image in the DataLoader workers, so their cost is CPU time per image. Every
row is the data module's default pipeline (decoder torchvision, normalize_on_device: uint8 out, the GPU normalizes)
over the same files, alternating row by row each round: decode, the seeded train preset, default_collate of batches
of 64 into shared memory as in a worker. Each image is seeded by its index, as SeededSamples does, so every row draws
the same crops and the difference is the ingredient's own work. One process, one thread, CPU time of the process;
ratio = median of the per-round ratios to the baseline row; "ms per image" = the row's time minus the baseline's.
Results with the exact command: docs/benchmarks.md, "Recipe ingredients".
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import PIL
import torch
import torchvision
from PIL import Image
from torch.utils.data import default_collate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))
from classifier_engine.data.decoders import decode_torchvision  # noqa: E402
from classifier_engine.data.transforms import train_preset  # noqa: E402

from input_pipeline import BATCH, collating_as_a_worker, generate, machine  # noqa: E402

BASELINE = "baseline: crop + flip"


def variants(crop: int) -> dict[str, dict]:
    """{row name: train_preset options}; the first row is the baseline the others are compared with."""
    return {
        BASELINE: {},
        "+ trivialaugment_wide": {"auto_augment": "trivialaugment_wide"},
        "+ randaugment (2 ops, magnitude 9)": {"auto_augment": "randaugment"},
        "+ autoaugment (imagenet)": {"auto_augment": "autoaugment"},
        "+ random erasing p=0.25": {"random_erase_prob": 0.25},
        "+ random erasing p=1.0": {"random_erase_prob": 1.0},
        "+ trivialaugment_wide + random erasing p=0.1 (torchvision V2's)": {"auto_augment": "trivialaugment_wide",
                                                                          "random_erase_prob": 0.1},
    }


def runner(options: dict, crop: int):
    preset = train_preset(crop_size=crop, normalize=False, **options)

    def run(paths: list[Path]) -> None:
        for start in range(0, len(paths), BATCH):
            images = []
            for index in range(start, min(start + BATCH, len(paths))):
                torch.default_generator.manual_seed(index)  # what SeededSamples does per sample key
                images.append((preset(decode_torchvision(str(paths[index]))), 0))
            default_collate(images)

    return run


def measure(paths: list[Path], rounds: int, crop: int) -> dict[str, dict]:
    torch.set_num_threads(1)
    runs = {name: runner(options, crop) for name, options in variants(crop).items()}
    for run in runs.values():
        run(paths[:4])  # warm-up: first-call allocations, lazy imports
    per_round = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            with collating_as_a_worker():
                start = time.process_time()
                run(paths)
                per_round[name].append(len(paths) / (time.process_time() - start))
    base = per_round[BASELINE]
    base_rate = statistics.median(base)
    return {
        name: {
            "img_per_cpu_s": round(statistics.median(rates), 1),
            "ratio_vs_baseline": round(statistics.median(r / b for r, b in zip(rates, base)), 3),
            "extra_ms_per_image": round(1e3 * (1 / statistics.median(rates) - 1 / base_rate), 3),
        }
        for name, rates in per_round.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/augment_cost.py", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="24 images, 2 rounds: a smoke run")
    parser.add_argument("--images", type=int, default=256, help="generated JPEGs")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per row")
    parser.add_argument("--data", type=Path,
                        default=Path(os.environ.get("CLASSIFIER_ENGINE_CACHE")
                                     or Path.home() / ".cache" / "classifier-engine") / "bench-jpegs",
                        help="folder for the generated JPEGs (shared with bench/input_pipeline.py)")
    parser.add_argument("--crop", type=int, default=224)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    images, rounds = (24, 2) if args.quick else (args.images, args.rounds)
    paths = generate(args.data, images)
    sizes = [Image.open(p).size for p in paths]
    info = {
        "command": "python bench/augment_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "load_average": os.getloadavg()[0],
        "versions": {"torch": torch.__version__, "torchvision": torchvision.__version__, "pillow": PIL.__version__},
        "images": images, "rounds": rounds, "crop": args.crop,
        "mean_size": f"{np.mean([w for w, _ in sizes]):.0f}x{np.mean([h for _, h in sizes]):.0f}",
    }
    results = measure(paths, rounds, args.crop)
    print(f"{info['command']}\n{info['machine']}; load average {info['load_average']:.2f}; {images} JPEGs, mean "
          f"{info['mean_size']}; crop {args.crop}; {rounds} rounds; one thread")
    print("| train preset | img/s per core (CPU time) | ratio vs baseline | extra ms per image |\n|---|---:|---:|---:|")
    for name, row in results.items():
        print(f"| {name} | {row['img_per_cpu_s']} | {row['ratio_vs_baseline']:.2f}x | "
              f"{row['extra_ms_per_image']:+.2f} |")
    if args.json:
        args.json.write_text(json.dumps({**info, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
