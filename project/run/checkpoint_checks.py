"""Does the chosen checkpoint fit the model and the data? Checked before anything is written, with one line if not.

    python -m project validate --config configs/quickstart.yaml --ckpt_path other_project.ckpt
    # error: checkpoint other_project.ckpt has 10 classes, the data has 3 (/data/train): ...

Lightning would find out while restoring, after the run dir's config.yaml and event files were written, with a
"size mismatch for network.fc.weight" traceback.
"""

from pathlib import Path

import lightning as L

from project.errors import CheckpointError
from project.run.resume import describe_checkpoint


def check_optimizer_fits(path: Path, checkpoint: dict, model: L.LightningModule) -> None:
    """A resumed fit restores the optimizer's state: the same optimizer, with the same parameter groups."""
    from project.optim import parameter_groups

    states = checkpoint.get("optimizer_states") or []
    hparams = checkpoint.get("hyper_parameters") or {}
    if not states or not hasattr(model, "network"):
        return
    before, now = hparams.get("optimizer", "sgd"), model.hparams.get("optimizer", "sgd")
    if before != now:
        raise CheckpointError(f"checkpoint {path} was trained with model.optimizer={before}, this run asks for {now}: "
                              f"its optimizer state cannot continue; resume with {before}, or start a new run from its "
                              f"weights with --model.weights {path}")
    hp = model.hparams
    expected = [len(g["params"]) for g in parameter_groups(model.network, hp.weight_decay,
                                                          decay_norm_and_bias=hp.decay_norm_and_bias, lr=1.0,
                                                          backbone_lr_factor=hp.backbone_lr_factor)]
    saved = [len(g["params"]) for g in states[0].get("param_groups", [])]
    if saved != expected:
        keys = [k for k in ("decay_norm_and_bias", "backbone_lr_factor") if k in hparams and hparams[k] != hp.get(k)]
        what = ", ".join(f"model.{k} {hparams[k]} -> {hp.get(k)}" for k in keys) or "the parameter groups"
        raise CheckpointError(f"checkpoint {path} has {len(saved)} parameter group(s) of {saved} parameters, this run "
                              f"{len(expected)} of {expected} ({what}): resume with the checkpoint's settings, or start "
                              f"a new run from its weights with --model.weights {path}")


def check_checkpoint_fits(path: Path, model: L.LightningModule, datamodule: L.LightningDataModule | None,
                          *, resuming: bool = False) -> None:
    """CheckpointError naming what differs: the class count, the network (keys, shapes), the optimizer (resuming)."""
    checkpoint = describe_checkpoint(path)
    if resuming:
        check_optimizer_fits(path, checkpoint, model)
    saved = checkpoint["state_dict"]
    expected = model.state_dict()
    hparams = checkpoint.get("hyper_parameters") or {}
    missing = [key for key in expected if key not in saved]
    unexpected = [key for key in saved if key not in expected]
    mismatched = [key for key in expected if key in saved and tuple(saved[key].shape) != tuple(expected[key].shape)]
    if not (missing or unexpected or mismatched):
        return
    saved_classes = hparams.get("num_classes")
    classes = getattr(model.hparams, "num_classes", None) if hasattr(model, "hparams") else None
    where = f" ({datamodule.root / 'train'})" if datamodule is not None and hasattr(datamodule, "root") else ""
    if not (missing or unexpected) and saved_classes is not None and classes is not None and saved_classes != classes:
        raise CheckpointError(
            f"checkpoint {path} has {saved_classes} classes, the data has {classes}{where}: use a checkpoint trained "
            f"on these classes, or start from its weights with a new head: --model.weights {path} (no --ckpt_path)"
        )
    network = f" (its model.arch is {hparams['arch']!r}, this model's is {model.hparams.get('arch')!r})" \
        if "arch" in hparams and hasattr(model, "hparams") and hparams.get("arch") != model.hparams.get("arch") else ""
    if mismatched:
        key = mismatched[0]
        detail = f"{key} is {tuple(saved[key].shape)} there and {tuple(expected[key].shape)} here"
    elif missing:
        detail = f"it lacks {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
    else:
        detail = f"it has {unexpected[0]} that this model lacks" + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
    raise CheckpointError(
        f"checkpoint {path} holds another network{network}: {detail}. Build the same model (its run's config.yaml: "
        f"--config <run>/config.yaml), or start from its weights with --model.weights {path}"
    )
