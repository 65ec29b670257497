"""Template overhead: one ResNet trained by a plain PyTorch loop and by our Trainer path, alternating step by step.

    python bench/overhead.py                # 1 CPU process: step-time ratio (ours / plain) and loss agreement
    python bench/overhead.py --ddp          # 2 gloo processes: plain DistributedDataParallel vs strategy="ddp"
    python bench/overhead.py --quick        # the CI smoke run (add --ddp for its 2-process variant)
    python bench/overhead.py --ddp --check-every 1        # our stop-signal agreement on every step instead of every 10th
    python bench/overhead.py --ddp --lightning-sigterm-broadcast    # with Lightning's per-step broadcast kept
    python bench/overhead.py --accelerator gpu --precision bf16-mixed --channels-last --arch resnet50 \
        --image-size 224 --batch-size 256 --block 10 --tolerance 0.05     # one GPU (bash bench/gpu_all.sh runs it)

Both sides get the same network (built under the same seed), the same synthetic batches, SGD with the same
LR schedule (project.optim), the same step count and the same threads. They run in one process, taking turns one
step at a time: after each of the Trainer's steps a callback runs one plain step (Interleave). A plain step counts
fetching, forward, backward and the optimizer; our step is everything between two plain steps (fetching, hooks,
logging, checkpoint bookkeeping). The reported ratio is our total time over the plain loop's, summed over the
paired steps of all rounds, so the steps that write logs count with their weight; pairing each step with its
neighbour means a change in the machine's speed (other load, heat) hits both sides alike, which separate
back-to-back runs could not resolve on a shared 2-core machine (their per-run ratios spread over ±10 %). Also
reported: the median of the per-pair ratios (an ordinary, non-logging step), the same two for CPU time, and each
round's ratio. Not timed on either side: building the model and Trainer, and what follows the last step (the
end-of-epoch checkpoint save).
"Ours" is the Trainer as `python -m project` builds it: TensorBoard logger, checkpointing (last.ckpt's
signal and time checks), the per-step model seeding,
ThroughputLogger; no progress bar, no validation.
On a GPU the sides alternate every --block steps, with the device synchronized only at the block boundaries, so
within a block each side's host work overlaps its kernels as in a real run; mixed precision (the plain loop under
torch.autocast) changes the numerics from run to run, hence a looser --tolerance there.
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
from project.run.last_checkpoint import LastCheckpoint  # noqa: E402
from project.callbacks.throughput import ThroughputLogger  # noqa: E402
from project.compat.sigterm_broadcast import restore_lightning_sigterm_broadcast  # noqa: E402
from project.data.device_normalize import NormalizeBatch  # noqa: E402
from synthetic import ReplayedBatches, SyntheticDataModule, synthetic_batches  # noqa: E402
from project.data.transforms import IMAGENET_MEAN, IMAGENET_STD  # noqa: E402
from project.model import ImageClassifier  # noqa: E402
from project.optim import parameter_groups, scaled_lr, warmup_then_decay  # noqa: E402

RECIPE = dict(lr_per_256=0.1, momentum=0.9, weight_decay=1e-4, warmup_epochs=0.2)


NORMALIZE = NormalizeBatch(IMAGENET_MEAN, IMAGENET_STD)  # what the data modules do on the device
Clock = tuple[float, float]  # (wall, CPU) seconds


def clock() -> Clock:
    return time.perf_counter(), time.process_time()


AUTOCAST = {"32-true": None, "bf16-mixed": torch.bfloat16}  # what the plain loop can mirror of Lightning's precision


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def eval_loss(network: torch.nn.Module, batch) -> float:
    """Loss on a fixed batch in eval mode: agrees only if weights and BatchNorm statistics agree."""
    network.eval()
    device = next(network.parameters()).device
    with torch.no_grad():
        return F.cross_entropy(network(NORMALIZE(batch[0].to(device))), batch[1].to(device)).item()


class PlainLoop:
    """The textbook loop, one step per call: fetch, forward, loss, zero_grad, backward, step, schedule."""

    def __init__(self, args, batches, world: int, device: torch.device):
        torch.manual_seed(args.seed)
        self.device, self.channels_last, self.autocast = device, args.channels_last, AUTOCAST[args.precision]
        self.network = build_resnet(args.arch, args.num_classes).to(device)
        if self.channels_last:
            self.network.to(memory_format=torch.channels_last)
        self.model = DistributedDataParallel(self.network) if world > 1 else self.network
        lr = scaled_lr(RECIPE["lr_per_256"], args.batch_size * world)
        groups = parameter_groups(self.network, RECIPE["weight_decay"], decay_norm_and_bias=True)
        self.optimizer = torch.optim.SGD(groups, lr=lr, momentum=RECIPE["momentum"])
        self.scheduler = warmup_then_decay(
            self.optimizer, total_steps=args.steps, warmup_steps=round(RECIPE["warmup_epochs"] * args.steps),
            schedule="cosine",
        )
        if device.type == "cuda":  # pinned, as SyntheticDataModule pins ours: both copies are asynchronous
            batches = [(images.pin_memory(), targets.pin_memory()) for images, targets in batches]
        self.batches = iter(DataLoader(ReplayedBatches(batches, args.steps), batch_size=None))
        self.model.train()

    def step(self) -> None:
        images, targets = next(self.batches)
        images, targets = images.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)
        images = NORMALIZE(images)
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            loss = F.cross_entropy(self.model(images), targets)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()


class Interleave(L.Callback):
    """Runs `block` plain steps after every `block` of our steps (1 on CPU), so the two sides alternate and any change
    in the machine's speed hits both alike. Our time is from the end of one plain block to the start of the next:
    whole cycles of the Trainer (the rest of its hooks and logging, fetching, the steps), nothing of the plain loop.
    """

    def __init__(self, plain: PlainLoop, block: int = 1):
        self.plain = plain
        self.block = block
        self.ours: list[Clock] = []
        self.plains: list[Clock] = []
        self._resumed: Clock | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % self.block:
            return
        synchronize(self.plain.device)  # our block's kernels are done: the clock stops for us
        start = clock()
        for _ in range(self.block):
            self.plain.step()
        synchronize(self.plain.device)
        end = clock()
        self.plains.append((end[0] - start[0], end[1] - start[1]))
        if self._resumed is not None:
            self.ours.append((start[0] - self._resumed[0], start[1] - self._resumed[1]))
        self._resumed = clock()


class StockSigtermBroadcast(L.Callback):
    """Lightning's broadcast of a SIGTERM flag each step, back after LastCheckpoint took it away in its on_train_start
    (Lightning runs Checkpoint callbacks after all others, so this hook, at the epoch start, is the first that can)."""

    def on_train_epoch_start(self, trainer, pl_module):
        restore_lightning_sigterm_broadcast(trainer)
        assert "_broadcast_sigterm_tensor" not in vars(trainer.fit_loop.epoch_loop), "the stock broadcast is still off"


def interleaved_run(args, batches, world: int, workdir: Path) -> tuple[Interleave, float, float]:
    """Our Trainer path (ImageClassifier, strategy="ddp" when world > 1) with the plain loop interleaved."""
    device = torch.device("cuda", torch.cuda.current_device()) if args.accelerator == "gpu" else torch.device("cpu")
    plain = PlainLoop(args, batches, world, device)
    L.seed_everything(args.seed, verbose=False)
    torch.manual_seed(args.seed)  # the same initial weights as the plain loop's
    model = ImageClassifier(num_classes=args.num_classes, arch=args.arch, channels_last=args.channels_last,
                            batch_size=args.batch_size, **RECIPE)
    data = SyntheticDataModule(
        num_classes=args.num_classes, batch_size=args.batch_size, image_size=args.image_size,
        batches_per_epoch=args.steps, distinct_batches=args.distinct, seed=args.seed,
    )
    interleave = Interleave(plain, args.block)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        precision=args.precision,
        max_steps=args.steps,
        max_epochs=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=10,
        default_root_dir=workdir,
        callbacks=[LastCheckpoint(**({} if args.check_every is None else {"check_every_n_steps": args.check_every})),
                   ThroughputLogger(), interleave] + ([StockSigtermBroadcast()] if args.lightning_sigterm_broadcast else []),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)
    return interleave, eval_loss(plain.network, batches[0]), eval_loss(model.network, batches[0])


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
    parser.add_argument("--steps", type=int, default=None, help="steps per round (default 40; 8 with --quick)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="fresh runs of both sides, one new Trainer each (default 4; 2 with --quick)")
    parser.add_argument("--skip", type=int, default=None, help="warm-up steps left out (default 2, or one --block)")
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--distinct", type=int, default=4, help="distinct synthetic batches cycled over")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per process (default: torch's; 1 with --quick, steadier on shared cores)")
    parser.add_argument("--max-ratio", type=float, default=None, help="exit 1 if the ratio is above this")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="largest relative loss difference allowed")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu", help="gpu: one CUDA device per process")
    parser.add_argument("--precision", choices=list(AUTOCAST), default="32-true")
    parser.add_argument("--channels-last", action="store_true", help="NHWC network and inputs on both sides")
    parser.add_argument("--block", type=int, default=1, help="steps per turn of each side (GPU: 10 lets them overlap)")
    parser.add_argument("--check-every", type=int, default=None,
                        help="LastCheckpoint(check_every_n_steps=...): how often ddp ranks agree on stop signals "
                             "(default: the callback's, 10); 1 is one all-reduce per step, as Lightning's own check")
    parser.add_argument("--lightning-sigterm-broadcast", action="store_true",
                        help="keep Lightning's per-step SIGTERM broadcast, which the template skips (its cost)")
    args = parser.parse_args(argv)
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        parser.error("--accelerator gpu needs a CUDA device; none is visible here")
    args.batch_size = args.batch_size or (8 if args.quick else 32)
    args.steps = args.steps or (8 if args.quick else 40)
    args.threads = args.threads or (1 if args.quick else None)
    args.rounds = args.rounds or (2 if args.quick else 4)
    args.skip = args.skip if args.skip is not None else max(2, args.block)
    if args.steps <= args.skip + 2 * args.block or args.steps % args.block or args.skip % args.block:
        parser.error(f"--steps ({args.steps}) must exceed --skip + 2 x --block ({args.skip} + 2 x {args.block}), "
                     "and both be multiples of --block")

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
    # Per measured step: (ours, plain) wall and CPU seconds, ours paired with the plain step right after it.
    walls: list[tuple[float, float]] = []
    cpus: list[tuple[float, float]] = []
    losses: list[tuple[float, float]] = []
    round_ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if world > 1:  # every rank must log into the one directory rank 0 created
            holder = [str(workdir)]
            dist.broadcast_object_list(holder, src=0)
            workdir = Path(holder[0])
        for _ in range(args.rounds):
            if world > 1:
                dist.barrier()
            run, plain_loss, ours_loss = interleaved_run(args, batches, world, workdir)
            pairs = list(zip(run.ours, run.plains[1:]))[args.skip // args.block :]  # per block, in seconds per step
            walls += [(o[0] / args.block, p[0] / args.block) for o, p in pairs]
            cpus += [(o[1] / args.block, p[1] / args.block) for o, p in pairs]
            losses.append((plain_loss, ours_loss))
            round_ratios.append(sum(o[0] for o, _ in pairs) / sum(p[0] for _, p in pairs))

    plain_median, ours_median = statistics.median(p for _, p in walls), statistics.median(o for o, _ in walls)
    ratio = sum(o for o, _ in walls) / sum(p for _, p in walls)
    cpu_ratio = sum(o for o, _ in cpus) / sum(p for _, p in cpus)
    loss_diff = max(abs(o - p) / abs(p) for p, o in losses)
    result = {
        "variant": f"ddp x{world} (gloo)" if world > 1 else "single process", "check_every": args.check_every,
        "lightning_sigterm_broadcast": args.lightning_sigterm_broadcast,
        "accelerator": args.accelerator, "precision": args.precision, "channels_last": args.channels_last,
        "block": args.block, "ours_images_per_sec": args.batch_size * world * len(walls) / sum(o for o, _ in walls),
        "arch": args.arch, "image_size": args.image_size, "batch_size": args.batch_size, "steps": args.steps,
        "rounds": args.rounds, "paired_steps": len(walls), "threads": torch.get_num_threads(),
        "plain_step_s": plain_median, "ours_step_s": ours_median, "ratio": ratio,
        "median_pair_ratio": statistics.median(o / p for o, p in walls),
        "median_pair_cpu_ratio": statistics.median(o / p for o, p in cpus),
        "median_step_ratio": ours_median / plain_median, "round_ratios": round_ratios, "cpu_ratio": cpu_ratio,
        "loss_plain": losses[-1][0], "loss_ours": losses[-1][1],
        "loss_rel_diff": loss_diff, "losses_agree": loss_diff <= args.tolerance,
    }
    if rank == 0:
        print(
            f"{result['variant']} ({args.accelerator}, {args.precision}{', channels_last' if args.channels_last else ''}"
            f"{f', turns of {args.block} steps' if args.block > 1 else ''}): "
            f"{args.arch} {args.image_size}px batch {args.batch_size}, {args.rounds} rounds x "
            f"{args.steps} steps, {result['threads']} thread(s)/process\n"
            f"  ratio ours/plain, total time over {len(walls)} paired steps: {ratio:.4f} (CPU time: {cpu_ratio:.4f}); "
            f"per round: {', '.join(f'{r:.3f}' for r in round_ratios)}\n"
            f"  median of the per-pair ratios: {result['median_pair_ratio']:.4f} "
            f"(CPU time: {result['median_pair_cpu_ratio']:.4f})\n"
            f"  median step: plain {plain_median * 1e3:.1f} ms, ours {ours_median * 1e3:.1f} ms, "
            f"their ratio {result['median_step_ratio']:.4f}\n"
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
