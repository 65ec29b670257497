"""Device augmentation per batch: the uint8 presets image by image (the old decoder=nvjpeg path) against batch-wise
(classifier_engine.data.device_decode), in kernel launches and milliseconds, train (also with TrivialAugment, which
runs per image after the batch-wise crops) and eval.

    python bench/device_augment.py --jpegs runs/gpu_all/fake_imagenet --device cuda    # bash bench/gpu_all.sh runs it
    python bench/device_augment.py --jpegs /tmp/jpegs --device cpu --batch 64         # op counts on a CPU

The batch is decoded once (not timed), then each path runs --rounds times after a warm-up. CUDA: launches are the
kernel launches the profiler sees from the host; "host ms" is the time to queue the work (what the training loop's
thread spends, the rest overlaps the previous step), "ms" until the device is done. CPU: ATen ops that compute
(views left out), one kernel each on a GPU at most.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not

import torch  # noqa: E402
from classifier_engine.data.device_decode import (  # noqa: E402
    CroppedBatch,
    DeviceDecoder,
    DevicePipeline,
    TrainCrop,
    eval_batch,
    load_for_device,
    resized_crops,
)
from classifier_engine.data.image_data import DRAWN_IN_WORKERS  # noqa: E402
from classifier_engine.data.transforms import eval_preset, train_preset  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torchvision.transforms import v2  # noqa: E402


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def launches(run, device: torch.device) -> int:
    if device.type != "cuda":
        with CountOps() as counter:
            run()
        return counter.count
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize(device)
    return sum(e.count for e in prof.key_averages() if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel")))


def timed(run, device: torch.device, rounds: int) -> tuple[float, float]:
    """Median (host ms, total ms) over rounds."""
    host, total = [], []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        queued = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        host.append(1e3 * (queued - start))
        total.append(1e3 * (time.perf_counter() - start))
    return statistics.median(host), statistics.median(total)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jpegs", type=Path, required=True, help="an ImageFolder root (bench/fake_imagenet.py)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--crop", type=int, default=224)
    parser.add_argument("--resize", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    train = train_preset(crop_size=args.crop, normalize=False)
    evaluate = eval_preset(resize_size=args.resize, crop_size=args.crop, normalize=False)
    decoder = DeviceDecoder("nvjpeg")
    paths = sorted(str(p) for p in (args.jpegs / "train").rglob("*.JPEG"))[: args.batch]
    loaded = [load_for_device(p, decoder.cpu_decode) for p in paths]
    encoded = [payload for payload, _ in loaded if payload.dim() == 1]
    decoded = iter(decoder.decode_jpegs(encoded, device)) if encoded else iter(())
    # CHW in memory as nvJPEG writes it (the CPU decoders give HWC views, which would cost a copy each).
    images = [(next(decoded) if payload.dim() == 1 else payload.to(device)).contiguous() for payload, _ in loaded]
    spec = TrainCrop.for_options(crop_size=args.crop)
    crops = []
    for seed, (_, size) in enumerate(loaded):  # each crop from its own seed, as SeededSamples seeds each sample
        torch.manual_seed(seed)
        crops.append(spec.draw(*size))
    # TrivialAugment after the crop and flip: the uint8 preset image by image, or the crops batch-wise and then the
    # preset's steps after them per image with each sample's draws (DevicePipeline.finish, as data.decoder=nvjpeg runs)
    augmented = train_preset(crop_size=args.crop, normalize=False, auto_augment="trivialaugment_wide")
    rest = v2.Compose([t for t in augmented.transforms if not isinstance(t, DRAWN_IN_WORKERS)])
    pipeline = DevicePipeline(spec, evaluate, augment=rest)
    targets = torch.zeros(len(images), dtype=torch.long, device=device)
    runs = {
        "train": {"per image": lambda: torch.stack([train(image) for image in images]),
                  "batch-wise": lambda: resized_crops(images, crops, spec.size)},
        "train + trivialaugment": {
            "per image": lambda: torch.stack([augmented(image) for image in images]),
            "batch-wise": lambda: pipeline.finish(CroppedBatch(resized_crops(images, crops, spec.size), targets,
                                                               crops))},
        "eval": {"per image": lambda: torch.stack([evaluate(image) for image in images]),
                 "batch-wise": lambda: eval_batch(images, evaluate)},
    }
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
              "batch": len(images), "distinct_sizes": len({tuple(i.shape) for i in images}), "results": {}}
    print(f"{report['device']}: {len(images)} images ({report['distinct_sizes']} sizes) from {args.jpegs}")
    print("| preset | path | launches | host ms | ms |\n|---|---|---:|---:|---:|")
    for preset, paths_ in runs.items():
        for name, run in paths_.items():
            run()  # warm-up: allocator, cuDNN, lazy imports
            host, total = timed(run, device, args.rounds)
            row = {"launches": launches(run, device), "host_ms": round(host, 2), "ms": round(total, 2)}
            report["results"].setdefault(preset, {})[name] = row
            print(f"| {preset} | {name} | {row['launches']} | {row['host_ms']} | {row['ms']} |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
