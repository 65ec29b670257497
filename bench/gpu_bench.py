"""GPU throughput rows: ResNet-50 at 224 px over precisions, channels_last and compile, synthetic then real JPEGs.

    bash bench/gpu_all.sh             # the prepared run: generates the JPEGs, then this script and the rest (one GPU)
    bash bench/gpu_all.sh --tiny      # the same code on CPU: resnet18, 32 px (tests/test_bench.py)
    python bench/gpu_bench.py --jpegs /tmp/fake_imagenet --variants bf16-mixed+cl --decoders torchvision,nvjpeg

Every row trains through ImageClassifier and the Trainer, exactly as `python -m project fit` does; speed comes
from the ThroughputLogger (the perf/* keys), over the steps after the warm-up (which also holds torch.compile).
"synthetic" replays random uint8 batches (no decoding or augmentation); "real" reads the JPEGs with
ImageNetDataModule's training pipeline, once per --decoders entry (CPU decoders in the workers, or a device decoder).
real/synthetic is the share of the GPU's speed the input pipeline keeps. --tiny runs every row in 32-true on the CPU
and leaves compile out (minutes there): it checks the code path, not the figures.
"""

import argparse
import gc
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not

import lightning as L  # noqa: E402
import torch  # noqa: E402
from classifier_engine.callbacks.throughput import ThroughputLogger  # noqa: E402

from project.data import ImageNetDataModule  # noqa: E402
from project.model import ImageClassifier  # noqa: E402
from synthetic import SyntheticDataModule  # noqa: E402

# name -> (Trainer precision, channels_last, torch.compile)
VARIANTS = {
    "fp32": ("32-true", False, False),
    "fp32+cl": ("32-true", True, False),
    "16-mixed": ("16-mixed", False, False),
    "16-mixed+cl": ("16-mixed", True, False),
    "bf16-mixed": ("bf16-mixed", False, False),
    "bf16-mixed+cl": ("bf16-mixed", True, False),
    "bf16-mixed+cl+compile": ("bf16-mixed", True, True),
}
# CPU: mixed precision there is emulated and ~24x slower, and compiling takes minutes.
TINY_VARIANTS, TINY_REAL = ["fp32", "fp32+cl"], ["fp32"]


def run_variant(name: str, data_kind: str, args, workdir: Path, decoder: str = "auto") -> dict:
    precision, channels_last, compile_ = VARIANTS[name]
    if args.tiny and compile_:
        return {"variant": name, "data": data_kind, "skipped": "not with --tiny: compiling takes minutes on a CPU"}
    if args.tiny:
        precision = "32-true"
    L.seed_everything(0, verbose=False)
    if data_kind == "synthetic":
        data = SyntheticDataModule(num_classes=args.num_classes, batch_size=args.batch_size, image_size=args.image_size,
                                   batches_per_epoch=args.warmup + args.steps)
    else:
        data = ImageNetDataModule(root=str(args.jpegs), batch_size=args.batch_size, num_workers=args.workers,
                                  pin_memory=torch.cuda.is_available(), train_crop_size=args.image_size,
                                  decoder=decoder)
    model = ImageClassifier(num_classes=data.num_classes, arch=args.arch, channels_last=channels_last, compile=compile_,
                            batch_size=args.batch_size)
    throughput = ThroughputLogger()
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=1, precision=precision, benchmark=True,  # as configs/gpu.yaml
        max_steps=args.warmup + args.steps, limit_val_batches=0, num_sanity_val_steps=0,
        log_every_n_steps=args.window, default_root_dir=workdir / f"{name}-{data_kind}-{decoder}",
        callbacks=[throughput], enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    cuda = trainer.strategy.root_device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    row = {"variant": name, "data": data_kind, "precision": precision, "batch": args.batch_size,
           "cudnn_benchmark": torch.backends.cudnn.benchmark}
    if data_kind == "real":
        row.update(decoder=data.decoder, workers=args.workers)
    try:
        trainer.fit(model, datamodule=data)
    except torch.OutOfMemoryError:
        return {**row, "error": f"out of memory at batch {args.batch_size}: rerun with a smaller --batch-size"}
    finally:
        if cuda:
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    # Windows ending after the warm-up: their images over their time.
    measured = throughput.windows[args.warmup // args.window :]
    if not measured:
        return {**row, "error": "no measured window: raise --steps"}
    seconds = sum(w["images"] / w["perf/images_per_sec"] for w in measured)
    images = sum(w["images"] for w in measured)
    row.update(
        images_per_sec=images / seconds,
        step_ms=1e3 * seconds / sum(w["steps"] for w in measured),
        data_wait=sum(w["perf/data_wait"] * w["images"] / w["perf/images_per_sec"] for w in measured) / seconds,
        gflop_per_image=(throughput.flops_per_image or 0) / 1e9,
    )
    if throughput.flops_per_image:
        row["tflops"] = row["images_per_sec"] * throughput.flops_per_image / 1e12
        if throughput.device_peak_flops:
            row["mfu"] = row["tflops"] * 1e12 / throughput.device_peak_flops
    return row


def table(rows: list[dict]) -> str:
    synthetic = {r["variant"]: r.get("images_per_sec") for r in rows if r["data"] == "synthetic"}
    lines = [
        "| variant | data | img/s | MFU | TFLOP/s | peak mem (GiB) | step (ms) | data wait | real/synthetic |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        data = f"real ({r['decoder']}, {r['workers']} workers)" if "decoder" in r else r["data"]
        if "error" in r or "skipped" in r:
            lines.append(f"| {r['variant']} | {data} | {r.get('error') or r['skipped']} | | | | | | |")
            continue
        ratio = ""
        if r["data"] == "real" and synthetic.get(r["variant"]):
            ratio = f"{r['images_per_sec'] / synthetic[r['variant']]:.2f}"
        mfu = f"{100 * r['mfu']:.1f} %" if "mfu" in r else "-"
        tflops = "-" if "tflops" not in r else f"{r['tflops']:.1f}" if r["tflops"] >= 1 else f"{r['tflops']:.4f}"
        mem = f"{r['peak_mem_gib']:.1f}" if "peak_mem_gib" in r else "-"
        rate = f"{r['images_per_sec']:,.0f}" if r["images_per_sec"] >= 100 else f"{r['images_per_sec']:.3g}"
        lines.append(
            f"| {r['variant']} | {data} | {rate} | {mfu} | {tflops} | {mem} | "
            f"{r['step_ms']:.1f} | {100 * r['data_wait']:.0f} % | {ratio} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: resnet18, 32 px, batch 8, 3 steps")
    parser.add_argument("--jpegs", type=Path, help="ImageFolder root for the real rows (bench/fake_imagenet.py)")
    parser.add_argument("--variants", default=None, help=f"comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument("--real", default=None,
                        help="variants that also get a real-JPEG row: all (default; fp32 with --tiny), none or a list")
    parser.add_argument("--arch", default=None, help="default resnet50 (resnet18 with --tiny)")
    parser.add_argument("--image-size", type=int, default=None, help="default 224 (32 with --tiny)")
    parser.add_argument("--batch-size", type=int, default=None, help="per GPU; default 256 (8 with --tiny)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out (default 30; 1 with --tiny)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 120; 2 with --tiny)")
    parser.add_argument("--window", type=int, default=None, help="steps per perf/* window (default 10; 1 with --tiny)")
    parser.add_argument("--workers", type=int, default=None,
                        help="DataLoader workers for the real rows (default: cpus)")
    parser.add_argument("--decoders", default="auto", help="data.decoder of the real rows, comma-separated: one row "
                        "each (auto, torchcodec, torchvision, pil, nvjpeg, torchcodec-cuda)")
    parser.add_argument("--no-synthetic", action="store_true",
                        help="only the real rows (bench/gpu_all.sh runs the synthetic ones in another process)")
    parser.add_argument("--num-classes", type=int, default=1000, help="without --jpegs; else the folders' count")
    parser.add_argument("--out", type=Path, default=None, help="write the table (.md) and the rows (.json) here")
    args = parser.parse_args(argv)
    tiny = args.tiny
    args.arch = args.arch or ("resnet18" if tiny else "resnet50")
    args.image_size = args.image_size or (32 if tiny else 224)
    args.batch_size = args.batch_size or (8 if tiny else 256)
    args.warmup = args.warmup if args.warmup is not None else (1 if tiny else 30)
    args.steps = args.steps or (2 if tiny else 120)
    args.window = args.window or (1 if tiny else 10)
    args.workers = args.workers if args.workers is not None else (1 if tiny else os.cpu_count() or 1)
    args.accelerator = "cpu" if tiny else "auto"
    if args.warmup % args.window or args.steps % args.window:
        parser.error(f"--warmup ({args.warmup}) and --steps ({args.steps}) must be multiples of --window "
                     f"({args.window})")
    names = args.variants.split(",") if args.variants else (TINY_VARIANTS if tiny else list(VARIANTS))
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; expected some of: {', '.join(VARIANTS)}")
    args.real = args.real or (",".join(TINY_REAL) if tiny else "all")
    real = [] if args.real == "none" else names if args.real == "all" else args.real.split(",")
    if real and args.jpegs is None:
        parser.error("the real rows need --jpegs ROOT (make one with bench/fake_imagenet.py), or pass --real none")
    if args.jpegs is not None:  # the same network for both sources: as many classes as the JPEG folders hold
        args.num_classes = sum(1 for p in (args.jpegs / "train").iterdir() if p.is_dir())
    if not tiny and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device here; this runs on CPU and the figures say nothing about a GPU",
              file=sys.stderr)

    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not tiny else "CPU"
    print(f"gpu_bench: {device}, torch {torch.__version__}, lightning {L.__version__}; {args.arch} "
          f"{args.image_size} px, "
          f"batch {args.batch_size}, {args.warmup} warm-up + {args.steps} measured steps, {args.workers} workers",
          flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = [] if args.no_synthetic else [(name, "synthetic", "auto") for name in names]
        runs += [(name, "real", decoder) for name in names if name in real for decoder in args.decoders.split(",")]
        for name, data_kind, decoder in runs:
            try:
                rows.append(run_variant(name, data_kind, args, Path(tmp), decoder))
            except Exception as error:  # the row says why; the rows after it still run
                traceback.print_exc()
                first = (str(error).strip().splitlines() or [""])[0]
                rows.append({"variant": name, "data": data_kind, "error": f"{type(error).__name__}: {first}"[:200],
                             **({"decoder": decoder, "workers": args.workers} if data_kind == "real" else {})})
            print(json.dumps(rows[-1]), flush=True)
            if args.out:  # after every row: a run stopped by a time limit keeps what it measured
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.with_suffix(".json").write_text(json.dumps({"device": device, "rows": rows}, indent=1) + "\n")
            gc.collect()
    text = table(rows)
    print(text)
    if args.out:
        args.out.with_suffix(".md").write_text(f"{device}; {' '.join(sys.argv)}\n\n{text}\n")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
