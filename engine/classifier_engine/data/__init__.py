"""Image data modules: a folder of class folders, manifests, shards; and the base they share (ImageDataModule).
Imported on first use, so that `python -m classifier_engine.data.decoders` finds its module not loaded yet (runpy warns
of one the package imported)."""

from importlib import import_module
from typing import Any

_MODULES = {"ImageDataModule": "image_data", "ImageFolderDataModule": "folder", "ManifestDataModule": "manifest",
            "ShardDataModule": "shards"}
__all__ = list(_MODULES)


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module 'classifier_engine.data' has no attribute {name!r}")
    value = globals()[name] = getattr(import_module(f"{__name__}.{_MODULES[name]}"), name)
    return value
