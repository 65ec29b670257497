"""Train-pipeline images/s per core: a folder of full-size JPEGs against shards of resized ones, the same shards
read from a local S3 server (moto) against local disk, and the same images as WebDataset tars (make_shards --format
webdataset) read by ShardDataModule; plus each reader's bytes alone (no decode), the conversion's time, the tars' index
time and the sizes on disk.

    python bench/shards.py                 # 512 ImageNet-shaped JPEGs (~475x430), 3 rounds, ~3 min on 2 cores
    python bench/shards.py --quick         # 64 images, 1 round: a smoke run

One process, one thread, num_workers=0: each row is the data module's real train loader (its sampler, the seeded
train preset at 224 px, collate into batches of 64), timed in CPU-seconds of this process (images per CPU-second =
per core), wall-clock alongside. "s3, cold cache" downloads every shard once into an empty cache_dir (the server is
another process on this machine: its CPU is not counted); "s3, warm cache" reads the cached copies. "read only" rows
fetch each sample's encoded bytes in the train order, 20 passes (our shards, the tars by offset), and the `webdataset`
package's own sequential tar reader over the train tars when it is installed (one pass, tar after tar), with no decode.
Results with the exact command: docs/benchmarks.md, "Shards".
"""

import argparse
import bisect
import contextlib
import importlib.util
import io
import json
import os
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine" / "tests"))  # local_services
from classifier_engine import ShardDataModule  # noqa: E402
from classifier_engine.data.decoders import unavailable  # noqa: E402
from classifier_engine.data.make_shards import main as make_shards  # noqa: E402
from classifier_engine.data.tar_shards import index_tar  # noqa: E402
from local_services import s3_server  # noqa: E402  (engine/tests/local_services.py)

from fake_imagenet import write_fake_imagenet  # noqa: E402
from project.data import ImageNetDataModule  # noqa: E402

WHOLE = "torchcodec" if unavailable("torchcodec") is None else "torchvision"  # what auto decoded with before
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


def read_only(data, passes: int = 20) -> tuple[int, float, float]:
    """(images, CPU-seconds, wall seconds) of reading every training sample's encoded bytes in the train order,
    `passes` times (one pass takes milliseconds)."""
    data.setup("fit")
    order = [index for index, _, _ in data.train_dataloader().sampler]
    images = data.datasets["train"].dataset  # ShardImages, under SeededSamples
    cpu, wall = time.process_time(), time.perf_counter()
    for index in order * passes:
        shard = bisect.bisect_right(images.starts, index) - 1
        images._read(shard, index - images.starts[shard])
    return len(order) * passes, time.process_time() - cpu, time.perf_counter() - wall


def webdataset_package(folder: Path) -> tuple[int, float, float]:
    """The same for the webdataset package's sequential reader of the train tars (its own order: tar after tar)."""
    import webdataset

    cpu, wall = time.process_time(), time.perf_counter()
    read = webdataset.WebDataset([str(p) for p in sorted(folder.glob("train-*.tar"))], shardshuffle=False,
                                 empty_check=False)
    images = sum(1 for _ in read)
    return images, time.process_time() - cpu, time.perf_counter() - wall


def index_rate(work: Path, samples: int = 1250, rounds: int = 3) -> float:
    """Samples per CPU-second of indexing one tar of ImageNet-sized members (~110 KB JPEG bytes and a .cls each, as
    HF's imagenet1k-train-*.tar hold ~1,250), the tar in the page cache; median of `rounds`."""
    body = b"\xff\xd8\xff" + bytes(110_000)
    with tarfile.open(work / "big-train-0000.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for k in range(samples):
            for extension, data in (("jpg", body), ("cls", b"123")):
                info = tarfile.TarInfo(f"{k:08d}.{extension}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    times = []
    for _ in range(rounds):
        cpu = time.process_time()
        index_tar(work / "big-train-0000.tar", "bench")
        times.append(time.process_time() - cpu)
    return round(samples / statistics.median(times))


def measure(rows: dict, rounds: int) -> dict[str, dict[str, float]]:
    """Each row's images per CPU-second and per wall second, median over rounds (rows alternate within a round)."""
    results: dict[str, list] = {name: [] for name in rows}
    for _ in range(rounds):
        for name, (run, make) in rows.items():
            images, cpu, wall = run(make())
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
        make_shards(["--source", str(folder), "--out", str(work / "tars"), "--shard-size", "128", "--workers", "2",
                     "--format", "webdataset"])

        def tars():
            return ShardDataModule(shards=str(work / "tars"), cache_dir=str(work / "tar_index"), **PRESET)

        first = time.perf_counter()
        tars()  # the first use builds the tars' index into the cache
        second = time.perf_counter()
        tars()  # the next reads it: the difference is the index's build
        index_s = (second - first) - (time.perf_counter() - second)
        os.environ.update(stack.enter_context(s3_server(bucket="bench", authenticated=False)))
        make_shards(["--source", str(folder), "--out", "s3://bench/shards", "--shard-size", "128", "--workers", "2"])

        def cold():
            shutil.rmtree(work / "cold", ignore_errors=True)
            return ShardDataModule(shards="s3://bench/shards", cache_dir=str(work / "cold"), **PRESET)

        def shards():
            return ShardDataModule(shards=str(work / "shards"), **PRESET)

        rows = {"folder of full-size JPEGs": (one_epoch, lambda: ImageNetDataModule(root=str(folder), **PRESET)),
                f"folder, decoded whole (decoder={WHOLE})": (one_epoch, lambda: ImageNetDataModule(
                    root=str(folder), **PRESET, decoder=WHOLE)),
                "shards (short side 256), local disk": (one_epoch, shards),
                f"shards, decoded whole (decoder={WHOLE})": (one_epoch, lambda: ShardDataModule(
                    shards=str(work / "shards"), **PRESET, decoder=WHOLE)),
                "WebDataset tars (the same images), local disk": (one_epoch, tars),
                "shards, s3, cold cache": (one_epoch, cold),
                "shards, s3, warm cache": (one_epoch, lambda: ShardDataModule(shards="s3://bench/shards",
                                                                              cache_dir=str(work / "warm"), **PRESET)),
                "read only: shards": (read_only, shards), "read only: WebDataset tars": (read_only, tars)}
        if importlib.util.find_spec("webdataset"):
            rows["read only: the webdataset package, sequential"] = (webdataset_package, lambda: work / "tars")
        one_epoch(rows["shards, s3, warm cache"][1]())  # fills the warm cache
        results = measure(rows, rounds)
        indexed = index_rate(work)
    sizes = {"folder": du(folder / "train") + du(folder / "val"), "shards": du(work / "shards"),
             "tars": du(work / "tars"), "tar_index": du(work / "tar_index")}
    report = {"images": images, "rounds": rounds, "convert_s": round(convert_s, 1), "bytes": sizes,
              "tar_index_s": round(index_s, 2), "tar_index_samples_per_cpu_s": indexed,
              "results": results,
              "command": " ".join(["python bench/shards.py", *(sys.argv[1:] if argv is None else argv)])}
    print("| train pipeline, 224 px, one thread | img/s per core | img/s wall |\n|---|---|---|")
    for name, row in results.items():
        print(f"| {name} | {row['img_per_cpu_s']} | {row['img_per_wall_s']} |")
    print(f"sizes: folder {sizes['folder'] / 2**20:.1f} MiB, shards {sizes['shards'] / 2**20:.1f} MiB "
          f"({sizes['shards'] / sizes['folder']:.2f}x), tars {sizes['tars'] / 2**20:.1f} MiB; conversion "
          f"{convert_s:.1f} s with 2 workers; the tars' index {index_s:.2f} s ({images + 8} samples, "
          f"{sizes['tar_index'] / 1024:.0f} KiB); indexing a tar of 1,250 ImageNet-sized samples: {indexed} samples "
          "per CPU-second")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
