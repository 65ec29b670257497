from project.data.datamodule import ImageNetDataModule
from project.data.image_data import ImageDataModule
from project.data.manifest import ManifestDataModule
from project.data.shards import ShardDataModule

__all__ = ["ImageDataModule", "ImageNetDataModule", "ManifestDataModule", "ShardDataModule"]
