"""Does the chosen checkpoint fit the model and the data? Checked before anything is written, with one line if not.

    python -m classifier_engine validate --config CONFIG --ckpt_path other_project.ckpt
    # error: checkpoint other_project.ckpt was trained on other classes: class 3 is 'fox' there and 'ant' here; ...
"""

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from classifier_engine.errors import CheckpointError

CLASS_NAMES = "class_names"  # the checkpoint's key for the data's class names, in label order
SAVED_AT = "saved_at"  # and for when it was saved (time.time()): which run `--ckpt_path last` continues (resume.py)


class CheckpointValues(Callback):
    """What every checkpoint carries: the data's class names (checked against the data by name when it is loaded), the
    time it was saved, and values only: LightningCLI's `_class_path` / `_instantiator` (code it would import on load)
    are left out. On a resume, the best-checkpoint records follow a run dir that was moved or copied."""

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        names = getattr(trainer.datamodule, "class_names", None)
        if names is not None:
            checkpoint[CLASS_NAMES] = [str(name) for name in names]
        checkpoint[SAVED_AT] = time.time()
        for key in ("hyper_parameters", "datamodule_hyper_parameters"):
            for code in ("_class_path", "_instantiator"):
                (checkpoint.get(key) or {}).pop(code, None)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        # ModelCheckpoint's records are absolute paths: in a run dir moved or copied (`cp -r`) and resumed from its own
        # checkpoints they name the old folder, and Lightning forgets the earlier best ("The dirpath has changed"),
        # then keeps a second "best" file. Runs before every callback's load_state_dict (Lightning 2.6).
        here = os.path.realpath(os.path.dirname(trainer.ckpt_path or ""))
        states = checkpoint.get("callbacks") or {}
        for callback in trainer.checkpoint_callbacks:
            state = states.get(callback.state_key) if isinstance(callback, ModelCheckpoint) else None
            if state and callback.dirpath and os.path.realpath(callback.dirpath) == here != state.get("dirpath", here):
                states[callback.state_key] = moved_records(state, state["dirpath"], here)


def moved_records(state: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """ModelCheckpoint's state with the paths in folder `old` named in folder `new` (the same file names)."""
    def moved(path: Any) -> Any:
        return os.path.join(new, os.path.basename(path)) if isinstance(path, str) and os.path.dirname(path) == old \
            else path

    paths = {key: moved(state[key]) for key in ("best_model_path", "kth_best_model_path", "last_model_path")
             if key in state}
    best = {"best_k_models": {moved(path): score for path, score in state["best_k_models"].items()}} \
        if isinstance(state.get("best_k_models"), dict) else {}
    return {**state, **paths, **best, "dirpath": new}


def saved_class_names(checkpoint: Mapping[str, Any]) -> Optional[list[str]]:
    """The class names a checkpoint was trained on (older checkpoints: in the data module's state), or None."""
    if CLASS_NAMES in checkpoint:
        return list(checkpoint[CLASS_NAMES])
    for value in checkpoint.values():
        if isinstance(value, Mapping) and isinstance(value.get(CLASS_NAMES), list):
            return list(value[CLASS_NAMES])
    return None


def new_head_hint(path: Path, model: Any) -> str:
    """How to start from a checkpoint's weights with a new head: the model's `weights_option` (the contract), if any."""
    option = getattr(model, "weights_option", None)
    return f"--{option} {path} (no --ckpt_path)" if option else "your model's own loading (no --ckpt_path)"


def check_class_names(path: Path, checkpoint: Mapping[str, Any], datamodule: Any, model: Any) -> None:
    """The same count under other names, or in another order, would give silently wrong labels: refused here."""
    saved, names = saved_class_names(checkpoint), getattr(datamodule, "class_names", None)
    if saved is None or names is None or len(saved) != len(names):
        return  # a count that differs is the network check's (a head of another size)
    for index, (there, here) in enumerate(zip(saved, map(str, names))):
        if there != here:
            raise CheckpointError(
                f"checkpoint {path} was trained on other classes: class {index} is {there!r} there and {here!r} in "
                "the data; use data with the checkpoint's class folders (names and order), or fine-tune from its "
                f"weights with a new head: {new_head_hint(path, model)}")


def check_checkpoint_fits(path: Path, checkpoint: dict[str, Any], model: L.LightningModule,
                          datamodule: L.LightningDataModule | None) -> None:
    """CheckpointError naming what differs: the class names, the class count, the network (keys, shapes)."""
    check_class_names(path, checkpoint, datamodule, model)
    saved, expected = checkpoint["state_dict"], model.state_dict()
    missing = [key for key in expected if key not in saved]
    unexpected = [key for key in saved if key not in expected]
    mismatched = [key for key in expected if key in saved and tuple(saved[key].shape) != tuple(expected[key].shape)]
    if not (missing or unexpected or mismatched):
        return
    hparams = checkpoint.get("hyper_parameters") or {}
    saved_classes, classes = hparams.get("num_classes"), model.hparams.get("num_classes")
    if not (missing or unexpected) and saved_classes is not None and classes is not None and saved_classes != classes:
        raise CheckpointError(f"checkpoint {path} has {saved_classes} classes, the data has {classes}: use a "
                              "checkpoint trained on these classes, or start from its weights with a new head: "
                              f"{new_head_hint(path, model)}")
    differ = sorted(key for key in set(hparams) & set(model.hparams) if not key.startswith("_")
                    and isinstance(hparams[key], (str, int, float, bool)) and hparams[key] != model.hparams[key])
    network = f" (its model.{differ[0]} is {hparams[differ[0]]!r}, this model's is {model.hparams[differ[0]]!r})" \
        if differ else ""
    if mismatched:
        key = mismatched[0]
        detail = f"{key} is {tuple(saved[key].shape)} there and {tuple(expected[key].shape)} here"
    elif missing:
        detail = f"it lacks {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
    else:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        detail = f"it has {unexpected[0]} that this model lacks{more}"
    raise CheckpointError(f"checkpoint {path} holds another network{network}: {detail}. Build the same model (its "
                          "run's config.yaml: --config <run>/config.yaml), or start from its weights with a new "
                          f"head: {new_head_hint(path, model)}")
