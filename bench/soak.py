"""Soak: 2,000 steps of the quickstart with validation every epoch; resident memory, open files and workers over time.

    python bench/soak.py --max-growth 0.05    # 2,000 steps, 2 persistent workers per loader, ~5 min on 2 cores
    python bench/soak.py --steps 60 --every 10 --quick   # the smoke run of tests/test_bench.py

A long run must not leak: the main process's resident memory after warm-up should grow by at most 5 %, and the open
file descriptors and the DataLoader worker processes should stay flat (a leak there shows up as "too many open files"
or a machine full of zombies after days). Every `--every` steps the run records, from /proc: the main process's
VmRSS, its open file descriptors, its child processes (the workers: train and val loaders, persistent, so 4) and their
summed RSS (shared pages counted in each). Results and the command:
docs/benchmarks.md, "Soak".
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


class Sampler(L.Callback):
    """Records the process's resources every `every` optimizer steps into `output` (JSON lines)."""

    def __init__(self, output: str, every: int = 50):
        self.output, self.every = output, every

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % self.every:
            return
        pid = os.getpid()
        workers = children(pid)
        sample = {"step": trainer.global_step, "epoch": trainer.current_epoch, "time": time.time(),
                  "rss_mib": rss_kib(pid) / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")), "workers": len(workers),
                  "workers_rss_mib": sum(rss_kib(w) for w in workers if os.path.exists(f"/proc/{w}")) / 1024}
        with open(self.output, "a") as file:
            file.write(json.dumps(sample) + "\n")


def slope(x: list[float], y: list[float]) -> float:
    """Least-squares slope: a leak is a trend, while the allocator's ups and downs between two samples are not."""
    mean_x, mean_y = sum(x) / len(x), sum(y) / len(y)
    spread = sum((a - mean_x) ** 2 for a in x)
    return sum((a - mean_x) * (b - mean_y) for a, b in zip(x, y)) / spread if spread else 0.0


def summary(samples: list[dict], warmup: int) -> dict:
    after = [s for s in samples if s["step"] >= warmup] or samples
    first, last = after[0], after[-1]
    return {
        "steps": samples[-1]["step"], "warmup_steps": warmup, "samples": len(samples),
        "rss_mib_after_warmup": round(first["rss_mib"], 1), "rss_mib_end": round(last["rss_mib"], 1),
        "rss_growth": round(last["rss_mib"] / first["rss_mib"] - 1, 4),
        "rss_mib_per_1000_steps": round(1000 * slope([s["step"] for s in after], [s["rss_mib"] for s in after]), 2),
        "rss_mib_max": round(max(s["rss_mib"] for s in after), 1),
        "fds": sorted({s["fds"] for s in after}), "workers": sorted({s["workers"] for s in after}),
        "workers_rss_mib_after_warmup": round(first["workers_rss_mib"], 1),
        "workers_rss_mib_end": round(last["workers_rss_mib"], 1),
        "seconds": round(last["time"] - samples[0]["time"], 1),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=50, help="sample every this many steps")
    parser.add_argument("--warmup", type=int, default=None,
                        help="steps before the baseline (default: 10 %% of --steps)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (persistent)")
    parser.add_argument("--quick", action="store_true", help="CI smoke run: batch 16, validation on 2 batches")
    parser.add_argument("--max-growth", type=float, default=None, help="exit 1 if RSS grows more than this (0.05)")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = parser.parse_args(argv)
    from project import cli_main

    warmup = args.warmup if args.warmup is not None else args.steps // 10
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "samples.jsonl"
        sampler = json.dumps({"class_path": "soak.Sampler", "init_args": {"output": str(output), "every": args.every}})
        run = ["fit", "--config", "configs/quickstart.yaml", f"--trainer.max_steps={args.steps}",
               "--trainer.max_epochs=-1", f"--trainer.default_root_dir={tmp}/run",
               "--trainer.enable_progress_bar=false",
               "--trainer.enable_model_summary=false", f"--data.num_workers={args.workers}",
               "--data.persistent_workers=true", f"--trainer.callbacks+={sampler}"]
        if args.quick:
            run += ["--data.batch_size=16", "--trainer.limit_val_batches=2"]
        cli_main(run)
        samples = [json.loads(line) for line in output.read_text().splitlines()]
    result = summary(samples, warmup)
    result["command"] = "python bench/soak.py " + " ".join(argv)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps({**result, "samples": samples}, indent=1) + "\n")
    if args.max_growth is not None and result["rss_growth"] > args.max_growth:
        print(f"resident memory grew {100 * result['rss_growth']:.1f} % (more than {100 * args.max_growth:.0f} %)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # `soak.Sampler` for the CLI's class_path
    os.chdir(Path(__file__).resolve().parents[1])
    sys.exit(main(sys.argv[1:]))
