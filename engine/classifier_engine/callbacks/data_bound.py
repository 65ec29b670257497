"""Is the run data-bound? At each epoch's end (log, perf/* in the loggers) and in the fit's last line: the share of step
time spent waiting for the next batch, what a loader worker spends per image, and the fix that would help most.

    python -m classifier_engine fit --config CONFIG --throughput.data_bound_at=0.1   # docs/data.md, data-bound
"""

import math
import os
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import torch
from lightning.pytorch.utilities import rank_zero_info

from classifier_engine.data.decoders import CPU_DECODERS
from classifier_engine.data.image_data import ImageDataModule
from classifier_engine.data.image_folders import DecodedImages, EncodedImages
from classifier_engine.data.partial_decode import EncodedJpeg
from classifier_engine.seeds import SeededSamples

PROBE_IMAGES, PROBE_SECONDS = 8, 1.0  # timed at each epoch's end, in this process: at most so many, so long
SHARD_SIDE = 256  # make_shards' short side


@dataclass(frozen=True)
class WorkerCost:
    """Seconds one loader worker spends per training image; decode and augment apart where the data set says."""

    load: float  # the data set's __getitem__: decode + augment
    collate: float
    decode: Optional[float] = None
    side: Optional[float] = None  # the decoded images' mean short side

    def parts(self) -> str:
        ms = [f"decode {1e3 * self.decode:.3g}", f"augment {1e3 * (self.load - self.decode):.3g}"] if (
            self.decode is not None) else [f"decode+augment {1e3 * self.load:.3g}"]
        return ", ".join([*ms, f"collate {1e3 * self.collate:.3g}"])


def worker_cost(loader: Any, epoch: int) -> Optional[WorkerCost]:
    """A worker's cost per image of `loader`, timed on a few of its images here, on one thread as a worker runs
    (None for a loader that is not a map-style DataLoader). The run's random streams are left as they were."""
    dataset, collate = getattr(loader, "dataset", None), getattr(loader, "collate_fn", None)
    if collate is None or not hasattr(dataset, "__len__") or len(dataset) == 0:
        return None
    inner = dataset.dataset if isinstance(dataset, SeededSamples) else dataset
    decodes = isinstance(inner, DecodedImages) and not isinstance(inner, EncodedImages)  # a device decoder's: bytes
    indices = range(0, len(dataset), max(1, len(dataset) // PROBE_IMAGES))[:PROBE_IMAGES]
    threads, state = torch.get_num_threads(), random.getstate()
    torch.set_num_threads(1 if getattr(loader, "num_workers", 0) else threads)
    samples, load, decode, sides = [], 0.0, 0.0, []
    try:
        with torch.random.fork_rng(devices=[]):
            for index in indices:
                start = time.perf_counter()
                samples.append(dataset[(index, epoch, 0)] if isinstance(dataset, SeededSamples) else dataset[index])
                took = time.perf_counter() - start
                load += took
                if decodes:
                    start = time.perf_counter()
                    image = inner.loader(inner.samples[index][0])
                    if isinstance(image, EncodedJpeg):  # decoded in part by the transform: a whole decode, at most
                        image = image.whole()  # the sample's time, stands for it
                    sides.append(min(image.shape[-2:] if isinstance(image, torch.Tensor) else image.size))
                    decode += min(time.perf_counter() - start, took)
                if load > PROBE_SECONDS:
                    break
            start = time.perf_counter()
            collate(samples)
            collated = time.perf_counter() - start
    except Exception:  # an image that does not load, a collate that needs more: no figure, never a stopped run
        return None
    finally:
        torch.set_num_threads(threads)
        random.setstate(state)
    n = len(samples)
    return WorkerCost(load / n, collated / n, decode / n if sides else None, sum(sides) / n if sides else None)


def best_fix(cost: WorkerCost, images_per_sec: float, *, workers: int, cores: int, gpu: bool = False,
             decoder: Optional[str] = None, crop: Optional[int] = None) -> str:
    """The fix that would speed the input pipeline most, by its estimated factor: more workers (up to `cores` a
    process), GPU decode, shards, a smaller train crop (the last three for an image data module's `decoder`, `crop`)."""
    per_image = cost.load + cost.collate
    fixes = {}  # text -> factor by which the pipeline's rate would grow
    if workers < cores:
        more = min(cores, max(math.ceil(images_per_sec * per_image), workers + 1))  # as many as keep up, if there are
        fixes[f"more workers (--data.num_workers={more}; {cores} cores a process)"] = more / max(1, workers)
    if decoder is not None and cost.decode is not None:
        if gpu and decoder in CPU_DECODERS:
            fixes["GPU decode (--data.decoder=nvjpeg)"] = per_image / (per_image - cost.decode)
        if cost.side and cost.side > SHARD_SIDE:  # image files (shards decode elsewhere: no decode figure)
            saved = cost.decode * (1 - (SHARD_SIDE / cost.side) ** 2)
            fixes[f"shards of {SHARD_SIDE} px (python -m classifier_engine.data.make_shards)"] = per_image / (
                per_image - saved)
        if crop is not None and crop > 128:
            saved = (cost.load - cost.decode) * (1 - ((crop - 32) / crop) ** 2)
            fixes[f"a smaller crop (--data.train_crop_size={crop - 32})"] = per_image / (per_image - saved)
    if not fixes or max(fixes.values()) <= 1.0:
        return f"none of more workers, GPU decode, shards or a smaller crop applies here ({workers} workers)"
    return max(fixes, key=fixes.get)


class DataVerdict:
    """The waits and step times ThroughputLogger measures, summed per epoch and over the run, judged against
    `threshold` (the share of step time spent waiting above which a run is data-bound)."""

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.epoch, self.run = Counter(), Counter()  # "wait", "busy" (seconds) and "images"
        self.cost: Optional[WorkerCost] = None

    def add(self, wait: float = 0.0, busy: float = 0.0, images: int = 0) -> None:
        for totals in (self.epoch, self.run):
            totals.update(wait=wait, busy=busy, images=images)

    def judge(self, trainer: Any, totals: dict[str, float]) -> Optional[tuple[str, dict[str, float]]]:
        """(the line, its perf/* figures) for `totals`; None before any step."""
        elapsed = totals["wait"] + totals["busy"]
        if elapsed <= 0 or totals["busy"] <= 0:
            return None
        share = totals["wait"] / elapsed
        metrics = {"perf/epoch_data_wait": share}
        bound = share > self.threshold
        line = (f"{'data-bound' if bound else 'input keeps up'}: the step waited {100 * share:.0f} % of its time for "
                f"the next batch (data-bound above {100 * self.threshold:.0f} %)")
        if self.cost is not None:
            cost, workers = self.cost, trainer.train_dataloader.num_workers
            per_image = cost.load + cost.collate
            metrics.update({"perf/worker_ms_per_image": 1e3 * per_image, "perf/worker_ms_collate": 1e3 * cost.collate})
            if cost.decode is not None:
                metrics.update({"perf/worker_ms_decode": 1e3 * cost.decode,
                                "perf/worker_ms_augment": 1e3 * (cost.load - cost.decode)})
            where = f"{workers} workers" if workers else "in the main process: data.num_workers=0"
            line += f"; a worker spends {1e3 * per_image:.3g} ms an image ({cost.parts()}; {where})"
            if bound:
                data, image_data = trainer.datamodule, isinstance(trainer.datamodule, ImageDataModule)
                cores = len(os.sched_getaffinity(0)) // max(1, trainer.world_size // trainer.num_nodes)
                crop = data.hparams.train_crop_size if image_data and not data.hparams.progressive_resizing else None
                line += "; the fix that would help most here: " + best_fix(
                    cost, totals["images"] / totals["busy"], workers=workers, cores=cores, crop=crop,
                    gpu=trainer.strategy.root_device.type == "cuda", decoder=data.decoder if image_data else None)
        return line, metrics

    def epoch_end(self, trainer: Any) -> None:
        """The epoch's line in the log and its figures in the loggers (rank 0, which times the workers' cost)."""
        if trainer.is_global_zero:
            self.cost = worker_cost(trainer.train_dataloader, trainer.current_epoch) or self.cost
            judged = self.judge(trainer, self.epoch)
            if judged is not None:
                line, metrics = judged
                rank_zero_info(f"epoch {trainer.current_epoch}: {line}")
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=trainer.global_step)
        self.epoch = Counter()
