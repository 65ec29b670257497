"""Configs written for the flat ImageClassifier (before its options were grouped) fail with one line naming the new key.

    python -m project fit --config configs/quickstart.yaml --model.lr_per_256=0.2
    # error: model.lr_per_256: moved to model.optim.lr_per_256; ...
"""

import argparse
import re
from collections.abc import Callable
from typing import Any, Optional

_GROUPS = {
    "optim": ("optimizer", "lr_per_256", "momentum", "nesterov", "adamw_betas", "eps", "weight_decay",
              "decay_norm_and_bias", "schedule", "warmup_epochs", "step_milestones", "step_gamma"),
    "loss": ("label_smoothing", "bce_target_threshold", "mixup_alpha", "cutmix_alpha"),
    "finetune": ("weights", "freeze_backbone_epochs", "backbone_lr_factor"),
}
_EMA = "the EMA is a callback now: --trainer.callbacks+=project.callbacks.ema.EMA --trainer.callbacks.{}"

# model.<old key> -> what to write instead
MOVED: dict[str, str] = {
    **{old: f"moved to model.{group}.{old}" for group, keys in _GROUPS.items() for old in keys},
    "loss": "moved to model.loss.name (model.loss is the loss group: name, label_smoothing, mixup_alpha, ...)",
    "ema_decay": _EMA.format("decay=..."),
    "ema_every_n_steps": _EMA.format("every_n_steps=..."),
    "ema_adjust_decay": _EMA.format("adjust_decay=true"),
    "grad_clip_norm": "removed: use --trainer.gradient_clip_val (clips the gradients' total norm)",
}

# The key in jsonargparse's messages: a key under `model:` (a config file's or a checkpoint's hyperparameters), the
# old `model.loss: bce` (now a group), a command-line flag (not a group's field: --model.loss.name).
_PATTERNS = (re.compile(r"Group 'model' does not accept option '(\w+)'"),  # then subclass mode's (class_path)
             re.compile(r"Parser key \"model\":.*? class_path '[\w.]+': Option '(\w+)' is not accepted"),
             re.compile(r"Parser key \"model\":.*? class_path '[\w.]+':\s*Parser key \"(loss)\": Unable to load"),
             re.compile(r"does not accept option 'model\.(\w+)'"),
             re.compile(r'Parser key "model\.(loss)": Unable to load config'),
             re.compile(r"--model\.(\w+)(?![.\w])"))


def moved_option_message(parse_error: str) -> Optional[str]:
    """One line for a parse error about a `model.*` key of the flat ImageClassifier; None for any other error."""
    for pattern in _PATTERNS:
        for key in pattern.findall(parse_error):
            if key in MOVED:
                return (f"model.{key}: {MOVED[key]}; update the config or the command line (a checkpoint of the flat "
                        "model: start a new run from its weights, --model.finetune.weights CKPT, not --ckpt_path)")
    return None


def explain_moved_options(run: Callable[[], Any]) -> Any:
    """run(); a parse error about a key of the flat ImageClassifier comes out as a parse error saying where it went."""
    try:
        return run()
    except argparse.ArgumentError as error:
        message = moved_option_message(" ".join(str(error).split()))
        if message is None:
            raise
        raise argparse.ArgumentError(None, message) from None
