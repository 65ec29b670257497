from project.data.datamodule import ImageNetDataModule
from project.data.manifest import ManifestDataModule

__all__ = ["ImageNetDataModule", "ManifestDataModule"]
