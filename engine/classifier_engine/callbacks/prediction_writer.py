"""predict's CSV: path, then the top-k class names and probabilities, in path order (docs/how-it-works.md#predict).

    python -m classifier_engine predict --config CONFIG --ckpt_path <run>/checkpoints/last.ckpt \
        --data.predict_root path/to/images [--predictions.output predictions.csv]
"""

import csv
import functools
import io
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader, default_collate

from classifier_engine.contract import display_names
from classifier_engine.data.predict import ImagePathDataset, eval_transform
from classifier_engine.errors import ConfigError, DiskFullError, UserError, shown
from classifier_engine.storage.files import atomic_write

MAX_NAMED = 5  # unpredicted images named in the warning
TOP_K = 5  # classes per image in the CSV, from logits


def gather_rows(pl_module: L.LightningModule, rows: torch.Tensor, world_size: int) -> torch.Tensor:
    """Concatenate every rank's rows (shards may differ in length) on every rank."""
    device = pl_module.device
    counts = pl_module.all_gather(torch.tensor([rows.shape[0]], device=device)).reshape(world_size)
    # all_gather needs equal shapes on every rank: pad to the longest shard, then cut each back.
    padded = rows.new_zeros((int(counts.max()), *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    gathered = pl_module.all_gather(padded.to(device)).reshape(world_size, *padded.shape).cpu()
    return torch.cat([gathered[rank, : int(count)] for rank, count in enumerate(counts.tolist())])


class PredictionCsvWriter(BasePredictionWriter):
    """Collects (index, top-k probabilities, top-k classes) per batch; one CSV at the end of the predict epoch. Takes
    batches of (images, indices into the data set's `paths`) and predict_step's {"probs": (B, k), "classes": (B, k)}."""

    def __init__(self, output: Optional[str] = None, images: Optional[str] = None, batch_size: int = 64):
        """
        Args:
            output: CSV file to write; None writes predictions.csv into the predict run's log dir.
            images: a folder of images (any depth) to predict when the data module offers no predict_dataloader();
                read with its eval_preprocessing(), else as pixels scaled to [0, 1] (classifier_engine.contract).
            batch_size: images per batch of that folder.
        """
        super().__init__(write_interval="batch")
        self.output, self.images, self.batch_size = output, images, batch_size
        self.class_names: Optional[list[str]] = None  # given with a folder's loader (no data module then)
        self.written: Optional[Path] = None
        self._dataset: Any = None
        self._output: Optional[Path] = None
        self._reset()

    def _reset(self) -> None:
        self._indices, self._probs, self._classes = [], [], []

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # log_dir is agreed on by a collective call, so every rank computes it, not only rank 0.
        run_dir = Path(trainer.log_dir or trainer.default_root_dir)
        self._output = Path(self.output) if self.output else run_dir / "predictions.csv"
        if trainer.is_global_zero:
            _check_writable(self._output)  # before any image is predicted, not after all of them

    def on_predict_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reset()
        loaders = trainer.predict_dataloaders
        self._dataset = getattr(loaders[0] if isinstance(loaders, (list, tuple)) else loaders, "dataset", None)
        if not hasattr(self._dataset, "paths"):  # nothing is written then
            rank_zero_warn(f"no predictions CSV written: the predict data set ({type(self._dataset).__name__}) has no "
                           "`paths` to name the rows with; predict through the data module (--data.predict_root, "
                           "classifier_engine.data.predict)")
            self._dataset = None

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        if self._dataset is None:
            return
        if dataloader_idx != 0:
            raise ValueError(f"PredictionCsvWriter writes one predict dataloader, got dataloader_idx={dataloader_idx}")
        if isinstance(prediction, torch.Tensor) and prediction.ndim == 2:  # logits: the contract's other form
            top = prediction.detach().float().softmax(dim=1).topk(min(TOP_K, prediction.shape[1]), dim=1)
            prediction = {"probs": top.values, "classes": top.indices}
        if not (isinstance(batch, Sequence) and len(batch) == 2 and isinstance(prediction, Mapping)):
            raise TypeError("PredictionCsvWriter expects batches of (images, indices) and predictions: logits (B, "
                            f"classes) or {{'probs', 'classes'}}; got a {type(batch).__name__} batch and a "
                            f"{type(prediction).__name__} prediction (classifier_engine.contract.ClassificationModel)")
        self._indices.append(torch.as_tensor(batch[1]).detach().cpu().long())
        self._probs.append(prediction["probs"].detach().float().cpu())
        self._classes.append(prediction["classes"].detach().cpu().long())

    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        dataset = self._dataset
        if dataset is None:
            return
        names = self.class_names or display_names(trainer.datamodule, pl_module.hparams.get("num_classes"))
        k = self._probs[0].shape[1] if self._probs else min(TOP_K, len(names))
        indices, probs, classes = (
            gather_rows(pl_module, torch.cat(rows) if rows else empty, trainer.world_size)
            for rows, empty in ((self._indices, torch.empty(0, dtype=torch.long)), (self._probs, torch.empty(0, k)),
                                (self._classes, torch.empty(0, k, dtype=torch.long))))
        self._reset()
        if not trainer.is_global_zero:
            return
        # Sorted by index: the data set's (sorted path) order; a sampler's padding duplicates dropped (the first kept).
        indices, first = np.unique(indices.numpy(), return_index=True)
        probs, classes = probs[first], classes[first]
        if len(indices) != len(dataset.paths):
            missing = sorted(set(range(len(dataset.paths))) - set(indices.tolist()))
            named = ", ".join(shown(dataset.paths[i]) for i in missing[:MAX_NAMED])
            more = f" and {len(missing) - MAX_NAMED} more" if len(missing) > MAX_NAMED else ""
            rank_zero_warn(f"predicted {len(indices)} of {len(dataset.paths)} images; not in the CSV: {named}{more} "
                           "(unreadable with data.on_corrupt=skip, or cut by limit_predict_batches)")
        content = csv_bytes([dataset.paths[i] for i in indices.tolist()], probs, classes, names)
        self.written = _write_or_rescue(self._output, content, len(indices))
        rank_zero_info(f"predictions for {len(indices)} images written to {shown(self._output)}")


def folder_loader(trainer: L.Trainer, model: L.LightningModule, datamodule: Any) -> Optional[DataLoader]:
    """The loader of the folder --predictions.images for a data module without a predict set of its own (the plan
    gave an image data module's own predict_root that folder), read with the data module's eval preprocessing."""
    if datamodule is None or is_overridden("predict_dataloader", datamodule, L.LightningDataModule):
        return None
    writer = next((c for c in trainer.callbacks if isinstance(c, PredictionCsvWriter)), None)
    if writer is None or writer.images is None:
        raise ConfigError(f"data module {type(datamodule).__qualname__} offers no predict_dataloader(): pass "
                          "--predictions.images DIR (a folder of images, read with its eval_preprocessing())")
    writer.class_names = display_names(datamodule, model.hparams.get("num_classes"))
    dataset = ImagePathDataset(writer.images, transform=eval_transform(datamodule))
    return DataLoader(dataset, batch_size=writer.batch_size, collate_fn=functools.partial(_one_size, dataset.paths))


def _one_size(paths: list, items: list) -> Any:
    """default_collate, or one line when the images differ in size (a module without eval_preprocessing(): no
    resize), naming two of them."""
    sizes: dict[tuple, int] = {}
    for image, index in items:
        sizes.setdefault(tuple(image.shape[-2:]), int(index))
    if len(sizes) > 1:
        (a, i), (b, j) = list(sizes.items())[:2]
        raise UserError(f"--predictions.images: {shown(paths[i])} is {a[1]}x{a[0]} pixels, {shown(paths[j])} "
                        f"{b[1]}x{b[0]}: a batch holds images of one size, and the data module offers no "
                        "eval_preprocessing() to resize them (the contract); add it, or pass "
                        "--predictions.batch_size 1")
    return default_collate(items)


def _check_writable(output: Path) -> None:
    """Create a file beside `output` and remove it: a bad --predictions.output fails now, in one line."""
    try:
        if output.is_dir():
            raise IsADirectoryError(21, "a folder is there")
        output.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=output.parent, prefix=f".{output.name}.", suffix=".probe"):
            pass
    except OSError as error:
        raise ConfigError(f"cannot write the predictions to {shown(output)} ({error.strerror or error}): pass "
                          "--predictions.output FILE.csv in a folder you can write to") from error


def csv_bytes(paths: list, probs: torch.Tensor, classes: torch.Tensor, names: list[str]) -> bytes:
    """The CSV: header, then one row per path; each path cell holds the name's exact bytes (os.fsencode)."""
    k = probs.shape[1]
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    writer.writerow(["path", *(f"{col}_{rank}" for rank in range(1, k + 1) for col in ("class", "prob"))])
    top_class = int(classes.max()) if classes.numel() else -1
    label = [*names, *map(str, range(len(names), top_class + 1))]  # indices for unnamed classes
    for path, row_probs, row_classes in zip(paths, probs.tolist(), classes.tolist()):
        cells = [item for c, p in zip(row_classes, row_probs) for item in (label[c], f"{p:.6f}")]
        # surrogateescape both ways: a byte that is not UTF-8 becomes a lone surrogate here and that byte again below.
        writer.writerow([os.fsencode(path).decode("utf-8", "surrogateescape"), *cells])
    return text.getvalue().encode("utf-8", "surrogateescape")


def _write_or_rescue(output: Path, content: bytes, rows: int) -> Path:
    """atomic_write `output`; if that fails, write the rows into $TMPDIR and raise an error line that says where."""
    try:
        return atomic_write(output, lambda file: file.write(content))
    except (OSError, DiskFullError) as error:
        reason = "no space left on the device" if isinstance(error, DiskFullError) else error.strerror or str(error)
        rescue = Path(tempfile.gettempdir()) / f"{output.stem}.{os.getpid()}{output.suffix}"
        try:
            atomic_write(rescue, lambda file: file.write(content))
        except (OSError, DiskFullError):
            raise error from None
        raise UserError(f"could not write {shown(output)} ({reason}); the predictions for {rows} images were written "
                        f"to {shown(rescue)} instead: move that file where you want it (or fix the cause and predict "
                        "again)") from error
