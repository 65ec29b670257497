"""Does the chosen checkpoint fit the model and the data? Checked before anything is written, with one line if not.

    python -m project validate --config configs/quickstart.yaml --ckpt_path other_project.ckpt
    # error: checkpoint other_project.ckpt has 10 classes, the data has 3 (/data/train): ...

Lightning would find out while restoring, after the run dir's config.yaml and event files were written, with a
"size mismatch for network.fc.weight" traceback.
"""

from pathlib import Path
from typing import Any

import lightning as L

from project.engine.errors import CheckpointError


def check_checkpoint_fits(path: Path, checkpoint: dict[str, Any], model: L.LightningModule,
                          datamodule: L.LightningDataModule | None) -> None:
    """CheckpointError naming what differs: the class count, the network (keys, shapes). `checkpoint` is `path` as
    the run plan loaded it (project.engine.run.resume): the file is not read again. (Whether the optimizer state fits is the
    model's to check: ImageClassifier.on_load_checkpoint.)"""
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
            f"on these classes, or start from its weights with a new head: --model.finetune.weights {path} (no --ckpt_path)"
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
        f"--config <run>/config.yaml), or start from its weights with --model.finetune.weights {path}"
    )
