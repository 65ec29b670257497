"""Train-pipeline images/s per core: a folder of full-size JPEGs against shards of resized ones, and the same shards
read from a local S3 server (moto) against local disk; plus the conversion's time and the sizes on disk.

    python bench/shards.py                 # 512 ImageNet-shaped JPEGs (~475x430), 3 rounds, ~3 min on 2 cores
    python bench/shards.py --quick         # 64 images, 1 round: a smoke run

One process, one thread, num_workers=0: each row is the data module's real train loader (its sampler, the seeded
train preset at 224 px, collate into batches of 64), timed in CPU-seconds of this process (images per CPU-second =
per core), wall-clock alongside. "s3, cold cache" downloads every shard once into an empty cache_dir (the server is
another process on this machine: its CPU is not counted); "s3, warm cache" reads the cached copies.
Results with the exact command: docs/benchmarks.md, "Shards".
"""

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from classifier_engine import ShardDataModule  # noqa: E402

from fake_imagenet import write_fake_imagenet  # noqa: E402
from project.data import ImageNetDataModule  # noqa: E402
from tools.local_services import s3_server  # noqa: E402
from tools.make_shards import main as make_shards  # noqa: E402

PRESET = dict(batch_size=64, num_workers=0, pin_memory=False, train_crop_size=224, drop_last=False)


def du(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def one_epoch(data) -> tuple[int, float, float]:
    """(images, CPU-seconds, wall seconds) of one pass over the data module's train loader."""
    data.setup("fit")
    loader = data.train_dataloader()
    cpu, wall, images = time.process_time(), time.perf_counter(), 0
    for batch, _ in loader:
        images += len(batch)
    return images, time.process_time() - cpu, time.perf_counter() - wall


def measure(rows: dict, rounds: int) -> dict[str, dict[str, float]]:
    """Each row's images per CPU-second and per wall second, median over rounds (rows alternate within a round)."""
    results: dict[str, list] = {name: [] for name in rows}
    for _ in range(rounds):
        for name, make in rows.items():
            images, cpu, wall = one_epoch(make())
            results[name].append((images / cpu, images / wall))
    return {name: {"img_per_cpu_s": round(statistics.median(r[0] for r in runs), 1),
                   "img_per_wall_s": round(statistics.median(r[1] for r in runs), 1)} for name, runs in results.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/shards.py", description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="64 images, 1 round")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    images, rounds = (64, 1) if args.quick else (args.images, args.rounds)
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="bench_shards_"))
    with contextlib.ExitStack() as stack:
        folder = write_fake_imagenet(work / "folder", classes=8, train=images, val=8, width=0, height=0, workers=2)
        started = time.perf_counter()
        make_shards(["--source", str(folder), "--out", str(work / "shards"), "--shard-size", "128", "--workers", "2"])
        convert_s = time.perf_counter() - started
        os.environ.update(stack.enter_context(s3_server(bucket="bench", authenticated=False)))
        make_shards(["--source", str(folder), "--out", "s3://bench/shards", "--shard-size", "128", "--workers", "2"])

        def cold():
            shutil.rmtree(work / "cold", ignore_errors=True)
            return ShardDataModule(shards="s3://bench/shards", cache_dir=str(work / "cold"), **PRESET)

        rows = {"folder of full-size JPEGs": lambda: ImageNetDataModule(root=str(folder), **PRESET),
                "shards (short side 256), local disk": lambda: ShardDataModule(shards=str(work / "shards"), **PRESET),
                "shards, s3, cold cache": cold,
                "shards, s3, warm cache": lambda: ShardDataModule(shards="s3://bench/shards",
                                                                  cache_dir=str(work / "warm"), **PRESET)}
        one_epoch(rows["shards, s3, warm cache"]())  # fills the warm cache
        results = measure(rows, rounds)
    sizes = {"folder": du(folder / "train") + du(folder / "val"), "shards": du(work / "shards")}
    report = {"images": images, "rounds": rounds, "convert_s": round(convert_s, 1), "bytes": sizes,
              "results": results, "command": "python bench/shards.py" + (" --quick" if args.quick else "")}
    print("| train pipeline, 224 px, one thread | img/s per core | img/s wall |\n|---|---|---|")
    for name, row in results.items():
        print(f"| {name} | {row['img_per_cpu_s']} | {row['img_per_wall_s']} |")
    print(f"sizes: folder {sizes['folder'] / 2**20:.1f} MiB, shards {sizes['shards'] / 2**20:.1f} MiB "
          f"({sizes['shards'] / sizes['folder']:.2f}x); conversion {convert_s:.1f} s with 2 workers")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
