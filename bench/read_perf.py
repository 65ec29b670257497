"""Summarize the perf/* scalars (ThroughputLogger) of finished runs: one Markdown row per run dir.

    python bench/read_perf.py runs/gpu_check/gpu runs/gpu_check/bf16 --skip 2

img/s is the median over the logged windows after the first `--skip` (warm-up, cuDNN autotuning, torch.compile).
"""

import argparse
import statistics
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def perf_scalars(run_dir: Path) -> dict[str, list[float]]:
    """perf/* values of the newest TensorBoard event dir under run_dir, in step order."""
    event_dirs = sorted({p.parent for p in run_dir.rglob("events.out.tfevents.*")}, key=lambda p: p.stat().st_mtime)
    if not event_dirs:
        return {}
    accumulator = EventAccumulator(str(event_dirs[-1]), size_guidance={"scalars": 0})
    accumulator.Reload()
    tags = [tag for tag in accumulator.Tags()["scalars"] if tag.startswith("perf/")]
    return {tag: [e.value for e in accumulator.Scalars(tag)] for tag in tags}


def summary(run_dir: Path, skip: int) -> dict[str, float]:
    """Median of each perf/* key over the windows after the first `skip` (all windows if there are no more)."""
    result = {}
    for tag, values in perf_scalars(run_dir).items():
        kept = values[skip:] or values
        result[tag] = statistics.median(kept)
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", type=Path, nargs="+")
    parser.add_argument("--skip", type=int, default=2, help="first windows left out")
    args = parser.parse_args(argv)
    print("| run | img/s | step (ms) | data wait | TFLOP/s | MFU |")
    print("|---|---:|---:|---:|---:|---:|")
    for run_dir in args.run_dirs:
        s = summary(run_dir, args.skip)
        if "perf/images_per_sec" not in s:
            print(f"| {run_dir.name} | no perf/* logged | | | | |")
            continue
        mfu = f"{100 * s['perf/device/mfu']:.1f} %" if "perf/device/mfu" in s else "-"
        tflops = f"{s['perf/device/tflops']:.3g}" if "perf/device/tflops" in s else "-"
        rate = s["perf/images_per_sec"]
        print(f"| {run_dir.name} | {rate:,.0f} | " if rate >= 100 else f"| {run_dir.name} | {rate:.3g} | ", end="")
        print(f"{1e3 * s['perf/step_time']:.1f} | "
              f"{100 * s['perf/data_wait']:.0f} % | {tflops} | {mfu} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
