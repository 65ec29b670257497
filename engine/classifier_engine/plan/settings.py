"""The run plan's passes on the settings: the classes, nulls, the monitor, the seed, the world, the batch, and the
model's values from a checkpoint. Each reads the config and returns its decisions with their edits.

    python -m classifier_engine fit --config CONFIG --plan
"""

import os
import random
from pathlib import Path
from typing import Any, Optional

import lightning as L
from jsonargparse import Namespace
from lightning.pytorch.utilities.model_helpers import is_overridden

from classifier_engine import class_switch
from classifier_engine.compat.ckpt_hparams import explicit_model_values
from classifier_engine.compat.ckpt_read_once import checkpoint_values
from classifier_engine.compat.subclass_nulls import restored_nulls
from classifier_engine.config_edits import PARSE_LINKS, run_seed
from classifier_engine.contract import class_of, monitor_of, monitor_options
from classifier_engine.errors import ConfigError
from classifier_engine.options import refuse_others_options
from classifier_engine.run.global_batch import FLAG, planned_world, split_global_batch
from classifier_engine.run.launchers import check_devices
from classifier_engine.run_plan import (
    CLASSES,
    FINISHED,
    GLOBAL_BATCH,
    MONITOR,
    PRECISION,
    SEED,
    STRATEGY,
    WORLD_SIZE,
    Decision,
    PlanInput,
)
from classifier_engine.samplers import changed_inside_an_epoch, mid_epoch_order

# What the CLI's links may set in a model's init arguments (a class switch leaves them to the link; a checkpoint's
# saved value of one the class lacks is not the user's: compat "applied instantiation links").
LINKED = {"model": ("num_classes", "image_sizes", "batch_size", "seed"), "data": ("seed",)}
DDP_START_METHODS = {"ddp": "popen", "ddp_spawn": "spawn", "ddp_fork": "fork"}  # Lightning's names, our DDPStrategy


def _class_path(section: Any) -> Optional[str]:
    return section.get("class_path") if isinstance(section, Namespace) else None


def classes(given: PlanInput) -> list[Decision]:
    """The model and data classes, each starting from its own defaults (class_switch.py)."""
    config = given.config
    edits, notes = class_switch.resets(config, given.explicit, given.argv, given.default_classes, LINKED) \
        if given.argv is not None else ([], [])
    chosen, whys = {part: _class_path(config.get(part)) for part in class_switch.PARTS}, []
    for part in chosen:
        named, default = _class_path(given.explicit.get(part)), given.default_classes.get(part)
        whys.append(f"{part} " + ("given" if named else "the entry point's default" if default else "from the config"))
    resets = [f"{key.replace('.init_args', '')} {value!r}" for key, value in edits]
    why = "; ".join([", ".join(whys), *([f"the switched-to class's own defaults: {', '.join(resets)}"] if resets
                                        else []), *notes])
    decisions = [Decision(CLASSES, chosen, why, edits=tuple(edits))]
    if given.argv is not None and (nulls := restored_nulls(config, given.argv)):
        decisions.append(Decision("nulls", [key for key, _ in nulls], "given as null on the command line (compat: "
                                  "jsonargparse reads them as 'None' in subclass mode)", edits=tuple(nulls)))
    return decisions


def monitor(given: PlanInput) -> list[Decision]:
    """The best checkpoint's metric and mode: --checkpoint.monitor, else the chosen model class's Monitor."""
    config, explicit = given.config, given.explicit
    if config.get("checkpoint") is None or not isinstance(config.get("model"), Namespace):
        return []
    if explicit.get("checkpoint.monitor") is not None:
        value = {"metric": config.checkpoint.monitor, "mode": config.checkpoint.mode}
        return [Decision(MONITOR, value, "--checkpoint.monitor given")]
    path = config.model.get("class_path")
    model_class = class_of(path)  # (imported once: its Monitor, or what it names instead)
    found = monitor_of(model_class)
    options = monitor_options(model_class) or {"checkpoint.monitor": None, "checkpoint.mode": "min",
                                               "checkpoint.filename": None}
    edits = tuple((key, value) for key, value in options.items()
                  if explicit.get(key) is None and config.get(key) != value)
    if found is None:
        named = getattr(model_class, "monitor", None)
        what = f"{path}.monitor is {named!r}, not a Monitor: ignored" if named is not None else \
            f"{path} names no Monitor"
        return [Decision(MONITOR, None, f"{what}; \"best\" is the latest epoch's checkpoint", edits=edits)]
    guessed = "" if found.mode_given else f", no mode given: {found.mode}" + (" for a loss or an error" if (
        found.mode == "min") else "")
    return [Decision(MONITOR, {"metric": found.metric, "mode": config.checkpoint.mode if explicit.get(
        "checkpoint.mode") else found.mode}, f"{path.rpartition('.')[2]}.monitor{guessed}", edits=edits)]


def seed(given: PlanInput) -> list[Decision]:
    """The run seed every shuffle and augmentation derives from (`seed_everything: true` draws one now, once)."""
    value = given.config.get("seed_everything")
    if value is True:
        drawn = int(os.environ.get("PL_GLOBAL_SEED") or random.randint(0, 2**32 - 1))  # a launcher's ranks share it
        return [Decision(SEED, drawn, "seed_everything: true, drawn at this start",
                         edits=(("seed_everything", drawn),))]
    why = "seed_everything, " + ("given" if given.explicit.get("seed_everything") is not None else "its default")
    edits = tuple((target, compute(value)) for source, target, compute in PARSE_LINKS
                  if source == "seed_everything" and target in given.config and given.config[target] != compute(value))
    return [Decision(SEED, run_seed(value), why if value is not False else "seed_everything: false (the data order and "
                     "augmentations from seed 0)", edits=edits)]


def world(given: PlanInput) -> list[Decision]:
    """How many processes train (and who said so), the strategy and the precision, as the run will resolve them."""
    trainer = given.config.trainer
    check_devices(trainer.devices, trainer.accelerator)
    size, how = planned_world(trainer)
    strategy = trainer.get("strategy")
    name = strategy if isinstance(strategy, str) else _class_path(strategy) or type(strategy).__name__
    minutes = given.config.get("ddp_timeout_minutes") or 10.0
    if name in DDP_START_METHODS:  # (a class path or a class's name is never one of Lightning's names)
        what = (f"torch DDP, ranks started by {DDP_START_METHODS[name]}, a silent rank ends the job after "
                f"{minutes:g} min")
    elif name in ("fsdp2", "fsdp2_sharded"):
        what = f"torch FSDP2 ({'sharded' if name == 'fsdp2_sharded' else 'one-file'} checkpoints)"
    else:
        what = "Lightning's choice for the devices" if name in (None, "auto") else "trainer.strategy"
    precision = trainer.get("precision") or "32-true"
    return [Decision(WORLD_SIZE, size, how), Decision(STRATEGY, name, what),
            Decision(PRECISION, str(precision), "trainer.precision" + (" (its default)" if trainer.get(
                "precision") is None else ""))]


def batch(given: PlanInput) -> list[Decision]:
    """fit: images per optimizer step = per-process batch x processes x accumulation; --global_batch_size fixes it."""
    config, size = given.config, given.decided.world_size
    if config.trainer.max_epochs == -1 and config.trainer.max_steps in (None, -1):
        raise ConfigError("trainer.max_epochs=-1 and no trainer.max_steps: the run has no end, and the LR schedule "
                          "needs one; set --trainer.max_epochs or --trainer.max_steps")
    data = config.data.get("init_args") if isinstance(config.get("data"), Namespace) else None
    largest = data.get("batch_size") if data is not None else None
    global_batch = config.get("global_batch_size")
    if largest is None and global_batch is None:
        return [Decision(GLOBAL_BATCH, None, "the data module has no batch_size")]
    if largest is None:
        raise ConfigError(
            f"{FLAG} sets the data module's per-process batch_size, and {_class_path(config.get('data'))} has none: "
            f"give its __init__ a batch_size argument (used by its train_dataloader), or drop {FLAG}")
    if global_batch is None:
        per_process, accumulation = largest, config.trainer.get("accumulate_grad_batches") or 1
        why, edits = "data.batch_size x processes x trainer.accumulate_grad_batches", ()
    else:
        per_process, accumulation = split_global_batch(global_batch, size, largest)
        given_accumulation = given.explicit.get("trainer.accumulate_grad_batches")
        replaced = f"; trainer.accumulate_grad_batches {given_accumulation} given, not used" if (
            given_accumulation not in (None, accumulation)) else ""
        why = f"{FLAG} {global_batch}, data.batch_size {largest} at most{replaced}"
        edits = (("data.init_args.batch_size", per_process), ("trainer.accumulate_grad_batches", accumulation))
    value = {"global": per_process * size * accumulation, "per_process": per_process, "processes": size,
             "accumulation": accumulation, "fixed": global_batch is not None}
    processes = f"{size} process{'es' if size > 1 else ''}"
    return [Decision(GLOBAL_BATCH, value, why, edits=edits,
                     text=f"{value['global']} = {per_process} per process x {processes} x {accumulation} accumulated")]


def checkpoint_model_values(given: PlanInput) -> list[Decision]:
    """--ckpt_path's model hyperparameters (values only; a key that names code is left out), unless given explicitly."""
    checkpoint = given.reads.get("checkpoint")
    hparams = (checkpoint or {}).get("hyper_parameters") or {}
    model = given.config.get("model")
    if not hparams or given.parse_model is None or not isinstance(model, Namespace):
        return []
    # the class the config names (imported already by the parse): never the checkpoint's
    taken, dropped = checkpoint_values(class_of(model.class_path), hparams, LINKED["model"])
    decisions = []
    if dropped:
        left_out = [f"model.{key}" for key in dropped]
        decisions.append(Decision("checkpoint values left out", left_out, "checkpoints carry values, the config "
                                  "names classes", text=", ".join(left_out)))
    merged = given.parse_model({"class_path": model.class_path, "init_args": taken}) if taken else model
    edits, kept = explicit_model_values(model, merged, given.explicit)
    edits = [(key, value) for key, value in edits if key.removeprefix("model.init_args.") not in LINKED["model"]]
    if edits or kept:
        names = sorted(key.removeprefix("model.init_args.") for key, _ in edits)
        decisions.append(Decision("model from checkpoint", names, "--ckpt_path's hyperparameters" + (
            f"; given instead: {', '.join(kept)}" if kept else ""), text=", ".join(names) or "none taken",
            edits=tuple(edits)))
    return decisions


def resumed_epoch(given: PlanInput) -> list[Decision]:
    """fit from a checkpoint saved inside an epoch: the options that decide which samples each of its steps takes
    (the seed, --global_batch_size when given, data.ra_reps, drop_last and shuffle_window) are the saved ones, or
    refused in one line: another value would train some of the epoch's samples twice and skip others (the training
    set's length is known at train start: samplers.py ExactLoaders). Without a global batch the rest of the epoch is
    taken in this run's batches (each sample once, whatever the world size or per-process batch)."""
    checkpoint = given.reads.get("checkpoint") or {}
    state = mid_epoch_order(checkpoint) if given.subcommand == "fit" else None
    if state is None:
        return []
    data = given.config.data.get("init_args") if isinstance(given.config.get("data"), Namespace) else None
    saved_data = checkpoint.get("datamodule_hyper_parameters") or {}
    kept = [("--seed_everything", state.get("seed"), given.decided.value(SEED))]
    if given.decided.global_batch is not None:
        kept.append((FLAG, state.get("global_batch"), given.decided.global_batch))
    for name in ("ra_reps", "drop_last", "shuffle_window"):  # the image data modules' (a user's may have none)
        if data is not None and name in data and name in saved_data:
            kept.append((f"--data.{name}", saved_data[name], data[name]))
    where = (f"checkpoint {given.decided.ckpt_path} stopped inside epoch {state['epoch']} ({state['position']} "
             "samples in)")
    for option, saved, now in kept:
        if saved != now:
            raise ConfigError(changed_inside_an_epoch(option, saved, now, where))
    return [Decision("resumed epoch", {"epoch": state["epoch"], "samples": state["position"]}, "the checkpoint "
                     "stopped inside it: the rest of its order, each sample once", text=f"{state['epoch']} after "
                     f"{state['position']} samples")]


def subcommand_options(given: PlanInput) -> list[Decision]:
    """A flag the subcommand does not use is refused in one line; predict's folder (--predictions.images) is read by
    an image data module's own predict path (its predict_root), or refused beside a data module's own predict set."""
    if given.subcommand is not None:
        refuse_others_options(given.argv or (), given.subcommand, given.subcommand)
    images = given.config.get("predictions.images") if given.subcommand == "predict" else None
    if images is not None and not Path(images).expanduser().is_dir():  # (--plan too: before a run dir is made)
        raise ConfigError(f"--predictions.images {images} is not a folder: pass a folder of images (any depth)")
    data = given.config.get("data")
    if images is None or not isinstance(data, Namespace):
        return []
    if "predict_root" in (data.get("init_args") or ()):
        root = given.explicit.get("data.init_args.predict_root")
        if root is not None and root != images:
            raise ConfigError(f"--predictions.images {images} and --data.predict_root {root}: two folders to predict; "
                              "give one")
        return [Decision("predict set", images, f"--predictions.images, read by {data.class_path}'s own predict path",
                         edits=(("data.init_args.predict_root", images),))]
    module = class_of(data.class_path)
    if module is not None and is_overridden("predict_dataloader", module, L.LightningDataModule):
        raise ConfigError(f"--predictions.images {images}: data module {data.class_path} makes its own predict set "
                          "(predict_dataloader) and takes no predict_root; drop --predictions.images")
    return [Decision("predict set", images, "--predictions.images, read with the data module's eval preprocessing")]


def finished(given: PlanInput) -> list[Decision]:
    """fit: a checkpoint that has trained all the run asks for (its epochs, or max_steps) leaves nothing to do: said,
    with the option that continues it, and the start ends there (Lightning would restore it and stop, silently)."""
    checkpoint, trainer = given.reads.get("checkpoint"), given.config.trainer
    if given.subcommand != "fit" or checkpoint is None:
        return []
    epochs = ((checkpoint.get("loops") or {}).get("fit_loop") or {}).get("epoch_progress", {}).get("current", {})
    done, step = int(epochs.get("processed") or 0), int(checkpoint.get("global_step") or 0)
    max_epochs, max_steps = trainer.get("max_epochs") or -1, trainer.get("max_steps") or -1
    if max_steps > 0 and step >= max_steps:
        why = f"its {step} steps are trainer.max_steps {max_steps}: continue it with a larger --trainer.max_steps"
    elif max_steps <= 0 and 0 < max_epochs <= done:
        why = (f"its {done} epochs are trainer.max_epochs {max_epochs}: continue it with a larger "
               "--trainer.max_epochs")
    else:
        return []
    return [Decision(FINISHED, True, why, text="the run is complete, nothing to train")]
