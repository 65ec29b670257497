from project.data.datamodule import ImageNetDataModule

__all__ = ["ImageNetDataModule"]
