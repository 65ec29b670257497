"""ImageNetDataModule: ImageFolder-layout data (ROOT/train/<class>/, ROOT/val/<class>/) with role-named presets.

    python -m project fit --config configs/quickstart.yaml            # embedded digits, no download
    python -m project fit --config configs/ddp_8gpu.yaml --data.root /datasets/imagenet
"""

import os
from typing import Optional

import lightning as L
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets import ImageFolder

from project.data.embedded import resolve_root
from project.data.folder import check_layout
from project.data.samplers import ExactDistributedSampler, training_sampler
from project.data.transforms import eval_preset, train_preset


class ImageNetDataModule(L.LightningDataModule):
    """ImageNet (or any ImageFolder-layout data set): class count and names are read from the folders."""

    def __init__(
        self,
        root: Optional[str] = None,
        batch_size: int = 256,
        num_workers: int = 8,
        pin_memory: bool = True,
        persistent_workers: bool = True,
        prefetch_factor: Optional[int] = None,
        train_crop_size: int = 224,
        train_crop_scale: tuple[float, float] = (0.08, 1.0),
        hflip_prob: float = 0.5,
        eval_resize_size: int = 256,
        eval_crop_size: int = 224,
    ):
        """
        Args:
            root: folder holding train/<class>/ and val/<class>/ (ImageNet layout), or "embedded:digits".
            batch_size: images per batch per process (ddp), or the global batch split over the GPUs (dp).
            num_workers: DataLoader worker processes per training process.
            pin_memory: page-locked host batches for faster, asynchronous copies to the GPU.
            persistent_workers: keep workers alive between epochs (no re-import, no re-fork each epoch).
            prefetch_factor: batches each worker loads ahead (DataLoader's default when None).
            train_crop_size: side of the RandomResizedCrop for training.
            train_crop_scale: area range of the RandomResizedCrop, as fractions of the image.
            hflip_prob: probability of a horizontal flip in training (0 disables it).
            eval_resize_size: short side the evaluation images are resized to before the center crop.
            eval_crop_size: side of the evaluation center crop.
        """
        super().__init__()
        self.save_hyperparameters()
        if root is None:
            raise ValueError(
                "data.root is not set: pass --data.root /path/to/imagenet (holding train/ and val/), "
                "or --data.root embedded:digits for the built-in quickstart data"
            )
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        self.root = resolve_root(root)
        self.batch_size = batch_size
        # Read here, not in setup(): the CLI links data.num_classes into the model right after instantiation.
        self.class_names: list[str] = check_layout(self.root)
        self.num_classes = len(self.class_names)
        self.train_transform = train_preset(crop_size=train_crop_size, scale=tuple(train_crop_scale), hflip_prob=hflip_prob)
        self.eval_transform = eval_preset(resize_size=eval_resize_size, crop_size=eval_crop_size)
        self.datasets: dict[str, Dataset] = {}

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self.datasets["train"] = self._image_folder("train", self.train_transform)
        if stage in ("fit", "validate"):
            self.datasets["val"] = self._image_folder("val", self.eval_transform)
        if stage == "test":
            # ImageNet's labelled test set is its val set; a ROOT/test/ folder takes precedence when present.
            split = "test" if (self.root / "test").is_dir() else "val"
            self.datasets["test"] = self._image_folder(split, self.eval_transform)

    def _image_folder(self, split: str, transform) -> ImageFolder:
        dataset = ImageFolder(str(self.root / split), transform=transform)
        if dataset.classes != self.class_names:
            raise ValueError(f"{self.root / split} classes differ from train/: {sorted(set(dataset.classes) ^ set(self.class_names))}")
        return dataset

    def _world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)

    def _loader(self, dataset: Dataset, sampler) -> DataLoader:
        workers = self.hparams.num_workers
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=workers,
            pin_memory=self.hparams.pin_memory,
            persistent_workers=self.hparams.persistent_workers and workers > 0,
            prefetch_factor=self.hparams.prefetch_factor if workers > 0 else None,
        )

    def train_dataloader(self) -> DataLoader:
        world_size, rank = self._world()
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        dataset = self.datasets["train"]
        return self._loader(dataset, training_sampler(dataset, num_replicas=world_size, rank=rank, seed=seed))

    def _eval_loader(self, split: str) -> DataLoader:
        world_size, rank = self._world()
        dataset = self.datasets[split]
        return self._loader(dataset, ExactDistributedSampler(dataset, num_replicas=world_size, rank=rank))

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")
