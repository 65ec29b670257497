"""Image data modules: a folder of class folders, manifests, shards; and the base they share (ImageDataModule)."""

from classifier_engine.data.folder import ImageFolderDataModule
from classifier_engine.data.image_data import ImageDataModule
from classifier_engine.data.manifest import ManifestDataModule
from classifier_engine.data.shards import ShardDataModule

__all__ = ["ImageDataModule", "ImageFolderDataModule", "ManifestDataModule", "ShardDataModule"]
