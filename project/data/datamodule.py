"""ImageNetDataModule: ImageFolder-layout data (ROOT/train/<class>/, ROOT/val/<class>/) with role-named presets.

    python -m project fit --config configs/quickstart.yaml            # embedded digits, no download
    python -m project fit --config configs/ddp_8gpu.yaml --data.root /datasets/imagenet
"""

import dataclasses
import sys
from typing import Any, Callable, Literal, Optional

import lightning as L
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets import ImageFolder

from project.data.decoders import DEVICE_DECODERS, Decoder, resolve_decoder
from project.data.device_augment import TrainCrop
from project.data.device_normalize import NormalizeBatch
from project.data.device_pipeline import DevicePipeline
from project.data.embedded import resolve_root
from project.data.image_folders import (DecodedImageFolder, EncodedBatch, EncodedImageFolder, collate_encoded,
                                        collate_readable)
from project.data.layout import check_layout, read_class_labels
from project.data.options import (AreaFraction, NonNegativeInt, PositiveInt, Probability, RandAugmentMagnitude,
                                  check_combinations, check_option_values)
from project.data.predict import ImagePathDataset, list_images
from project.data.progressive_resizing import ProgressiveResizing, TrainPresetPerEpoch
from project.engine.samplers import (ExactDistributedSampler, ResumableDataLoader, ResumableSampler, loader_state,
                                   restore_loader_state)
from project.data.training_samples import SeededSamples
from project.data.transforms import IMAGENET_MEAN, IMAGENET_STD, AutoAugmentName, eval_preset, train_preset
from project.engine.errors import ConfigError
from project.engine.run.signals import ignore_stop_signals


class ImageNetDataModule(L.LightningDataModule):
    """ImageNet (or any ImageFolder-layout data set): class count and names are read from the folders."""

    def __init__(
        self,
        root: Optional[str] = None,
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
        predict_root: Optional[str] = None,
        decoder: Decoder = "auto",
        normalize_on_device: bool = True,
        on_corrupt: Literal["error", "skip"] = "error",
        multiprocessing_context: Optional[Literal["fork", "forkserver", "spawn"]] = None,
        ra_reps: PositiveInt = 1,
        seed: int = 0,
    ):
        """
        Args:
            root: folder holding train/<class>/ and val/<class>/ (ImageNet layout), or "embedded:digits".
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
            random_erase_prob: probability of erasing a random rectangle of each training image (after
                normalization: the mean colour; on uint8 with that colour when the device normalizes).
            progressive_resizing: train crop size by epoch, e.g. {start_size: 160, end_size: 192, start_epoch: 65,
                end_epoch: 76} (FFCV); it replaces train_crop_size and changes at epoch boundaries in every worker
                and rank. None: train_crop_size throughout.
            eval_resize_size: short side the evaluation images are resized to before the center crop.
            eval_crop_size: side of the evaluation center crop (larger than eval_resize_size: zero-padded, as
                torchvision's CenterCrop pads).
            predict_root: folder of images for `predict` (any depth, sorted order); None predicts ROOT/val.
            decoder: where and with what images are decoded (project.data.decoders). In the workers: "torchcodec"
                (TorchCodec, the optional extra), "torchvision" (torchvision.io, deprecated by torchvision 0.29) or
                "pil" (the stock loader); all three give 3-channel uint8 RGB for gray, CMYK and PNG-as-.JPEG files.
                "auto": the first of those three that is installed, logged. On the training device: "nvjpeg"
                (torchvision.io) or "torchcodec-cuda" (TorchCodec): workers only read the bytes, JPEGs are decoded
                and augmented batch-wise where the model runs, other files are decoded in the workers; predict
                decodes with the CPU counterpart. Needs normalize_on_device.
            normalize_on_device: workers return uint8 images and the batch is converted to float and normalized on
                the training device (4x smaller copies, cheaper workers); False normalizes in the workers.
            on_corrupt: an unreadable image stops with an error naming it ("error"), or is left out of its batch
                and counted in a warning ("skip").
            multiprocessing_context: start method of the DataLoader workers (needs num_workers >= 1). None: "fork" on
                Linux, also inside ddp_spawn's processes, where Python's default is "spawn" and every worker would
                re-import torch.
            ra_reps: repeated augmentation: each drawn image appears this many times per epoch, on different ranks,
                each copy augmented differently (torchvision's RASampler, DeiT); the epoch keeps the data set's length.
            seed: the run seed, linked from seed_everything: the training order and every augmentation derive from it.
        """
        super().__init__()
        # The CLI parsed and checked these already; a Python caller's values are checked here, before anything is
        # read or written (the embedded data set's cache included).
        values = check_option_values(ImageNetDataModule.__init__, locals())
        check_combinations(**{k: values[k] for k in ("train_crop_scale", "num_workers", "prefetch_factor",
                                                    "multiprocessing_context")})
        self.save_hyperparameters(ignore=["progressive_resizing"], logger=False)  # trackers: the whole config
        # Plain values in the checkpoint and in hparams.yaml (both are read back without trusting pickled classes).
        self.hparams["progressive_resizing"] = dataclasses.asdict(progressive_resizing) if progressive_resizing else None
        if root is None:
            raise ConfigError(
                "data.root is not set: pass --data.root /path/to/imagenet (holding train/ and val/), "
                "or --data.root embedded:digits for the built-in quickstart data"
            )
        self.root = resolve_root(root)
        if predict_root is not None:
            list_images(predict_root)  # a missing or empty predict folder is reported now, before anything is written
        self.batch_size = batch_size
        # Read here, not in setup(): the CLI links data.num_classes into the model right after instantiation.
        self.class_names: list[str] = check_layout(self.root)
        self.num_classes = len(self.class_names)
        augment = dict(scale=tuple(train_crop_scale), hflip_prob=hflip_prob, auto_augment=auto_augment,
                       randaugment_num_ops=randaugment_num_ops, randaugment_magnitude=randaugment_magnitude,
                       random_erase_prob=random_erase_prob)
        # The presets are built as they run: uint8 out when the device normalizes the batch, float when the workers do.
        presets = dict(mean=IMAGENET_MEAN, std=IMAGENET_STD, normalize=not normalize_on_device)
        self.normalize_batch = NormalizeBatch(IMAGENET_MEAN, IMAGENET_STD) if normalize_on_device else None
        self.train_transform = train_preset(crop_size=train_crop_size, **augment, **presets)
        # With progressive resizing the train preset depends on the epoch, which SeededSamples reads from each key.
        self.train_transform_for_epoch = (TrainPresetPerEpoch(progressive_resizing, **augment, **presets)
                                          if progressive_resizing is not None else None)
        self.eval_transform = eval_preset(resize_size=eval_resize_size, crop_size=eval_crop_size, **presets)
        self.decoder = resolve_decoder(decoder)
        self.train_crop: Optional[TrainCrop] = None  # device decoders: the crop the workers draw, applied on the device
        self.device_pipeline: Optional[DevicePipeline] = None
        if self.decoder in DEVICE_DECODERS:
            if not normalize_on_device:
                raise ConfigError(f"data.decoder={decoder} augments uint8 images on the device: set data.normalize_on_device=true")
            if progressive_resizing is not None:
                raise ConfigError(f"data.decoder={decoder} has one train crop size: drop data.progressive_resizing, or "
                                 "decode in the workers (data.decoder=auto)")
            self.train_crop = TrainCrop.for_options(crop_size=train_crop_size, scale=tuple(train_crop_scale),
                                                    hflip_prob=hflip_prob, auto_augment=auto_augment,
                                                    random_erase_prob=random_erase_prob)
            self.device_pipeline = DevicePipeline(self.train_crop, self.eval_transform, decoder=self.decoder,
                                                  on_corrupt=on_corrupt)
        # Folder names (wnids for ImageNet) stay the keys; labels are the human names prepare_imagenet wrote.
        self.class_labels: list[str] = read_class_labels(self.root, self.class_names)
        self.datasets: dict[str, Dataset] = {}
        self.train_sampler: Optional[ResumableSampler] = None
        self._resume_state: Optional[dict[str, Any]] = None  # from a checkpoint, for the next train loader

    def setup(self, stage: str) -> None:
        if stage == "fit":
            per_epoch = self.train_transform_for_epoch
            folder = self._image_folder("train", None if per_epoch else self.train_transform, crop=self.train_crop)
            self.datasets["train"] = SeededSamples(folder, self.hparams.seed, transform_for_epoch=per_epoch)
        if stage in ("fit", "validate"):
            self.datasets["val"] = self._image_folder("val", self.eval_transform)
        if stage == "test":
            # ImageNet's labelled test set is its val set; a ROOT/test/ folder takes precedence when present.
            split = "test" if (self.root / "test").is_dir() else "val"
            self.datasets["test"] = self._image_folder(split, self.eval_transform)
        if stage == "predict":
            folder = self.hparams.predict_root or self.root / "val"
            self.datasets["predict"] = ImagePathDataset(folder, transform=self.eval_transform, decoder=self.decoder,
                                                        on_corrupt=self.hparams.on_corrupt)

    def _image_folder(self, split: str, transform, crop: Optional[TrainCrop] = None) -> ImageFolder:
        if self.device_pipeline is not None:  # the workers read bytes (and draw the train crops); the device does the rest
            dataset = EncodedImageFolder(str(self.root / split), crop=crop, decoder=self.decoder,
                                         on_corrupt=self.hparams.on_corrupt)
        else:
            dataset = DecodedImageFolder(str(self.root / split), transform=transform, decoder=self.decoder,
                                         on_corrupt=self.hparams.on_corrupt)
        if dataset.classes != self.class_names:
            raise ConfigError(f"{self.root / split} classes differ from train/: {sorted(set(dataset.classes) ^ set(self.class_names))}")
        return dataset

    def _world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)

    def _collate(self, split: str) -> Optional[Callable[[list], Any]]:
        if self.device_pipeline is not None and split != "predict":  # predict decodes in the workers, as the CPU path
            return collate_encoded
        return collate_readable if self.hparams.on_corrupt == "skip" else None

    def _loader(self, split: str, sampler, loader_class: type[DataLoader] = DataLoader) -> DataLoader:
        workers = self.hparams.num_workers
        dataset = self.datasets[split]
        return loader_class(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=workers,
            pin_memory=self.hparams.pin_memory,
            persistent_workers=self.hparams.persistent_workers and workers > 0,
            prefetch_factor=self.hparams.prefetch_factor if workers > 0 else None,
            collate_fn=self._collate(split),
            multiprocessing_context=self._start_method() if workers > 0 else None,
            # A stop signal sent to the whole process group must not kill the workers before the checkpoint is saved.
            worker_init_fn=ignore_stop_signals if workers > 0 else None,
        )

    def _start_method(self) -> Optional[str]:
        # A process started by spawn (ddp_spawn's ranks) inherits "spawn" as its default start method.
        if self.hparams.multiprocessing_context is None and sys.platform == "linux":
            return "fork"
        return self.hparams.multiprocessing_context

    def train_dataloader(self) -> DataLoader:
        world_size, rank = self._world()
        dataset = self.datasets["train"]
        self.train_sampler = ResumableSampler(dataset, num_replicas=world_size, rank=rank, seed=self.hparams.seed,
                                              repeats=self.hparams.ra_reps)
        if self._resume_state is not None:
            restore_loader_state(self.train_sampler, self.batch_size, self._resume_state)
            self._resume_state = None
        return self._loader("train", self.train_sampler, ResumableDataLoader)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, map_location=None, hparams_file=None, weights_only: bool = True,
                             **kwargs):
        """Lightning's, but weights_only=True by default whatever torch's default is: checkpoints are untrusted."""
        return super().load_from_checkpoint(checkpoint_path, map_location=map_location, hparams_file=hparams_file,
                                            weights_only=weights_only, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        """Where the training order stands, saved in every checkpoint (LightningDataModule's own hook).

        Lightning also saves it through the train loader's state_dict, but restores that one too late when the
        model reads trainer.estimated_stepping_batches (Lightning #20550, project.engine.compat): this copy is restored
        before the train loader is built.
        """
        state: dict[str, Any] = {"class_names": self.class_names, "class_labels": self.class_labels}  # for export
        if self.train_sampler is not None:
            state["train_loader"] = loader_state(self.train_sampler, self.batch_size)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume_state = state_dict.get("train_loader")

    def _eval_loader(self, split: str) -> DataLoader:
        world_size, rank = self._world()
        dataset = self.datasets[split]
        return self._loader(split, ExactDistributedSampler(dataset, num_replicas=world_size, rank=rank))

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")

    def predict_dataloader(self) -> DataLoader:
        """Batches of (images, indices into the dataset's `paths`), each image once over all ranks."""
        return self._eval_loader("predict")

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        if isinstance(batch, EncodedBatch):  # a device decoder's: decode and augment where the model runs
            trainer = self.trainer
            batch = self.device_pipeline(batch, trainer.strategy.root_device, training=trainer.training)
        return batch

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        if self.normalize_batch is None:
            return batch
        batch = self.normalize_batch.batch(batch)
        # Lightning converts inputs for "16-true"/"bf16-true" before the transfer, when they were still uint8.
        return self.trainer.precision_plugin.convert_input(batch) if self.trainer is not None else batch
