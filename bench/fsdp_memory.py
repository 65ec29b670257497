"""Peak memory per rank, ddp against fsdp2, side by side: ViT-B/16 and ResNet-50 on 2 CPU processes (gloo).

    python bench/fsdp_memory.py                                  # both networks, 224 px, batch 2 per rank, 3 SGD steps
    python bench/fsdp_memory.py --archs resnet18 --image-size 32 --steps 2      # a quick check (~1 min)

Each (network, strategy) pair runs in 2 fresh processes: torch DistributedDataParallel, or the template's FSDP2 wrapping
(project.backbones.shard_blocks + classifier_engine.shard, what `strategy: fsdp2` does in configure_model).
Per rank it reports the training state it holds (parameters + gradients + SGD momentum: the local shard under fsdp2)
and the peak resident memory of the steps over the process's resident memory before the network was built (sampled
every 2 ms). Results and the command behind them: docs/benchmarks.md#fsdp-memory.
"""

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel
from torchvision import models

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine" / "tests"))  # local_services
from classifier_engine.strategies.fsdp import shard  # noqa: E402
from local_services import free_port  # noqa: E402  (engine/tests/local_services.py)

from project.backbones import shard_blocks  # noqa: E402  the checkout's, not an installed copy


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The highest resident memory seen while it runs, sampled in a thread."""

    def __init__(self) -> None:
        self.peak, self._stop = rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def local_bytes(tensors) -> int:
    """Bytes this rank holds: a DTensor's local shard, a plain tensor whole."""
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def build(arch: str, strategy: str, image_size: int, mesh) -> torch.nn.Module:
    torch.manual_seed(0)
    options = {"image_size": image_size} if arch.startswith("vit") else {}
    network = models.get_model(arch, weights=None, num_classes=1000, **options)
    if strategy == "ddp":
        return DistributedDataParallel(network)
    shard(network, shard_blocks(network), mesh)
    return network


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))  # before the baseline: imports and the process group are not counted
    before = rss_bytes()
    with PeakRss() as peak:
        network = build(args.arch, args.strategy, args.image_size, mesh)
        optimizer = torch.optim.SGD(network.parameters(), lr=0.01, momentum=0.9)
        images = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
        labels = torch.randint(0, 1000, (args.batch_size,))
        start = time.perf_counter()
        for _ in range(args.steps):
            loss = torch.nn.functional.cross_entropy(network(images), labels)
            loss.backward()
            optimizer.step()  # gradients kept (not zeroed) so the state counted below holds them
        seconds = (time.perf_counter() - start) / args.steps
    params = list(network.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    row = {"arch": args.arch, "strategy": args.strategy, "rank": rank,
           "state_mib": local_bytes([*params, *(p.grad for p in params), *state]) / 2**20,
           "peak_rss_mib": (peak.peak - before) / 2**20, "step_s": seconds}
    Path(out, f"{rank}.json").write_text(json.dumps(row))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default="vit_b_16,resnet50")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    import tempfile

    rows = []
    for arch in args.archs.split(","):
        for strategy in ("ddp", "fsdp2"):
            run = argparse.Namespace(**vars(args), arch=arch, strategy=strategy)
            with tempfile.TemporaryDirectory() as out:
                mp.spawn(rank_main, args=(args.world, free_port(), run, out), nprocs=args.world)
                rows += [json.loads(Path(out, f"{r}.json").read_text()) for r in range(args.world)]
    print("| network | strategy | training state per rank (MiB) | peak RSS over start per rank (MiB) | s/step |")
    print("|---|---|---|---|---|")
    for arch in args.archs.split(","):
        for strategy in ("ddp", "fsdp2"):
            mine = [r for r in rows if r["arch"] == arch and r["strategy"] == strategy]
            state = " / ".join(f"{r['state_mib']:.0f}" for r in mine)
            peak = " / ".join(f"{r['peak_rss_mib']:.0f}" for r in mine)
            print(f"| {arch} | {strategy} | {state} | {peak} | {max(r['step_s'] for r in mine):.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
