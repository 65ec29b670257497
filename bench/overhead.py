"""Template overhead: one ResNet trained by a plain PyTorch loop, by stock Lightning and by this template, step by step.

    python bench/overhead.py                # 1 CPU process: step-time ratios plain -> stock Lightning -> this template
    python bench/overhead.py --ddp          # 2 gloo processes: DistributedDataParallel, stock strategy="ddp", ours
    python bench/overhead.py --quick        # the CI smoke run (add --ddp for its 2-process variant)
    python bench/overhead.py --progress-bar                 # with a progress bar in both Lightning arms
    python bench/overhead.py --ddp --check-every 1        # our stop-signal agreement every step, not every 10th
    python bench/overhead.py --ddp --lightning-sigterm-broadcast    # with Lightning's per-step broadcast kept
    python bench/overhead.py --lightning-log-move           # with Lightning's no-op move in every self.log kept
    python bench/overhead.py --lightning-batch-dispatch     # with Lightning's no-op per-batch hook calls kept in ours
    python bench/overhead.py --accelerator gpu --precision bf16-mixed --channels-last --arch resnet50 \
        --image-size 224 --batch-size 256 --block 10 --tolerance 0.05     # one GPU (bash bench/gpu_all.sh runs it)

Three arms get the same network (built under the same seed), the same synthetic batches, SGD with the same LR
schedule (project.optim), the same step count and the same threads, and must end at the same loss:
    plain   the textbook loop (PlainLoop);
    stock   a minimal LightningModule (StockClassifier: loss, self.log("train/loss"), the same optimizer and schedule)
            under a stock `lightning.Trainer` with what a user gets without asking: its default TensorBoard logger and
            its default ModelCheckpoint (one save at the epoch end), no callbacks of ours;
    ours    ImageClassifier and the Trainer as `python -m project fit` builds them (classifier_engine.cli.cli_main: its
            callbacks, plugins and strategy), fed the same synthetic data; self.log without Lightning's no-op move
            (classifier_engine/compat/log_device_move.py, installed here too until the CLI does it).
Both Lightning arms log every 10 steps, validate never and show no progress bar (--progress-bar: one in both,
refreshed every 10 steps). After two short untimed warm-up rounds, each round trains one Lightning arm, stock and
ours in turn, with a fresh plain loop beside it in the same process, taking turns one step at a time: after each of
the Trainer's steps a callback runs one plain step (Interleave). A plain step counts fetching, forward, backward and
the optimizer; a Lightning step is everything between two plain steps (fetching, hooks, logging, checkpoint
bookkeeping). An arm's ratio is its total time over that of the plain steps paired with it, summed over all its
rounds after --skip steps each, so the steps that write logs count with their weight; pairing each step with its
neighbour means a change in the machine's speed (other load, heat) hits both alike, which separate back-to-back runs
could not resolve on a shared 2-core machine (their per-run ratios spread over ±10 %). Ours over stock is the mean,
over adjacent rounds, of ours' ratio over stock's: the drift between their rounds cancels in the plain reference.
(Both Lightning arms in one round, the stock one in a second thread, was tried and left: the same stock arm in the
main thread and in a second one read 1.027 apart, and a second thread runs torch's parallel ops in an OpenMP pool of
its own, so the arms would not run alike.) Also reported: the median of the per-pair ratios (an ordinary,
non-logging step), CPU-time ratios and each round's ratio. Not timed: building the arms, and what follows the last
step (the end-of-epoch checkpoint save). On a GPU the sides alternate every --block steps, with the device
synchronized only at the turns, so within a turn each side's host work overlaps its kernels as in a real run; mixed
precision (the plain loop under torch.autocast) changes the numerics from run to run, hence a looser --tolerance
there.
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
from classifier_engine.compat.batch_dispatch import LeanBatchDispatch  # noqa: E402
from classifier_engine.compat.log_device_move import skip_same_device_moves  # noqa: E402
from classifier_engine.data.transforms import IMAGENET_MEAN, IMAGENET_STD, NormalizeBatch  # noqa: E402
from lightning.pytorch.callbacks import TQDMProgressBar  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from project import cli_main  # noqa: E402
from project.backbones import build_network  # noqa: E402
from project.optim import parameter_groups, scaled_lr, warmup_then_decay  # noqa: E402
from synthetic import ReplayedBatches, SyntheticDataModule, synthetic_batches  # noqa: E402

RECIPE = dict(lr_per_256=0.1, momentum=0.9, weight_decay=1e-4, warmup_epochs=0.2)  # SGD, cosine after the warmup
LOG_EVERY = 10  # both Lightning arms write their step metrics every this many steps (quickstart.yaml's value)
LIGHTNING_ARMS = ("stock", "ours")  # the rounds alternate between them, stock first

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


def build_optimizer_and_schedule(network: torch.nn.Module, args, world: int):
    """The recipe plain and stock share, ImageClassifier's defaults: SGD over project.optim's parameter groups, LR per
    256 images scaled by the global batch, warmup then cosine per step."""
    lr = scaled_lr(RECIPE["lr_per_256"], args.batch_size * world)
    groups = parameter_groups(network, RECIPE["weight_decay"], decay_norm_and_bias=True)
    optimizer = torch.optim.SGD(groups, lr=lr, momentum=RECIPE["momentum"])
    scheduler = warmup_then_decay(optimizer, total_steps=args.steps,
                                  warmup_steps=round(RECIPE["warmup_epochs"] * args.steps), schedule="cosine")
    return optimizer, scheduler


class PlainLoop:
    """The textbook loop, one step per call: fetch, forward, loss, zero_grad, backward, step, schedule."""

    def __init__(self, args, batches, world: int, device: torch.device):
        torch.manual_seed(args.seed)
        self.device, self.channels_last, self.autocast = device, args.channels_last, AUTOCAST[args.precision]
        torch.backends.cudnn.benchmark = True  # cuDNN autotuning, as the Lightning arms (benchmark=True) and configs
        self.network = build_network(args.arch, args.num_classes).to(device)
        if self.channels_last:
            self.network.to(memory_format=torch.channels_last)
        self.model = DistributedDataParallel(self.network) if world > 1 else self.network
        self.optimizer, self.scheduler = build_optimizer_and_schedule(self.network, args, world)
        if device.type == "cuda":  # pinned, as SyntheticDataModule pins the Lightning arms': asynchronous copies
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


class StockClassifier(L.LightningModule):
    """The LightningModule a user writes from Lightning's docs for this recipe, and nothing else."""

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.network = build_network(args.arch, args.num_classes)
        if args.channels_last:
            self.network.to(memory_format=torch.channels_last)

    def training_step(self, batch, batch_idx):
        images, targets = batch  # normalized on the device by SyntheticDataModule, as for ours
        if self.args.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        loss = F.cross_entropy(self.network(images), targets)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer, scheduler = build_optimizer_and_schedule(self.network, self.args, self.trainer.world_size)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Interleave(L.Callback):
    """Runs `block` plain steps after every `block` of the Lightning arm's steps (1 on CPU), so the two alternate and
    any change in the machine's speed hits both alike. The arm's time is from the end of one plain block to the start
    of the next: whole cycles of its Trainer (hooks, logging, fetching, the steps), nothing of the plain loop."""

    def __init__(self, plain: PlainLoop, block: int = 1):
        self.plain, self.block = plain, block
        self.arm: list[Clock] = []
        self.plains: list[Clock] = []
        self._resumed: Clock | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % self.block:
            return
        synchronize(self.plain.device)  # the arm's kernels are done: its clock stops
        start = clock()
        for _ in range(self.block):
            self.plain.step()
        synchronize(self.plain.device)
        end = clock()
        self.plains.append((end[0] - start[0], end[1] - start[1]))
        if self._resumed is not None:  # the first block holds the set-up: not a step
            self.arm.append((start[0] - self._resumed[0], start[1] - self._resumed[1]))
        self._resumed = clock()


class StockSigtermBroadcast(L.Callback):
    """Lightning's broadcast of a SIGTERM flag each step, back after LastCheckpoint took it away in its on_train_start
    (Lightning runs Checkpoint callbacks after all others, so this hook, at the epoch start, is the first that can)."""

    def on_train_epoch_start(self, trainer, pl_module):
        # undo classifier_engine.compat.sigterm_broadcast's skip (--lightning-sigterm-broadcast measures its cost)
        vars(trainer.fit_loop.epoch_loop).pop("_broadcast_sigterm_tensor", None)
        assert "_broadcast_sigterm_tensor" not in vars(trainer.fit_loop.epoch_loop), "the stock broadcast is still off"


def class_folders(root: Path, num_classes: int) -> Path:
    """An ImageNet-layout stub with `num_classes` class folders: the CLI links the model's class count from the data
    module it builds (data.num_classes), which only lists folders; the arms then train on synthetic batches."""
    for split in ("train", "val"):
        for index in range(num_classes):
            folder = root / split / f"class{index:04d}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "0.jpg").touch()
    return root


def ours_through_the_cli(args, world: int, workdir: Path, classes: Path) -> tuple[L.LightningModule, L.Trainer]:
    """ImageClassifier and the Trainer exactly as `python -m project fit` builds them from these flags."""
    flags = {
        "seed_everything": args.seed,  # the same initial weights as the other arms'
        "trainer.accelerator": args.accelerator, "trainer.devices": world,
        "trainer.strategy": "ddp" if world > 1 else "auto", "trainer.precision": args.precision,
        "trainer.benchmark": True,
        "trainer.max_steps": args.steps, "trainer.max_epochs": 1, "trainer.limit_val_batches": 0,
        "trainer.num_sanity_val_steps": 0, "trainer.log_every_n_steps": LOG_EVERY,
        "trainer.default_root_dir": workdir / "ours", "trainer.enable_model_summary": False,
        "trainer.enable_progress_bar": args.progress_bar,
        "model.arch": args.arch, "model.channels_last": args.channels_last,
        **{f"model.optim.{key}": value for key, value in RECIPE.items()},
        "data.root": classes, "data.batch_size": args.batch_size, "data.num_workers": 0,
    }
    if args.check_every is not None:
        flags["last_checkpoint.check_every_n_steps"] = args.check_every
    cli = cli_main([f"--{key}={str(value).lower() if isinstance(value, bool) else value}"
                    for key, value in flags.items()], run=False)
    return cli.model, cli.trainer


def stock_trainer(args, world: int, workdir: Path, callbacks: list[L.Callback]) -> L.Trainer:
    """A stock Trainer: Lightning's default logger (TensorBoard) and checkpointing, the run settings ours gets."""
    bar = [TQDMProgressBar(refresh_rate=LOG_EVERY)] if args.progress_bar else []
    return L.Trainer(
        accelerator=args.accelerator, devices=world, strategy="ddp" if world > 1 else "auto",
        precision=args.precision, benchmark=True, max_steps=args.steps, max_epochs=1, limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=LOG_EVERY, default_root_dir=workdir / "stock", callbacks=bar + callbacks,
        enable_progress_bar=args.progress_bar, enable_model_summary=False,
    )


def interleaved_run(args, batches, world: int, workdir: Path, classes: Path, arm: str
                    ) -> tuple[Interleave, dict[str, float]]:
    """One round: a fresh plain loop and a fresh `arm` ("stock" or "ours") taking turns for --steps steps each; the
    losses both end at."""
    device = torch.device("cuda", torch.cuda.current_device()) if args.accelerator == "gpu" else torch.device("cpu")
    interleave = Interleave(PlainLoop(args, batches, world, device), args.block)
    if arm == "stock":
        torch.manual_seed(args.seed)
        model = StockClassifier(args)
        trainer = stock_trainer(args, world, workdir, [interleave])
    else:
        model, trainer = ours_through_the_cli(args, world, workdir, classes)
        trainer.callbacks.append(interleave)
        # Until classifier_engine.cli installs it (a no-op then); --lightning-log-move keeps Lightning's move.
        skip_same_device_moves(trainer, skip=not args.lightning_log_move)
        if args.lightning_sigterm_broadcast:
            trainer.callbacks.append(StockSigtermBroadcast())
        if args.lightning_batch_dispatch:  # the CLI's LeanBatchDispatch out: every hook called, every step inspected
            trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, LeanBatchDispatch)]
    trainer.fit(model, datamodule=SyntheticDataModule(
        num_classes=args.num_classes, batch_size=args.batch_size, image_size=args.image_size,
        batches_per_epoch=args.steps, distinct_batches=args.distinct, seed=args.seed,
    ))
    return interleave, {"plain": eval_loss(interleave.plain.network, batches[0]),
                        arm: eval_loss(model.network, batches[0])}


def relaunch_with_torchrun(argv: list[str]) -> int:
    """The 2-process variant runs every arm inside the same 2 processes, started here by torchrun."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, *argv]
    return subprocess.call(command, env={**os.environ, "OMP_NUM_THREADS": "1"})


def compare(rounds: list[list[tuple[Clock, Clock]]]) -> dict:
    """One Lightning arm against the plain steps it was paired with: total wall and CPU time ratios, the median of
    the per-step ratios, each round's ratio, and the mean extra time per step."""
    pairs = [pair for r in rounds for pair in r]
    return {
        "ratio": sum(a[0] for a, _ in pairs) / sum(p[0] for _, p in pairs),
        "cpu_ratio": sum(a[1] for a, _ in pairs) / sum(p[1] for _, p in pairs),
        "median_pair_ratio": statistics.median(a[0] / p[0] for a, p in pairs),
        "median_pair_cpu_ratio": statistics.median(a[1] / p[1] for a, p in pairs),
        "round_ratios": [sum(a[0] for a, _ in r) / sum(p[0] for _, p in r) for r in rounds],
        "extra_ms_per_step": 1e3 * statistics.fmean(a[0] - p[0] for a, p in pairs),
        "paired_steps": len(pairs),
        "mean_step_s": statistics.fmean(a[0] for a, _ in pairs),
        "plain_mean_step_s": statistics.fmean(p[0] for _, p in pairs),
    }


def ratio_of(ours: dict, stock: dict) -> dict:
    """Ours over stock, each measured against the plain steps beside it, so the drift of the machine between their
    rounds cancels in the plain reference. The headline is the mean over adjacent rounds (stock, then ours): a ratio
    of totals would weigh each arm's rounds by how slow the machine was during them."""
    round_ratios = [o / s for o, s in zip(ours["round_ratios"], stock["round_ratios"])]
    return {
        "ratio": statistics.fmean(round_ratios), "round_ratios": round_ratios,
        "ratio_of_totals": ours["ratio"] / stock["ratio"],
        **{key: ours[key] / stock[key] for key in ("cpu_ratio", "median_pair_ratio", "median_pair_cpu_ratio")},
        "extra_ms_per_step": ours["extra_ms_per_step"] - stock["extra_ms_per_step"],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ddp", action="store_true", help="2 gloo processes (relaunches itself with torchrun)")
    parser.add_argument("--quick", action="store_true", help="fewer, smaller steps: the CI smoke run")
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=None, help="per process (default 32; 8 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="steps per round (default 40; 8 with --quick)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="fresh runs, alternately stock and ours, each with a fresh plain loop beside it "
                             "(default 6; 4 with --quick)")
    parser.add_argument("--skip", type=int, default=None, help="warm-up steps left out (default 2, or one --block)")
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--distinct", type=int, default=4, help="distinct synthetic batches cycled over")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per process (default: torch's; 1 with --quick, steadier on shared cores)")
    parser.add_argument("--max-ratio", type=float, default=None, help="exit 1 if ours / plain is above this")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="largest relative loss difference allowed")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu", help="gpu: one CUDA device per process")
    parser.add_argument("--precision", choices=list(AUTOCAST), default="32-true")
    parser.add_argument("--channels-last", action="store_true", help="NHWC network and inputs in every arm")
    parser.add_argument("--block", type=int, default=1, help="steps per turn of each arm (GPU: 10 lets them overlap)")
    parser.add_argument("--progress-bar", action="store_true",
                        help="a progress bar in both Lightning arms (ours: the CLI's; stock: TQDMProgressBar), "
                             f"refreshed every {LOG_EVERY} steps")
    parser.add_argument("--check-every", type=int, default=None,
                        help="--last_checkpoint.check_every_n_steps: how often ddp ranks agree on stop signals "
                             "(default: the callback's, 10); 1 is one all-reduce per step, as Lightning's own check")
    parser.add_argument("--lightning-sigterm-broadcast", action="store_true",
                        help="keep Lightning's per-step SIGTERM broadcast in ours, which the template skips (its cost)")
    parser.add_argument("--lightning-log-move", action="store_true",
                        help="keep Lightning's move of each logged value to its own device in ours, which the template "
                             "skips (classifier_engine/compat/log_device_move.py; its cost)")
    parser.add_argument("--lightning-batch-dispatch", action="store_true",
                        help="keep Lightning's calls of no-op per-batch hooks and its per-step signature reads in "
                             "ours, which the template skips (classifier_engine/compat/batch_dispatch.py; their cost)")
    args = parser.parse_args(argv)
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        parser.error("--accelerator gpu needs a CUDA device; none is visible here")
    args.batch_size = args.batch_size or (8 if args.quick else 32)
    args.steps = args.steps or (8 if args.quick else 40)
    args.threads = args.threads or (1 if args.quick else None)
    args.rounds = args.rounds or (4 if args.quick else 6)
    args.skip = args.skip if args.skip is not None else max(2, args.block)
    if args.rounds < 2:
        parser.error(f"--rounds must be >= 2 (stock, then ours), got {args.rounds}")
    if args.steps <= args.skip + 2 * args.block or args.steps % args.block or args.skip % args.block:
        parser.error(f"--steps ({args.steps}) must exceed --skip + 2 x --block ({args.skip} + 2 x {args.block}), "
                     "and both be multiples of --block")

    if args.ddp and "TORCHELASTIC_RUN_ID" not in os.environ:
        return relaunch_with_torchrun(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    world, rank = 1, 0
    if args.ddp:
        dist.init_process_group("gloo")  # the Trainers find it initialized and reuse it
        world, rank = dist.get_world_size(), dist.get_rank()

    batches = synthetic_batches(
        batch_size=args.batch_size, image_size=args.image_size, num_classes=args.num_classes,
        distinct=args.distinct, seed=args.seed + rank,
    )
    # Per arm, per round, per measured step: ((wall, CPU) of the arm's step, (wall, CPU) of the plain step after it).
    rounds: dict[str, list[list[tuple[Clock, Clock]]]] = {"stock": [], "ours": []}
    losses: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as own:
        classes = class_folders(Path(own), args.num_classes)  # this process's: no race between ranks
        workdir = Path(tmp)
        if world > 1:  # every rank must log into the one directory rank 0 created
            holder = [str(workdir)]
            dist.broadcast_object_list(holder, src=0)
            workdir = Path(holder[0])
        # Untimed: the first run of Lightning's loop in a process is slower (its code and caches are cold), and the
        # first measured round would always be stock's.
        warmup = argparse.Namespace(**{**vars(args), "steps": 2 * args.block})
        for arm in LIGHTNING_ARMS:
            interleaved_run(warmup, batches, world, workdir / f"warmup_{arm}", classes, arm)
        for index in range(args.rounds):
            arm = LIGHTNING_ARMS[index % 2]
            if world > 1:
                dist.barrier()
            run, round_losses = interleaved_run(args, batches, world, workdir / f"round{index}", classes, arm)
            pairs = list(zip(run.arm, run.plains[1:]))[args.skip // args.block:]  # per block, in seconds per step
            rounds[arm].append([((a[0] / args.block, a[1] / args.block), (p[0] / args.block, p[1] / args.block))
                                for a, p in pairs])
            losses.append(round_losses)

    stock, ours = compare(rounds["stock"]), compare(rounds["ours"])
    paired = {arm: [pair for r in rounds[arm] for pair in r] for arm in LIGHTNING_ARMS}
    medians = {arm: statistics.median(a[0] for a, _ in paired[arm]) for arm in LIGHTNING_ARMS}
    plain_median = statistics.median(p[0] for _, p in paired["ours"])  # the plain steps beside ours
    loss_diff = max(abs(r[arm] - r["plain"]) / abs(r["plain"]) for r in losses for arm in r if arm != "plain")
    last = {arm: next(r[arm] for r in reversed(losses) if arm in r) for arm in ("plain", *LIGHTNING_ARMS)}
    result = {
        "variant": f"ddp x{world} (gloo)" if world > 1 else "single process", "check_every": args.check_every,
        "lightning_sigterm_broadcast": args.lightning_sigterm_broadcast,
        "lightning_log_move": args.lightning_log_move, "lightning_batch_dispatch": args.lightning_batch_dispatch,
        "progress_bar": args.progress_bar,
        "accelerator": args.accelerator, "precision": args.precision, "channels_last": args.channels_last,
        "block": args.block, "ours_images_per_sec": args.batch_size * world / ours["mean_step_s"],
        "arch": args.arch, "image_size": args.image_size, "batch_size": args.batch_size, "steps": args.steps,
        "rounds": args.rounds, "threads": torch.get_num_threads(), "cudnn_benchmark": torch.backends.cudnn.benchmark,
        # ours against plain under the keys the CI test and bench/gpu_table.py read
        **ours, "median_step_ratio": medians["ours"] / plain_median,
        "plain_step_s": plain_median, "stock_step_s": medians["stock"], "ours_step_s": medians["ours"],
        "stock": stock, "ours_over_stock": ratio_of(ours, stock),
        "loss_plain": last["plain"], "loss_stock": last["stock"], "loss_ours": last["ours"],
        "loss_rel_diff": loss_diff, "losses_agree": loss_diff <= args.tolerance,
    }
    if rank == 0:
        print(report(result, args))
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


def report(result: dict, args) -> str:
    lines = [
        f"{result['variant']} ({args.accelerator}, {args.precision}{', channels_last' if args.channels_last else ''}"
        f"{f', turns of {args.block} steps' if args.block > 1 else ''}"
        f"{', progress bars' if args.progress_bar else ''}): "
        f"{args.arch} {args.image_size}px batch {args.batch_size}, {args.rounds} rounds x {args.steps} steps, "
        f"{result['threads']} thread(s)/process",
        f"  {'':<24}{'steps':>6}{'mean step, arm / plain':>26}{'total ratio':>13}{'CPU time':>10}{'median pair':>13}"
        "   per round",
    ]
    for name, part in (("stock Lightning / plain", result["stock"]), ("this template / plain", result),
                       ("this template / stock *", result["ours_over_stock"])):
        if "mean_step_s" in part:
            count = part["paired_steps"]
            step = f"{1e3 * part['mean_step_s']:.1f} / {1e3 * part['plain_mean_step_s']:.1f} ms"
        else:
            count, step = "", f"{part['extra_ms_per_step']:+.2f} ms"
        lines.append(f"  {name:<24}{count:>6}{step:>26}{part['ratio']:>13.4f}{part['cpu_ratio']:>10.4f}"
                     f"{part['median_pair_ratio']:>13.4f}   {', '.join(f'{r:.3f}' for r in part['round_ratios'])}")
    lines.append("  * mean of the adjacent rounds' ratios (ratio of the totals: "
                 f"{result['ours_over_stock']['ratio_of_totals']:.4f}); CPU time and median: ratios of the two rows")
    lines.append(f"  loss after {args.steps} steps: plain {result['loss_plain']:.8f}, "
                 f"stock {result['loss_stock']:.8f}, "
                 f"ours {result['loss_ours']:.8f}; max relative difference {result['loss_rel_diff']:.2e} "
                 f"({'agree' if result['losses_agree'] else 'DISAGREE'}, tolerance {args.tolerance:g})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
