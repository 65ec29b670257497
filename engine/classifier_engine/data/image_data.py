"""ImageDataModule: the presets, decoders and loaders of every image data module; a subclass lists its samples.

    python -m classifier_engine fit --config CONFIG --data.batch_size=32 --data.mean=[0.5,0.5,0.5]
"""

import dataclasses
import functools
import sys
from pathlib import Path
from typing import Any, Literal, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from classifier_engine.contract import EvalPreprocessing
from classifier_engine.data.decoders import DEVICE_DECODERS, Decoder, OnCorrupt, resolve_decoder
from classifier_engine.data.device_decode import CroppedBatch, DevicePipeline, EncodedBatch, TrainCrop
from classifier_engine.data.device_prefetch import PrefetchingLoader, copied
from classifier_engine.data.image_folders import (
    DecodedImages,
    EncodedImages,
    EvaluationLoader,
    collate_encoded,
    collate_readable,
)
from classifier_engine.data.predict import ImagePathDataset, list_images
from classifier_engine.data.training_samples import ProgressiveResizing, TrainPresetPerEpoch
from classifier_engine.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    AutoAugmentName,
    NormalizeBatch,
    RandAugmentMagnitude,
    eval_preset,
    train_preset,
)
from classifier_engine.errors import ConfigError
from classifier_engine.options import (
    AreaFraction,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Probability,
    check_arguments,
)
from classifier_engine.run.signals import ignore_stop_signals
from classifier_engine.samplers import ExactDistributedSampler, ResumableDataLoader, ResumableSampler, global_batch_of
from classifier_engine.seeds import SeededSamples

Samples = list[tuple[str, int]]  # (image path, label) of one split
DRAWN_IN_WORKERS = (v2.ToImage, v2.RandomResizedCrop, v2.RandomHorizontalFlip)  # by a device decoder's TrainCrop


class ImageDataModule(L.LightningDataModule):
    """Images and labels from `samples(split)`, which a subclass defines, with `class_names` set in its __init__.

    Args:
        batch_size: images per batch per process (ddp), or the global batch split over the GPUs (dp).
        num_workers: DataLoader worker processes per training process.
        pin_memory: page-locked host batches for faster, asynchronous copies to the GPU.
        persistent_workers: keep workers alive between epochs (no re-import, no re-fork each epoch).
        prefetch_factor: batches each worker loads ahead (DataLoader's default when None; needs num_workers >= 1).
        train_crop_size: side of the RandomResizedCrop for training.
        train_crop_scale: area range [min, max] of the RandomResizedCrop, as fractions (0, 1] of the image.
        hflip_prob: probability of a horizontal flip in training (0 disables it).
        auto_augment: an auto-augment policy on the uint8 crop: "trivialaugment_wide", "randaugment"
            (randaugment_num_ops, randaugment_magnitude) or "autoaugment" (the ImageNet policy); None: off.
        randaugment_num_ops: RandAugment's number of ops per image.
        randaugment_magnitude: RandAugment's magnitude (0-30).
        random_erase_prob: probability of erasing a random rectangle of each training image (with the mean colour).
        progressive_resizing: train crop size by epoch, e.g. {start_size: 160, end_size: 192, start_epoch: 65,
            end_epoch: 76} (FFCV), switched at epoch boundaries in every worker and rank; None: train_crop_size.
        eval_resize_size: short side the evaluation images are resized to before the center crop.
        eval_crop_size: side of the evaluation center crop (larger than eval_resize_size: zero-padded).
        mean: per RGB channel, of images scaled to [0, 1]: the input is (x - mean) / std (ImageNet's by default).
        std: per RGB channel, each > 0.
        predict_root: folder of images for `predict` (any depth, sorted order); None predicts the val split.
        decoder: "nvimgcodec" (JPEGs decoded only where the crop keeps them), "torchcodec", "torchvision" or "pil" in
            the workers ("auto": the first installed), or "nvjpeg" or "torchcodec-cuda" on the training device
            (docs/data.md).
        normalize_on_device: workers return uint8 and the device normalizes the batch; False: the workers do.
        on_corrupt: an unreadable image stops the run naming it ("error"), or is left out and counted ("skip").
        multiprocessing_context: the DataLoader workers' start method; None: "fork" on Linux, also under ddp_spawn.
        drop_last: drop each epoch's incomplete last training batch (one image breaks BatchNorm), if not its only one;
            False keeps it, never as one image (each process then takes one more image from the epoch's start).
        ra_reps: repeated augmentation (RASampler, DeiT): each drawn image this many times per epoch, on different
            ranks, each copy augmented differently; the epoch keeps the data set's length.
        seed: the run seed, linked from seed_everything: the training order and every augmentation derive from it.
    """

    class_names: list[str]
    class_labels: list[str]
    train_sampler_class: type[ResumableSampler] = ResumableSampler  # a chunk-aware one for shards

    def __init__(
        self,
        batch_size: PositiveInt = 256,
        num_workers: NonNegativeInt = 8,
        pin_memory: bool = True,
        persistent_workers: bool = True,
        prefetch_factor: Optional[PositiveInt] = None,
        train_crop_size: PositiveInt = 224,
        train_crop_scale: tuple[AreaFraction, AreaFraction] = (0.08, 1.0),
        hflip_prob: Probability = 0.5,
        auto_augment: Optional[AutoAugmentName] = None,
        randaugment_num_ops: NonNegativeInt = 2,
        randaugment_magnitude: RandAugmentMagnitude = 9,
        random_erase_prob: Probability = 0.0,
        progressive_resizing: Optional[ProgressiveResizing] = None,
        eval_resize_size: PositiveInt = 256,
        eval_crop_size: PositiveInt = 224,
        mean: tuple[float, float, float] = IMAGENET_MEAN,
        std: tuple[PositiveFloat, PositiveFloat, PositiveFloat] = IMAGENET_STD,
        predict_root: Optional[str] = None,
        decoder: Decoder = "auto",
        normalize_on_device: bool = True,
        on_corrupt: OnCorrupt = "error",
        multiprocessing_context: Optional[Literal["fork", "forkserver", "spawn"]] = None,
        drop_last: bool = True,
        ra_reps: PositiveInt = 1,
        seed: int = 0,
    ):
        super().__init__()
        # A Python caller's values (the CLI checked its own), checked before the subclass reads or writes anything.
        values = check_arguments(ImageDataModule.__init__, locals(), "data")
        check_combinations(values)
        self.save_hyperparameters(ignore=["progressive_resizing"], logger=False)  # trackers: the whole config
        # Plain values in the checkpoint and in hparams.yaml (both are read back without trusting pickled classes).
        ramp = dataclasses.asdict(progressive_resizing) if progressive_resizing else None
        self.hparams.update(progressive_resizing=ramp, mean=values["mean"], std=values["std"])
        if predict_root is not None:
            list_images(predict_root)  # a missing or empty predict folder is reported now, before anything is written
        self.batch_size = batch_size
        self.decoder = resolve_decoder(decoder)
        self._build_presets(values)
        self.datasets: dict[str, Dataset] = {}
        self.train_sampler: Optional[ResumableSampler] = None
        self._resume_state: Optional[dict[str, Any]] = None  # from a checkpoint, for the next train loader

    def _build_presets(self, o: dict[str, Any]) -> None:
        """The presets as they run: uint8 out when the device normalizes the batch, float when the workers do."""
        presets = dict(mean=o["mean"], std=o["std"], normalize=not o["normalize_on_device"])
        augment = dict(presets, scale=o["train_crop_scale"], hflip_prob=o["hflip_prob"], auto_augment=o["auto_augment"],
                       randaugment_num_ops=o["randaugment_num_ops"], randaugment_magnitude=o["randaugment_magnitude"],
                       random_erase_prob=o["random_erase_prob"])
        self.normalize_batch = NormalizeBatch(o["mean"], o["std"]) if o["normalize_on_device"] else None
        self.train_transform = train_preset(crop_size=o["train_crop_size"], **augment)
        # With progressive resizing the train preset depends on the epoch, which SeededSamples reads from each key.
        ramp = o["progressive_resizing"]
        self.train_transform_for_epoch = TrainPresetPerEpoch(ramp, **augment) if ramp else None
        self.eval_transform = eval_preset(resize_size=o["eval_resize_size"], crop_size=o["eval_crop_size"], **presets)
        self.device_pipeline: Optional[DevicePipeline] = None
        if self.decoder in DEVICE_DECODERS:  # the workers draw the train crops, the device applies them
            crop = TrainCrop.for_options(crop_size=o["train_crop_size"], scale=o["train_crop_scale"],
                                         hflip_prob=o["hflip_prob"])
            # The uint8 preset's own steps after the crop and flip (auto-augment, random erasing), per image there
            rest = [t for t in self.train_transform.transforms if not isinstance(t, DRAWN_IN_WORKERS)]
            self.device_pipeline = DevicePipeline(crop, self.eval_transform, decoder=self.decoder,
                                                  on_corrupt=o["on_corrupt"], size_at=ramp.size_at if ramp else None,
                                                  augment=v2.Compose(rest) if rest else None)

    def samples(self, split: str) -> Samples:
        """(path, label) of every image of `split` ("train", "val" or "test"), label i being class_names[i]."""
        raise NotImplementedError

    def predict_images(self) -> Path | list[Path]:
        """What `predict` reads without data.predict_root: a folder, or the paths themselves."""
        raise NotImplementedError

    def eval_preprocessing(self) -> EvalPreprocessing:
        """The contract's (classifier_engine.contract): how predict, export and tools/preprocess.py prepare an image."""
        h = self.hparams
        return EvalPreprocessing(resize=h.eval_resize_size, crop=h.eval_crop_size, mean=tuple(h.mean), std=tuple(h.std))

    def image_sizes(self) -> dict[str, int]:
        """The contract's: the side of every image the network gets, by the option that sets it."""
        ramp = self.hparams.progressive_resizing
        train = ({f"data.progressive_resizing.{key}": ramp[key] for key in ("start_size", "end_size")} if ramp
                 else {"data.train_crop_size": self.hparams.train_crop_size})
        return {**train, "data.eval_crop_size": self.hparams.eval_crop_size}

    def setup(self, stage: str) -> None:
        if stage == "fit":
            # A device decoder resizes to each epoch's size on the device (DevicePipeline.size_at)
            per_epoch = self.train_transform_for_epoch if self.device_pipeline is None else None
            images = self._images("train", None if per_epoch else self.train_transform)
            self.datasets["train"] = SeededSamples(images, self.hparams.seed, transform_for_epoch=per_epoch)
        for split in {"fit": ["val"], "validate": ["val"], "test": ["test"]}.get(stage, []):
            self.datasets[split] = self._images(split, self.eval_transform)
        if stage == "predict":
            images = self.hparams.predict_root or self.predict_images()
            self.datasets["predict"] = ImagePathDataset(images, transform=self.eval_transform, decoder=self.decoder,
                                                        on_corrupt=self.hparams.on_corrupt)

    def _images(self, split: str, transform) -> Dataset:
        reading = dict(decoder=self.decoder, on_corrupt=self.hparams.on_corrupt)
        if self.device_pipeline is not None:  # the workers read bytes (and draw the train crops), the device the rest
            crop = self.device_pipeline.train_crop if split == "train" else None
            return EncodedImages(self.samples(split), crop=crop, **reading)
        partial = self._in_part(split, transform)
        return DecodedImages(self.samples(split), transform=transform, partial=partial, **reading)

    def _in_part(self, split: str, transform) -> bool:
        """Whether a preset of transforms.py gets the images (the split's, or the epoch's): JPEGs go undecoded."""
        return transform is not None or (split == "train" and self.train_transform_for_epoch is not None)

    def _world(self) -> tuple[int, int]:
        return (self.trainer.world_size, self.trainer.global_rank) if self.trainer is not None else (1, 0)

    def _loader(self, split: str, sampler, loader_class: type[DataLoader] = EvaluationLoader,
                drop_last=False) -> DataLoader:
        h, workers = self.hparams, {}
        # Skipped images (None) are left out; predict decodes in the workers whatever the decoder, as the CPU path.
        collate = collate_encoded if self.device_pipeline is not None and split != "predict" else functools.partial(
            collate_readable, training=split == "train")
        if h.num_workers > 0:
            # A process started by spawn (ddp_spawn's ranks) inherits "spawn" as its default start method: fork.
            start = h.multiprocessing_context or ("fork" if sys.platform == "linux" else None)
            # A stop signal sent to the whole process group must not kill the workers before the checkpoint is saved.
            workers = dict(persistent_workers=h.persistent_workers, prefetch_factor=h.prefetch_factor,
                           multiprocessing_context=start, worker_init_fn=ignore_stop_signals)
        return loader_class(self.datasets[split], batch_size=self.batch_size, sampler=sampler, drop_last=drop_last,
                            num_workers=h.num_workers, pin_memory=h.pin_memory, collate_fn=collate, **workers)

    def train_dataloader(self) -> DataLoader:
        world_size, rank = self._world()
        kept = None if self.hparams.drop_last else self.batch_size  # a kept last batch is never one image (BatchNorm)
        self.train_sampler = self.train_sampler_class(self.datasets["train"], num_replicas=world_size, rank=rank,
                                                      seed=self.hparams.seed, repeats=self.hparams.ra_reps,
                                                      batch_size=kept, global_batch=global_batch_of(self.trainer))
        # With fewer images than a batch, the one batch there is stays: an epoch never trains on nothing.
        drop_last = self.hparams.drop_last and len(self.train_sampler) >= self.batch_size
        if len(self.train_sampler) < 2:  # that batch would be one image: BatchNorm raises in the first step
            raise ConfigError(f"{len(self.datasets['train'])} training images over {world_size} processes leave "
                              f"{len(self.train_sampler)} per process: a training batch needs 2 or more (BatchNorm); "
                              "add training images, or train with fewer processes (--trainer.devices)")
        if self._resume_state is not None:
            self.train_sampler.restore_loader_state(self.batch_size, self._resume_state)
            self._resume_state = None
        strategy = getattr(self.trainer, "strategy", None)  # none without a Trainer (a loader built by hand)
        device = strategy.root_device if strategy is not None else torch.device("cpu")
        loader_class = ResumableDataLoader
        if self.device_pipeline is not None or device.type == "cuda":
            # The next batch copied to the GPU (a device decoder: decoded there too) by a thread while this one trains
            prepare = self.device_pipeline.crop if self.device_pipeline is not None else copied
            loader_class = functools.partial(PrefetchingLoader, device=device, prepare=prepare)
        return self._loader("train", self.train_sampler, loader_class, drop_last=drop_last)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, map_location=None, hparams_file=None, weights_only: bool = True,
                             **kwargs):
        """Lightning's, but weights_only=True by default and never the checkpoint's `_instantiator` (untrusted)."""
        return super().load_from_checkpoint(checkpoint_path, map_location=map_location, hparams_file=hparams_file,
                                            weights_only=weights_only, **{**kwargs, "_instantiator": None})

    def state_dict(self) -> dict[str, Any]:
        """Where the training order stands, restored before the train loader is built (Lightning's is late: #20550)."""
        state: dict[str, Any] = {"class_names": self.class_names, "class_labels": self.class_labels}  # for export
        if self.train_sampler is not None:
            state["train_loader"] = self.train_sampler.loader_state(self.batch_size)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("train_loader")
        if state is not None and self.train_sampler is not None:  # built already (fsdp2 restores late): resume it once
            self.train_sampler.restore_loader_state(self.batch_size, state)
            state = None
        self._resume_state = state

    def _eval_loader(self, split: str) -> DataLoader:
        return self._loader(split, ExactDistributedSampler(self.datasets[split], *self._world()))

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")

    def predict_dataloader(self) -> DataLoader:
        """Batches of (images, indices into the dataset's `paths`), each image once over all ranks."""
        return self._eval_loader("predict")

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        if isinstance(batch, (EncodedBatch, CroppedBatch)):  # a device decoder's: decoded (and augmented) there
            trainer = self.trainer
            return self.device_pipeline(batch, trainer.strategy.root_device, trainer.training, trainer.current_epoch)
        return batch

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        if self.normalize_batch is None:
            return batch
        batch = self.normalize_batch.batch(batch)
        # Lightning converts inputs for "16-true"/"bf16-true" before the transfer, when they were still uint8.
        return self.trainer.precision_plugin.convert_input(batch) if self.trainer is not None else batch


def check_combinations(o: dict[str, Any]) -> None:
    """The data options that are each valid but cannot work together (ConfigError, one line with the fix)."""
    low, high = o["train_crop_scale"]
    if low > high:  # torch's uniform_ raises in the first worker ("expects to return a [from, to) range")
        raise ConfigError(f"data.train_crop_scale: expected [min, max] area fractions, got [{low}, {high}]: "
                          f"swap them (--data.train_crop_scale=[{high}, {low}])")
    # Both are DataLoader options of worker processes; torch's DataLoader refuses them with num_workers=0 too.
    for name in ("prefetch_factor", "multiprocessing_context"):
        if o[name] is not None and o["num_workers"] == 0:
            raise ConfigError(f"data.{name}={o[name]} applies to DataLoader worker processes, and data.num_workers=0 "
                              f"loads in the main process: set --data.num_workers (>= 1) or drop data.{name}")
    if o["decoder"] in DEVICE_DECODERS and not o["normalize_on_device"]:
        raise ConfigError(f"data.decoder={o['decoder']} augments uint8 images on the device: "
                          "set data.normalize_on_device=true")
