"""Template overhead: one ResNet trained by a plain PyTorch loop and by our Trainer path, alternating in one run.

    python bench/overhead.py                # 1 CPU process: median step-time ratio (ours / plain) and loss agreement
    python bench/overhead.py --ddp          # 2 gloo processes: plain DistributedDataParallel vs strategy="ddp"
    python bench/overhead.py --quick        # the CI smoke run (add --ddp for its 2-process variant)

Both sides get the same network (built under the same seed), the same synthetic batches, SGD with the same
LR schedule (project.optim), the same step count and the same threads. A step is timed from the end of one step
to the end of the next, so fetching the batch, hooks and logging count; the ratio of CPU time per step is reported
too, as a figure a busy machine disturbs less than wall time. "Ours" is the Trainer as `python -m project`
builds it: TensorBoard logger, checkpointing, ReseedEachEpoch, ThroughputLogger; no progress bar, no validation.
Results and the commands behind them: docs/benchmarks.md.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from project.backbones import build_resnet  # noqa: E402
from project.callbacks import ReseedEachEpoch  # noqa: E402
from project.callbacks.throughput import ThroughputLogger  # noqa: E402
from project.data.pipeline import NormalizeBatch  # noqa: E402
from project.data.synthetic import ReplayedBatches, SyntheticDataModule, synthetic_batches  # noqa: E402
from project.data.transforms import IMAGENET_MEAN, IMAGENET_STD  # noqa: E402
from project.model import ImageClassifier  # noqa: E402
from project.optim import parameter_groups, scaled_lr, warmup_then_decay  # noqa: E402

RECIPE = dict(lr_per_256=0.1, momentum=0.9, weight_decay=1e-4, warmup_epochs=0.2)


class StepClock(L.Callback):
    """Wall and CPU time at the end of every training step."""

    def __init__(self):
        self.ends: list[tuple[float, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ends.append((time.perf_counter(), time.process_time()))


NORMALIZE = NormalizeBatch(IMAGENET_MEAN, IMAGENET_STD)  # what the data modules do on the device


def eval_loss(network: torch.nn.Module, batch) -> float:
    """Loss on a fixed batch in eval mode: agrees only if weights and BatchNorm statistics agree."""
    network.eval()
    with torch.no_grad():
        return F.cross_entropy(network(NORMALIZE(batch[0])), batch[1]).item()


def plain_run(args, batches, world: int) -> tuple[list[tuple[float, float]], float]:
    """The textbook loop: forward, loss, zero_grad, backward, step, schedule."""
    torch.manual_seed(args.seed)
    network = build_resnet(args.arch, args.num_classes)
    model = DistributedDataParallel(network) if world > 1 else network
    lr = scaled_lr(RECIPE["lr_per_256"], args.batch_size * world)
    optimizer = torch.optim.SGD(
        parameter_groups(network, RECIPE["weight_decay"], decay_norm_and_bias=True), lr=lr, momentum=RECIPE["momentum"]
    )
    scheduler = warmup_then_decay(
        optimizer, total_steps=args.steps, warmup_steps=round(RECIPE["warmup_epochs"] * args.steps), schedule="cosine"
    )
    ends = []
    model.train()
    for images, targets in DataLoader(ReplayedBatches(batches, args.steps), batch_size=None):
        loss = F.cross_entropy(model(NORMALIZE(images)), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        ends.append((time.perf_counter(), time.process_time()))
    return ends, eval_loss(network, batches[0])


def ours_run(args, batches, world: int, workdir: Path) -> tuple[list[tuple[float, float]], float]:
    """The same training through ImageClassifier and the Trainer (strategy="ddp" when world > 1)."""
    L.seed_everything(args.seed, verbose=False)
    torch.manual_seed(args.seed)
    model = ImageClassifier(num_classes=args.num_classes, arch=args.arch, **RECIPE)
    data = SyntheticDataModule(
        num_classes=args.num_classes, batch_size=args.batch_size, image_size=args.image_size,
        batches_per_epoch=args.steps, distinct_batches=args.distinct, seed=args.seed,
    )
    clock = StepClock()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        precision="32-true",
        max_steps=args.steps,
        max_epochs=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=10,
        default_root_dir=workdir,
        callbacks=[ReseedEachEpoch(), ThroughputLogger(), clock],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)
    return clock.ends, eval_loss(model.network, batches[0])


def step_times(ends: list[tuple[float, float]], skip: int) -> tuple[list[float], list[float]]:
    """(wall, CPU) seconds of each step after the first `skip`."""
    pairs = list(zip(ends[skip:], ends[skip + 1 :]))
    return [b[0] - a[0] for a, b in pairs], [b[1] - a[1] for a, b in pairs]


def relaunch_with_torchrun(argv: list[str]) -> int:
    """The 2-process variant runs both sides inside the same 2 processes, started here by torchrun."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, *argv]
    return subprocess.call(command, env={**os.environ, "OMP_NUM_THREADS": "1"})


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ddp", action="store_true", help="2 gloo processes (relaunches itself with torchrun)")
    parser.add_argument("--quick", action="store_true", help="fewer, smaller steps: the CI smoke run")
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=None, help="per process (default 32; 8 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 40; 8 with --quick)")
    parser.add_argument("--rounds", type=int, default=None, help="alternations (default 4; 2 with --quick)")
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the timings")
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--distinct", type=int, default=4, help="distinct synthetic batches cycled over")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per process (default: torch's; 1 with --quick, steadier on shared cores)")
    parser.add_argument("--max-ratio", type=float, default=None, help="exit 1 if the median ratio is above this")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="largest relative loss difference allowed")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    args.batch_size = args.batch_size or (8 if args.quick else 32)
    args.steps = args.steps or (8 if args.quick else 40)
    args.threads = args.threads or (1 if args.quick else None)
    args.rounds = args.rounds or (2 if args.quick else 4)
    if args.steps <= args.skip + 1:
        parser.error(f"--steps must exceed --skip + 1 ({args.skip + 1}), got {args.steps}")

    if args.ddp and "TORCHELASTIC_RUN_ID" not in os.environ:
        return relaunch_with_torchrun(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    world, rank = 1, 0
    if args.ddp:
        dist.init_process_group("gloo")  # the Trainer finds it initialized and reuses it
        world, rank = dist.get_world_size(), dist.get_rank()

    batches = synthetic_batches(
        batch_size=args.batch_size, image_size=args.image_size, num_classes=args.num_classes,
        distinct=args.distinct, seed=args.seed + rank,
    )
    times: dict[str, list[float]] = {"plain": [], "ours": []}
    cpu_times: dict[str, list[float]] = {"plain": [], "ours": []}
    losses: dict[str, list[float]] = {"plain": [], "ours": []}
    round_ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if world > 1:  # every rank must log into the one directory rank 0 created
            holder = [str(workdir)]
            dist.broadcast_object_list(holder, src=0)
            workdir = Path(holder[0])
        for round_index in range(args.rounds):
            # Alternate who goes first, so drift in the machine's speed (other load, heat) hits both sides alike.
            order = ("plain", "ours") if round_index % 2 == 0 else ("ours", "plain")
            medians = {}
            for side in order:
                if world > 1:
                    dist.barrier()
                ends, loss = plain_run(args, batches, world) if side == "plain" else ours_run(args, batches, world, workdir)
                steps, cpu_steps = step_times(ends, args.skip)
                times[side] += steps
                cpu_times[side] += cpu_steps
                losses[side].append(loss)
                medians[side] = statistics.median(steps)
            round_ratios.append(medians["ours"] / medians["plain"])

    plain_median, ours_median = statistics.median(times["plain"]), statistics.median(times["ours"])
    cpu_ratio = statistics.median(cpu_times["ours"]) / statistics.median(cpu_times["plain"])
    loss_diff = max(abs(o - p) / abs(p) for o, p in zip(losses["ours"], losses["plain"]))
    result = {
        "variant": f"ddp x{world} (gloo)" if world > 1 else "single process",
        "arch": args.arch, "image_size": args.image_size, "batch_size": args.batch_size, "steps": args.steps,
        "rounds": args.rounds, "threads": torch.get_num_threads(),
        "plain_step_s": plain_median, "ours_step_s": ours_median, "ratio": ours_median / plain_median,
        "round_ratios": round_ratios, "cpu_ratio": cpu_ratio,
        "loss_plain": losses["plain"][-1], "loss_ours": losses["ours"][-1],
        "loss_rel_diff": loss_diff, "losses_agree": loss_diff <= args.tolerance,
    }
    if rank == 0:
        print(
            f"{result['variant']}: {args.arch} {args.image_size}px batch {args.batch_size}, {args.rounds} rounds x "
            f"{args.steps} steps, {result['threads']} thread(s)/process\n"
            f"  median step: plain {plain_median * 1e3:.1f} ms, ours {ours_median * 1e3:.1f} ms, "
            f"ratio {result['ratio']:.4f} (per round: {', '.join(f'{r:.3f}' for r in round_ratios)}); "
            f"CPU time per step ratio {cpu_ratio:.4f}\n"
            f"  loss after {args.steps} steps: plain {result['loss_plain']:.8f}, ours {result['loss_ours']:.8f}, "
            f"max relative difference {loss_diff:.2e} ({'agree' if result['losses_agree'] else 'DISAGREE'}, "
            f"tolerance {args.tolerance:g})"
        )
        print("RESULT " + json.dumps(result))
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
    if world > 1:
        dist.destroy_process_group()
    if not result["losses_agree"]:
        return 1
    if args.max_ratio is not None and result["ratio"] > args.max_ratio:
        print(f"ratio {result['ratio']:.4f} is above --max-ratio {args.max_ratio}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
