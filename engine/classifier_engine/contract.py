"""The contract: what the engine reads of a model and of a data module, in this file only (engine/README.md).

Data, known after `__init__`: `num_classes` and `class_names` (label i is class_names[i]); train and val loaders
yielding `(images, labels)`. Optional: `class_labels` (human names, in class_names' order), `eval_preprocessing()`
(for predict and export), `image_sizes()` (the model's size check).

Model: ClassificationModel below. Checked before the first step, in one line each: the monitor by the run plan (and
against what the model logs at its first validation: callbacks/monitor_logged.py), the rest once the model is built.
"""

import importlib
import inspect
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal, Optional, Protocol, runtime_checkable

import torch

from classifier_engine.errors import ConfigError


@runtime_checkable
class ClassificationData(Protocol):
    """The minimum: any LightningDataModule with these two attributes set in `__init__`."""

    num_classes: int
    class_names: Sequence[str]


LOSS_LIKE = ("loss", "err", "nll", "mse", "mae", "perplexity")  # in a metric's name: lower is better


@dataclass(frozen=True)
class Monitor:
    """The metric that picks the best checkpoint (and names its file), scores a sweep's trials and shows in the
    progress bar: a name the module logs (self.log) at each validation, and whether "max" or "min" is better (left
    out: "min" for a loss or an error, `val/loss`, `val/err1`, else "max"; the run plan's line says which)."""

    metric: str
    mode: Optional[Literal["min", "max"]] = None
    mode_given: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.mode is None:
            lower = any(word in self.metric.lower() for word in LOSS_LIKE)
            object.__setattr__(self, "mode", "min" if lower else "max")
            object.__setattr__(self, "mode_given", False)

    def checkpoint_filename(self) -> str:
        """ModelCheckpoint's filename: `epoch003-val_acc=0.9859` for metric `val/acc` (a "/" cannot be in a name)."""
        return "epoch{epoch:03d}-" + self.metric.replace("/", "_") + "={" + self.metric + ":.4f}"


@runtime_checkable
class ClassificationModel(Protocol):
    """What the engine reads of a LightningModule, beyond Lightning's own hooks:

    - `monitor` (a class attribute, a Monitor): the metric of the best checkpoint, sweeps and the progress bar;
      `--checkpoint.monitor` overrides it. Without one (or with a plain string) "best" is the latest epoch's.
    - `hparams["num_classes"]`: `save_hyperparameters()` of an `__init__` argument `num_classes` (the CLI links it from
      data.num_classes), so a checkpoint says what it was trained for and rebuilds its module from the run's config;
      a model that takes none is refused (its head could not follow the data).
    - `predict_step(batch)` on batches of `(images, indices)`: logits `(B, num_classes)`, or `{"probs": (B, k),
      "classes": (B, k)}`, the top k; the prediction CSV names the classes.
    - optional `exportable()`: the plain nn.Module (images in, logits out) that export writes and the FLOP count (MFU)
      runs on; without it export writes the module itself and no FLOPs are counted.
    - optional `weights_option` (a class attribute): the option that starts a fit from a checkpoint's weights with a
      new head, which the refusal of a checkpoint of other classes or another network names.
    """

    monitor: ClassVar[Monitor]


def class_of(path: str) -> Optional[type]:
    """The class a class_path names (imported by the parse already), or None."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None  # the parse has said what is wrong with it already


def monitor_of(model_class: Any) -> Optional[Monitor]:
    """A model class's (or its dotted class path's) Monitor, None when it names none."""
    if isinstance(model_class, str):
        model_class = class_of(model_class)  # None: the CLI says what is wrong with the class path when it builds it
    monitor = getattr(model_class, "monitor", None)
    return monitor if isinstance(monitor, Monitor) else None


def monitor_options(model_class) -> dict[str, object]:
    """The checkpoint group's monitor, mode and file name from a model class's contract Monitor ({} without one)."""
    if (monitor := monitor_of(model_class)) is None:
        return {}
    return {"checkpoint.monitor": monitor.metric, "checkpoint.mode": monitor.mode,
            "checkpoint.filename": monitor.checkpoint_filename()}


def exportable(model: Any) -> Any:
    """The network a model exports and counts FLOPs on: its `exportable()`, else the module itself."""
    offered = getattr(model, "exportable", None)
    return offered() if callable(offered) else model


def check_model(model: Any, num_classes: Optional[int] = None) -> None:
    """The model, checked against the contract (ConfigError naming what is missing and the fix)."""
    name = type(model).__qualname__
    taken = inspect.signature(type(model).__init__).parameters.values()
    if not any(p.name == "num_classes" or p.kind is p.VAR_KEYWORD for p in taken):
        # The CLI's link would still write the data's count into its hyperparameters: a checkpoint saying N classes
        # of a head built for another number.
        raise ConfigError(f"model {name} takes no num_classes: its head cannot follow the data's {num_classes} "
                          "classes; take `num_classes: int` in its __init__, build the head with it and call "
                          "self.save_hyperparameters() (see engine/README.md)")
    if "num_classes" not in getattr(model, "hparams", {}):
        raise ConfigError(f"model {name} records no num_classes: take `num_classes: int` in its __init__ and call "
                          "self.save_hyperparameters() (the CLI links it from the data; see engine/README.md)")


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
                          "count, and the class names in label order; see engine/README.md)")
    if isinstance(datamodule.class_names, (str, bytes)) or not isinstance(datamodule.class_names, Sequence):
        raise ConfigError(f"data module {name}: class_names is {type(datamodule.class_names).__name__}, expected a "
                          "list of the class names in label order: set it in its __init__ (see engine/README.md)")
    names = list(datamodule.class_names)
    if len(names) != datamodule.num_classes or len(set(names)) != len(names):
        raise ConfigError(f"data module {name}: num_classes is {datamodule.num_classes} but class_names holds "
                          f"{len(names)} names ({len(set(names))} distinct): one name per class, in label order")
    return datamodule


def check_batch(batch: Any, num_classes: int, where: str) -> None:
    """A batch as the contract has it, (images, labels) with labels in 0..num_classes-1 (or (B, num_classes) soft
    targets): ConfigError naming what came instead. Cheap (on the host, where the loader makes the batch)."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(x, torch.Tensor) for x in batch)):
        if isinstance(batch, dict):
            what = f"a dict (keys {', '.join(map(str, batch))})"
        elif isinstance(batch, (tuple, list)):
            what = f"a {type(batch).__name__} of {len(batch)} ({', '.join(type(x).__name__ for x in batch)})"
        else:
            what = f"a {type(batch).__name__}"
        raise ConfigError(f"{where} yields {what}, expected a pair (images, labels) of tensors: return (image, label) "
                          "from the data set (or its collate_fn; see engine/README.md)")
    images, labels = batch
    soft = labels.is_floating_point() and labels.shape == (len(images), num_classes)
    if not soft and (labels.is_floating_point() or labels.dtype == torch.bool or labels.shape != images.shape[:1]):
        raise ConfigError(f"{where} yields labels of shape {tuple(labels.shape)} and dtype {labels.dtype} for "
                          f"{len(images)} images, expected one integer class index per image")
    if not soft and labels.numel() and labels.device.type == "cpu":
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or high >= num_classes:
            raise ConfigError(f"{where} yields label {low if low < 0 else high}, outside 0..{num_classes - 1} "
                              f"(num_classes is {num_classes}): fix the labels, or num_classes and class_names")


class CheckedCollate:
    """A user's loader's collate_fn, each batch then checked (check_batch) in the process that makes it."""

    def __init__(self, collate: Any, num_classes: int, where: str):
        self.collate, self.num_classes, self.where = collate, num_classes, where

    def __call__(self, samples: Any) -> Any:
        batch = self.collate(samples)
        check_batch(batch, self.num_classes, self.where)
        return batch


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
