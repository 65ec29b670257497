"""Samplers: exact evaluation at any world size, and a training order that resumes at any batch.

    python -m classifier_engine fit --config CONFIG --ckpt_path last    # continues mid-epoch where it stopped
"""

from collections.abc import Mapping
from typing import Any, Iterator, Optional

import lightning as L
import torch
from lightning.fabric.utilities.data import sized_len
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, SequentialSampler

from classifier_engine.compat.resume_batches import continue_epoch_at_batch
from classifier_engine.contract import CheckedCollate
from classifier_engine.errors import ConfigError
from classifier_engine.seeds import SeededSamples, order_seed


def global_batch_of(trainer: Optional[L.Trainer]) -> Optional[int]:
    """The run's --global_batch_size, from its run plan (None: no plan, or the world size's own batches)."""
    return getattr(getattr(trainer, "run_plan", None), "global_batch", None)


class ExactDistributedSampler(UnrepeatedDistributedSampler):
    """Every sample once over all ranks: shards rank::world_size, unpadded (docs/how-it-works.md#exact-evaluation)."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int):
        if len(dataset) < num_replicas:
            # A rank without a single image would have no batch: Lightning stops with an unclear error, or hangs.
            raise ConfigError(f"{len(dataset)} images for {num_replicas} processes: rank {num_replicas - 1} would "
                              "evaluate none; evaluate with fewer processes (--trainer.devices) or more images")
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)


Key = tuple[int, int, int]  # (index, epoch, repeat): what a training sample's augmentation is seeded from

# What decides which samples each step of an epoch takes (a loader state's keys, named as the user sets them): another
# value inside an epoch would train some of its samples twice and skip others.
ORDER = {"seed": "--seed_everything", "repeats": "--data.ra_reps", "global_batch": "--global_batch_size",
         "dataset_size": "the training set's length"}


def changed_inside_an_epoch(option: str, saved: Any, now: Any, where: str) -> str:
    """The one line refusing `option` changed from `saved` to `now` inside an epoch (`where`: the checkpoint and how
    far into which epoch it stopped), naming the value that continues it."""
    then, keep = (f"with {option} {saved}", f"{option} {saved}") if saved is not None else (
        f"without {option}", f"no {option}")
    return (f"{option} {now}: {where} {then}; another value inside an epoch trains some samples twice and skips "
            f"others: resume with {keep} (it may change at an epoch's end)")


class ResumableSampler(DistributedSampler):
    """The training order: a shuffle drawn from (seed, epoch), sharded rank::world_size, resumable at any position.
    Yields keys (index, epoch, repeat) for SeededSamples (plain indices with keys=False); `repeats` > 1 is repeated
    augmentation, in epochs of the same length. docs/how-it-works.md#resumable-order."""

    def __init__(self, dataset: Dataset, *, num_replicas: int, rank: int, seed: int, repeats: int = 1,
                 shuffle: bool = True, keys: bool = True, batch_size: Optional[int] = None,
                 global_batch: Optional[int] = None):
        """`batch_size`: the loader's, when it keeps its last partial batch (drop_last=False). `global_batch`
        (--global_batch_size, a multiple of num_replicas): epochs of whole global batches, alike at any world size."""
        if repeats < 1:
            raise ConfigError(f"data.ra_reps must be >= 1, got {repeats}")
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=False)
        self.global_batch = global_batch
        if global_batch is not None:
            # Every optimizer step takes global positions [s*N, (s+1)*N) of the epoch's order, whatever the world size:
            # rank r's micro-batches are order[r::W], b at a time, and b * W * accumulation = N. The last partial
            # global batch is left out (no padding, which would depend on W).
            self.total_size = len(dataset) // global_batch * global_batch
            if self.total_size == 0:
                raise ConfigError(f"{len(dataset)} training images are fewer than --global_batch_size {global_batch}: "
                                  "an epoch would train on nothing; lower --global_batch_size")
            self.num_samples = self.total_size // num_replicas
        elif batch_size is not None and batch_size > 1 and self.num_samples > 1 and self.num_samples % batch_size == 1:
            # A last batch of one sample makes BatchNorm raise in training: each rank's share takes one more sample
            # from the start of the order, as DistributedSampler pads the shares to one length.
            self.num_samples += 1
            self.total_size = self.num_samples * self.num_replicas
        self.repeats, self.batch_size = repeats, batch_size
        self.keys = keys  # False: plain indices, for a data set that does not seed its own augmentation
        self.position = 0  # global samples of the epoch in progress already handed out as batches
        self.changed_order: dict[str, tuple[Any, Any]] = {}  # what decides the order, changed since the saved state
        self.epoch_in_progress = 0
        self._resume_at: Optional[tuple[int, int]] = None  # (epoch, position) to continue from

    def epoch_order(self, epoch: int) -> list[tuple[int, int]]:
        """The global order of `epoch` as (index, repeat), total_size long (wrapped around to fill the last batch)."""
        generator = torch.Generator().manual_seed(order_seed(self.seed, epoch))
        permutation = self.permutation(generator) if self.shuffle else list(range(len(self.dataset)))
        order = [(index, repeat) for index in permutation for repeat in range(self.repeats)]
        while len(order) < self.total_size:  # as DistributedSampler pads: the first samples again
            order += order[: self.total_size - len(order)]
        return order[: self.total_size]

    def permutation(self, generator: torch.Generator) -> list[int]:
        """One epoch's shuffle of the indices (a subclass may draw it chunk-aware: classifier_engine/data/shards.py)."""
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def resume(self, epoch: int, position: int) -> None:
        """Continue `epoch` after its first `position` global samples (the next iteration of that epoch only)."""
        self._resume_at = (epoch, position)

    def loader_state(self, batch_size: Optional[int]) -> dict[str, Any]:
        """Rank-independent: the epoch in progress, the global samples it consumed, and what the order depends on."""
        return {"epoch": self.epoch_in_progress, "position": self.position, "seed": self.seed,
                "world_size": self.num_replicas, "batch_size": batch_size, "dataset_size": len(self.dataset),
                "repeats": self.repeats, "global_batch": self.global_batch}

    def restore_loader_state(self, batch_size: Optional[int], state: dict[str, Any]) -> None:
        """Resume where `state` stopped. The world size and per-process batch may change: the rest of the epoch comes
        in this run's batches, each sample once (with a global batch, in the same steps). What decides the order
        itself may not: it is kept in `changed_order` and refused at train start (ExactLoaders), where a resume
        inside that very epoch is known (a checkpoint saved at an epoch's end may change anything)."""
        now = {"seed": self.seed, "dataset_size": len(self.dataset), "repeats": self.repeats,
               "global_batch": self.global_batch}
        if self.global_batch is None:
            now.update(world_size=self.num_replicas, batch_size=batch_size)
        changed = {key: (state.get(key), value) for key, value in now.items() if state.get(key) != value}
        self.changed_order = {key: change for key, change in changed.items() if key in ORDER and (
            key != "global_batch" or change[1] is not None)}  # a global batch given up keeps the order: 16 -> none
        position = int(state["position"])
        allowed = {key: change for key, change in changed.items() if key not in self.changed_order}
        if allowed and position:
            what = ", ".join(f"{key} {old} -> {new}" for key, (old, new) in allowed.items())
            rank_zero_warn(f"resuming mid-epoch with {what}: the rest of epoch {state['epoch']} is not the order an "
                           "uninterrupted run would have seen (resume with the same settings for an exact resume)")
        if self.global_batch is not None and not self.changed_order:
            # A save inside an accumulation window kept none of its gradients: its samples are read again.
            position -= position % self.global_batch
        self.resume(int(state["epoch"]), position)

    def resumed_position(self, epoch: int) -> Optional[int]:
        """The global samples of `epoch` a pending resume skips (None: no resume of that epoch is pending)."""
        return self._resume_at[1] if self._resume_at is not None and self._resume_at[0] == epoch else None

    def resumed_share(self, epoch: int) -> Optional[int]:
        """Each rank's samples of `epoch` after a pending resume (None: none pending): the rest of its order in equal
        shares. A resume on another world size or per-process batch may leave a rest the ranks do not divide: it is
        padded as DistributedSampler pads an epoch (unequal shares would end the ranks' epochs at different batches),
        and a last batch of one sample is avoided as in __init__."""
        if (position := self.resumed_position(epoch)) is None:
            return None
        share = -(-max(self.total_size - position, 0) // self.num_replicas)
        b = self.batch_size
        return share + 1 if b is not None and b > 1 and share > 1 and share % b == 1 else share

    def __iter__(self) -> Iterator[Key]:
        epoch, share = self.epoch, self.resumed_share(self.epoch)
        self.epoch_in_progress, self.position = epoch, self.resumed_position(epoch) or 0
        self._resume_at = None
        order = self.epoch_order(epoch)[self.position :]
        while order and share is not None and len(order) < share * self.num_replicas:
            order += order[: share * self.num_replicas - len(order)]
        order = order[self.rank :: self.num_replicas]
        if not self.keys:
            return (index for index, _ in order)
        return ((index, epoch, repeat) for index, repeat in order)


def mid_epoch_order(checkpoint: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    """The training order's state (ResumableDataLoader's, which Lightning keeps in its fit loop's) of a checkpoint saved
    inside an epoch, the epoch a resume continues; None for one saved at an epoch's end, or without such a loader."""
    loop = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    epochs = (loop.get("epoch_progress") or {}).get("current") or {}
    inside = epochs.get("processed", 0) < epochs.get("started", 0) and not (
        loop.get("epoch_loop.batch_progress") or {}).get("is_last_batch")
    states = [s for s in (loop.get("state_dict") or {}).get("combined_loader") or () if isinstance(s, dict)
              and s.get("position")]
    return states[0] if inside and states else None


class ResumableDataLoader(DataLoader):
    """The training DataLoader, with Lightning's stateful-loader protocol: its state counts the global samples
    handed to the training loop, and iteration starts lazily (Lightning #20550, classifier_engine.compat)."""

    def __iter__(self):
        sampler: ResumableSampler = self.sampler  # the data modules and ExactLoaders build it with one
        step = (self.batch_size or 1) * sampler.num_replicas
        for batch in super().__iter__():
            sampler.position += step
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.loader_state(self.batch_size)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.restore_loader_state(self.batch_size, state)


class ExactLoaders(Callback):
    """Any data module's plain loaders (a DataLoader of a map-style data set, with a batch size) made exact: evaluation
    unpadded, the training order from the run seed, resumable mid-epoch. Others are left to Lightning."""

    def __init__(self, datamodule: Any, seed: int):
        self.seed, self.num_classes = seed, getattr(datamodule, "num_classes", None)
        self.owner = type(datamodule).__qualname__
        self.sampler: Optional[ResumableSampler] = None
        self.batch_size: Optional[int] = None
        self._resume_state: Optional[dict[str, Any]] = None
        for name in ("train_dataloader", "val_dataloader", "test_dataloader"):
            if getattr(type(datamodule), name) is not getattr(L.LightningDataModule, name):
                setattr(datamodule, name, _LoaderHook(datamodule, name, self))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A resumed epoch's rest may come in other batches than the saving run's (another world size or per-process
        # batch): Lightning counts on from the batch index it saved; this run's is where its rest ends the epoch.
        loader = trainer.train_dataloader
        sampler = getattr(loader, "sampler", None)
        share = sampler.resumed_share(trainer.current_epoch) if isinstance(sampler, ResumableSampler) else None
        if share is not None and sampler.changed_order:  # known here, not before: the training set's length
            key, (saved, now) = next(iter(sampler.changed_order.items()))
            where = (f"checkpoint {trainer.ckpt_path} stopped inside epoch {trainer.current_epoch} "
                     f"({sampler.resumed_position(trainer.current_epoch)} samples in)")
            raise ConfigError(changed_inside_an_epoch(ORDER[key], saved, now, where))
        if share is not None and loader.batch_size:
            left = share // loader.batch_size if loader.drop_last else -(-share // loader.batch_size)
            continue_epoch_at_batch(trainer, len(loader) - left)

    def state_dict(self) -> dict[str, Any]:
        # Beside Lightning's own loader state, which it restores too late (#20550, classifier_engine.compat).
        return {"train_loader": self.sampler.loader_state(self.batch_size)} if self.sampler else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("train_loader")
        if state is not None and self.sampler is not None:  # built already (fsdp2 restores late): resume it once
            self.resume(state)
            state = None
        self._resume_state = state

    def exact(self, loader: Any, name: str, trainer: Any) -> Any:
        world_size, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        if isinstance(loader, DataLoader) and isinstance(loader.sampler, DistributedSampler):
            return loader  # it shards itself (ours do)
        loader = self.taken_at_its_word(loader, name, trainer)
        if not _plain(loader):
            if world_size > 1:
                rank_zero_warn(f"{name}: not a plain DataLoader over a map-style data set; Lightning shards it (padded "
                               "evaluation, no mid-epoch resume)")
            return loader
        if name != "train_dataloader":
            exact = ExactDistributedSampler(loader.dataset, world_size, rank) if world_size > 1 else None
            return _rebuild(loader, exact) if exact else loader
        # Each sample drawn with torch's, numpy's and random's generators seeded from (seed, epoch, index): the
        # user's data set wrapped, its random transforms as they are (engine/README.md#resuming-exactly)
        samples = SeededSamples(loader.dataset, self.seed, every_generator=True)
        self.sampler = ResumableSampler(samples, num_replicas=world_size, rank=rank, seed=self.seed,
                                        shuffle=isinstance(loader.sampler, RandomSampler),
                                        global_batch=global_batch_of(trainer))
        self.batch_size = loader.batch_size
        if self._resume_state is not None:
            self.resume(self._resume_state)
            self._resume_state = None
        return _rebuild(loader, self.sampler, ResumableDataLoader, dataset=samples)

    def resume(self, state: dict[str, Any]) -> None:
        """The train loader continued where `state` stopped; a data set that draws randomness where no seed of ours
        reaches is named (the resume then differs from the uninterrupted run)."""
        self.sampler.restore_loader_state(self.batch_size, state)
        if self.sampler.dataset.draws_elsewhere((0, int(state["epoch"]), 0)):
            rank_zero_warn(f"data module {self.owner}: its training set gives sample 0 differently when drawn twice "
                           "with the same seeds, so it draws randomness from a generator of its own and this resume "
                           "is not the uninterrupted run; draw from torch's, numpy's or random's global generators "
                           "(engine/README.md#resuming-exactly)")

    def taken_at_its_word(self, loader: Any, name: str, trainer: Any) -> Any:
        """A user's loader, checked before the first step: its batches against the contract, an evaluation that
        would drop images, a train loader of unknown length in a run whose length is counted in epochs."""
        where = f"data module {self.owner}: {name}"
        if not isinstance(loader, DataLoader):
            return loader
        if isinstance(self.num_classes, int) and not isinstance(loader.collate_fn, CheckedCollate):
            loader.collate_fn = CheckedCollate(loader.collate_fn, self.num_classes, where)
        if name == "train_dataloader" and sized_len(loader) is None and trainer is not None and trainer.max_steps == -1:
            raise ConfigError(f"{where} has no length (an IterableDataset without __len__): the run's length in steps "
                              "is unknown; set --trainer.max_steps")
        if name == "train_dataloader" or not (loader.drop_last or getattr(loader.batch_sampler, "drop_last", False)):
            return loader
        if not _plain(loader):
            raise ConfigError(f"{where} drops its last partial batch (drop_last): exact evaluation needs every image; "
                              "build it with drop_last=False")
        rank_zero_warn(f"{where} has drop_last=True: every image is evaluated all the same (exact evaluation)")
        return _rebuild(loader, loader.sampler, drop_last=False)


class _LoaderHook:
    """A data module's loader hook, run through ExactLoaders. Picklable (ddp_spawn); `__wrapped__` lets Lightning's
    is_overridden see the data module's own method."""

    def __init__(self, datamodule: Any, name: str, loaders: ExactLoaders):
        self.datamodule, self.name, self.loaders = datamodule, name, loaders

    @property
    def __wrapped__(self):
        return getattr(type(self.datamodule), self.name).__get__(self.datamodule)

    def __call__(self):
        return self.loaders.exact(self.__wrapped__(), self.name, self.datamodule.trainer)


def _plain(loader: Any) -> bool:
    return (type(loader) is DataLoader and loader.batch_size is not None and hasattr(loader.dataset, "__len__")
            and isinstance(loader.sampler, (RandomSampler, SequentialSampler)))


def _rebuild(loader: DataLoader, sampler: Any, cls: type[DataLoader] = DataLoader, *,
             drop_last: Optional[bool] = None, dataset: Optional[Dataset] = None) -> DataLoader:
    """`loader` again, with `sampler` (torch's DataLoader cannot swap one in place) and `dataset` if given."""
    workers = loader.num_workers
    drop_last = loader.drop_last if drop_last is None else drop_last
    return cls(loader.dataset if dataset is None else dataset, batch_size=loader.batch_size, sampler=sampler,
               num_workers=workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=drop_last,
               timeout=loader.timeout, worker_init_fn=loader.worker_init_fn, generator=loader.generator,
               multiprocessing_context=loader.multiprocessing_context if workers else None,
               prefetch_factor=loader.prefetch_factor if workers else None,
               persistent_workers=loader.persistent_workers)
