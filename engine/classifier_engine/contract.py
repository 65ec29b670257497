"""The data contract: what the engine reads of a data module, in this file only (docs/your-own-project.md).

Needed, known after `__init__`: `num_classes` and `class_names` (label i is class_names[i]); train and val loaders
yielding `(images, labels)`. Optional: `class_labels` (human names, in class_names' order), `eval_preprocessing()`
(for predict, export and tools/preprocess.py), `image_sizes()` (the model's size check).
"""

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Optional, Protocol, runtime_checkable

from classifier_engine.errors import ConfigError


@runtime_checkable
class ClassificationData(Protocol):
    """The minimum: any LightningDataModule with these two attributes set in `__init__`."""

    num_classes: int
    class_names: Sequence[str]


@dataclass(frozen=True)
class EvalPreprocessing:
    """Evaluation input: resize the short side, center-crop, scale to [0, 1], then (x - mean) / std per RGB channel."""

    resize: int
    crop: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    interpolation: str = "bilinear"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mean": list(self.mean), "std": list(self.std)}


def check_data(datamodule: Any) -> ClassificationData:
    """The data module, checked against the contract (ConfigError naming what is missing)."""
    name = type(datamodule).__qualname__
    if not isinstance(datamodule, ClassificationData):
        missing = [key for key in ("num_classes", "class_names") if not hasattr(datamodule, key)]
        raise ConfigError(f"data module {name} lacks {' and '.join(missing)}: set them in its __init__ (the class "
                          "count, and the class names in label order; see docs/your-own-project.md)")
    names = list(datamodule.class_names)
    if len(names) != datamodule.num_classes or len(set(names)) != len(names):
        raise ConfigError(f"data module {name}: num_classes is {datamodule.num_classes} but class_names holds "
                          f"{len(names)} names ({len(set(names))} distinct): one name per class, in label order")
    return datamodule


def eval_preprocessing(datamodule: Any) -> Optional[EvalPreprocessing]:
    """The data module's evaluation preprocessing, when it says what it is."""
    offered = getattr(datamodule, "eval_preprocessing", None)
    return offered() if callable(offered) else None


def image_sizes(datamodule: Any) -> dict[str, int]:
    """The side of every image the data module gives the network, by the option that sets it ({} when unknown)."""
    offered = getattr(datamodule, "image_sizes", None)
    return dict(offered()) if callable(offered) else {}


def display_names(datamodule: Any, num_classes: Optional[int] = None) -> list[str]:
    """Human-readable class names: `class_labels` when offered, else `class_names`, else the indices."""
    names = [str(name) for name in (getattr(datamodule, "class_names", None) or [])]
    labels = getattr(datamodule, "class_labels", None)
    if labels and len(labels) == len(names):
        names = [str(label) for label in labels]
    if num_classes is not None and len(names) != num_classes:
        names = [str(i) for i in range(num_classes)]
    return names
