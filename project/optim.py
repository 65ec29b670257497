"""The optimisation recipe (the `model.optim` group): parameter groups, LR scaled by the global batch, warmup, decay.

    python -m project fit --config configs/quickstart.yaml --model.optim.optimizer=adamw --model.optim.lr_per_256=1e-3
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Optional

import lightning as L
import torch
from classifier_engine import CheckpointError, ConfigError
from classifier_engine.options import (
    BelowOne,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ShrinkFactor,
    check_fields,
)
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.distributed.tensor import DTensor

from project.backbones import classifier_head

STEP_MILESTONES = (30, 60, 80)  # the ResNet recipe's: x0.1 at epochs 30, 60 and 80


@dataclass(frozen=True)
class Optimization:
    """The optimizer and its LR schedule: `model.optim` (the ImageNet recipe: SGD, warmup + cosine, LR per 256).

    Args:
        optimizer: "sgd" (momentum, nesterov), "adamw" (adamw_betas, eps) or "rmsprop" (momentum, eps; alpha 0.9).
        lr_per_256: learning rate per 256 images (> 0); the real LR is scaled by the global batch at setup.
        momentum: SGD/RMSprop momentum, in [0, 1).
        nesterov: use Nesterov momentum (SGD, with a momentum).
        adamw_betas: AdamW's betas, each in [0, 1).
        eps: AdamW/RMSprop epsilon (None: torch's default; SGD has none).
        weight_decay: weight decay, >= 0 (decoupled for AdamW).
        decay_norm_and_bias: apply weight decay to norm weights and biases too (False excludes them).
        schedule: after the warmup, "cosine" or "linear" (FFCV) decay to 0, or "step": x step_gamma at step_milestones
            (or every step_every_epochs).
        warmup_epochs: linear warmup length in epochs, >= 0 (fractions allowed), stepped per optimizer step.
        step_milestones: increasing epochs at which the "step" schedule multiplies the LR by `step_gamma`.
        step_every_epochs: the "step" schedule multiplies the LR by `step_gamma` every this many epochs instead
            (torchvision's --lr-step-size); leave step_milestones at their default then.
        step_gamma: the "step" schedule's factor, in (0, 1].
    """

    optimizer: Literal["sgd", "adamw", "rmsprop"] = "sgd"
    lr_per_256: PositiveFloat = 0.1
    momentum: BelowOne = 0.9
    nesterov: bool = False
    adamw_betas: tuple[BelowOne, BelowOne] = (0.9, 0.999)
    eps: Optional[PositiveFloat] = None
    weight_decay: NonNegativeFloat = 1e-4
    decay_norm_and_bias: bool = True
    schedule: Literal["cosine", "step", "linear"] = "cosine"
    warmup_epochs: NonNegativeFloat = 5.0
    step_milestones: list[NonNegativeInt] = field(default_factory=lambda: list(STEP_MILESTONES))
    step_every_epochs: Optional[PositiveInt] = None
    step_gamma: ShrinkFactor = 0.1

    def __post_init__(self) -> None:
        check_fields(self, "model.optim")  # a Python caller's or a checkpoint's values; the CLI checked its own
        if self.nesterov and self.optimizer != "sgd":
            raise ConfigError(f"model.optim.nesterov applies to optimizer sgd, not {self.optimizer}: drop "
                              "--model.optim.nesterov")
        if self.nesterov and self.momentum == 0:  # torch.optim.SGD refuses it
            raise ConfigError("model.optim.nesterov needs a momentum, got model.optim.momentum=0: set "
                              "--model.optim.momentum (e.g. 0.9) or drop --model.optim.nesterov")
        if self.eps is not None and self.optimizer == "sgd":
            raise ConfigError(f"model.optim.eps={self.eps} applies to adamw and rmsprop, SGD has none: drop "
                              "--model.optim.eps")
        milestones = self.step_milestones
        if any(later <= earlier for earlier, later in zip(milestones, milestones[1:])):
            raise ConfigError(f"model.optim.step_milestones: expected increasing epochs, got {milestones}: sort "
                              f"them, without repeats (--model.optim.step_milestones={sorted(set(milestones))})")
        if self.step_every_epochs is not None and tuple(milestones) != STEP_MILESTONES:
            raise ConfigError(f"model.optim.step_every_epochs={self.step_every_epochs} and "
                              f"step_milestones={milestones} both say when the LR steps: keep one of them")


def scaled_lr(lr_per_256: float, global_batch_size: int) -> float:
    """Linear scaling rule (Goyal et al. 2017): the LR is given per 256 images and grows with the global batch."""
    return lr_per_256 * global_batch_size / 256


def parameter_groups(network: nn.Module, weight_decay: float, *, decay_norm_and_bias: bool, lr: Optional[float] = None,
                     backbone_lr_factor: float = 1.0) -> list[dict]:
    """Groups by weight decay (norm weights and biases apart unless decay_norm_and_bias) and by LR (the head at `lr`,
    the rest at lr x backbone_lr_factor); frozen ones too, so unfreezing needs no new group. Named when several."""
    head_name = classifier_head(network)[0] + "." if backbone_lr_factor != 1.0 else None
    groups: dict[tuple[str, str], list[nn.Parameter]] = {}
    for name, p in network.named_parameters():
        part = "head" if head_name is None or name.startswith(head_name) else "backbone"
        decay = "decay" if decay_norm_and_bias or p.ndim > 1 else "no_decay"  # 1-d: norm scales/shifts, biases
        groups.setdefault((part, decay), []).append(p)
    result = []
    for (part, decay), params in groups.items():
        group = {"params": params, "weight_decay": weight_decay if decay == "decay" else 0.0}
        if lr is not None:
            group["lr"] = lr * (backbone_lr_factor if part == "backbone" else 1.0)
        result.append(group)
    if len(result) > 1:
        for group, (part, decay) in zip(result, groups):
            group["name"] = decay if head_name is None else f"{part}_{decay}" if not decay_norm_and_bias else part
    return result


def build_optimizer(optim: Optimization, groups: list[dict], *, lr: float,
                    fused: bool = False) -> torch.optim.Optimizer:
    """SGD, AdamW or RMSprop over the groups (each group's own lr and weight_decay win over the defaults); SGD and
    AdamW in one fused kernel if `fused` (else torch's default, foreach on GPUs; RMSprop has no fused kernel)."""
    extra = {} if optim.eps is None else {"eps": optim.eps}
    fused_or_default = True if fused else None  # an explicit False would pick the per-tensor loop
    if optim.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=optim.momentum, nesterov=optim.nesterov, fused=fused_or_default)
    if optim.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(optim.adamw_betas), fused=fused_or_default, **extra)
    # rmsprop, as torchvision's MobileNet/EfficientNet recipes: alpha 0.9 (eps 0.0316 in their configs)
    return torch.optim.RMSprop(groups, lr=lr, alpha=0.9, momentum=optim.momentum, **extra)


def warmup_then_decay(optimizer: torch.optim.Optimizer, *, total_steps: int, warmup_steps: int, schedule: str,
                      milestones: Sequence[int] = (), gamma: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """LR factor per optimizer step: linear warmup from 1/warmup_steps to 1, then cosine or linear to 0, or steps."""
    if schedule not in ("cosine", "step", "linear"):
        raise ConfigError(f"schedule must be 'cosine', 'linear' or 'step', got {schedule!r} (model.optim.schedule)")
    total_steps = max(1, total_steps)
    warmup_steps = min(max(0, warmup_steps), total_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if schedule == "linear":
            return 1.0 - progress
        return gamma ** sum(step >= m for m in milestones)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def build_schedule(optimizer: torch.optim.Optimizer, trainer: L.Trainer,
                   optim: Optimization) -> torch.optim.lr_scheduler.LambdaLR:
    """warmup_then_decay sized from the trainer: warmup and milestones in epochs, the run's length in steps."""
    total_steps = trainer.estimated_stepping_batches
    if math.isinf(total_steps):
        raise ConfigError("the LR schedule needs a known length, got trainer.max_epochs=-1 and trainer.max_steps=-1 "
                          "(no end): set --trainer.max_epochs or --trainer.max_steps")
    if math.isinf(trainer.num_training_batches):
        # Given max_steps alone Lightning does not size the epoch, but warmup and milestones are counted in epochs.
        trainer.fit_loop.setup_data()
    if math.isinf(trainer.num_training_batches) and (optim.warmup_epochs or optim.schedule == "step"):
        raise ConfigError("the train loader has no length (an IterableDataset without __len__), and the LR schedule's "
                          "warmup (and a step schedule's milestones) are counted in epochs: set "
                          "--model.optim.warmup_epochs=0 and a cosine or linear schedule, or give the data set a "
                          "__len__")
    # Rounded up as Lightning counts: an epoch's last, partial accumulation window still steps the optimizer.
    batches = trainer.num_training_batches if math.isfinite(trainer.num_training_batches) else 1  # (unused then)
    steps_per_epoch = max(1, math.ceil(batches / trainer.accumulate_grad_batches))
    milestones = optim.step_milestones
    if optim.step_every_epochs is not None:  # every k epochs to the run's end
        every = optim.step_every_epochs
        milestones = range(every, math.ceil(total_steps / steps_per_epoch) + 1, every)
    return warmup_then_decay(optimizer, total_steps=int(total_steps), schedule=optim.schedule, gamma=optim.step_gamma,
                             warmup_steps=round(optim.warmup_epochs * steps_per_epoch),
                             milestones=[m * steps_per_epoch for m in milestones])


def steps_fused(trainer: L.Trainer, network: nn.Module) -> bool:
    """Whether the optimizer should step fused: under a GradScaler (16-mixed) a fused step skips on inf/NaN on the
    device, where an unfused one has GradScaler read the check on the host every step. Not with gradient clipping
    (Lightning refuses it: a fused step unscales inside), nor on FSDP2's DTensor shards (no fused SGD for them)."""
    return (getattr(trainer.precision_plugin, "scaler", None) is not None and not trainer.gradient_clip_val
            and not any(isinstance(p, DTensor) for p in network.parameters()))


def build_optimization(optim: Optimization, network: nn.Module, trainer: L.Trainer, *, lr: float,
                       backbone_lr_factor: float = 1.0) -> dict:
    """configure_optimizers' answer: the optimizer over the parameter groups at `lr`, its schedule stepped per step."""
    groups = parameter_groups(network, optim.weight_decay, decay_norm_and_bias=optim.decay_norm_and_bias, lr=lr,
                              backbone_lr_factor=backbone_lr_factor)
    optimizer = build_optimizer(optim, groups, lr=lr, fused=steps_fused(trainer, network))
    scheduler = build_schedule(optimizer, trainer, optim)
    # Named for LearningRateMonitor: train/lr (train/lr/<group> when there are several groups).
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "train/lr"}}


def check_optimizer_state_fits(path, checkpoint: dict, network: nn.Module, optim: Optimization,
                               backbone_lr_factor: float) -> None:
    """A resumed fit restores the optimizer's state: the same optimizer, same parameter groups; else one line."""
    states = checkpoint.get("optimizer_states") or []
    if not states:
        return
    hparams = checkpoint.get("hyper_parameters") or {}
    before_optim, before_finetune = hparams.get("optim") or {}, hparams.get("finetune") or {}
    before = before_optim.get("optimizer", "sgd")
    if before != optim.optimizer:
        raise CheckpointError(f"checkpoint {path} was trained with model.optim.optimizer={before}, this run asks for "
                              f"{optim.optimizer}: its optimizer state cannot continue; resume with {before}, or "
                              f"start a new run from its weights with --model.finetune.weights {path}")
    groups = parameter_groups(network, optim.weight_decay, decay_norm_and_bias=optim.decay_norm_and_bias,
                              backbone_lr_factor=backbone_lr_factor)
    expected = [len(g["params"]) for g in groups]
    saved = [len(g["params"]) for g in states[0].get("param_groups", [])]
    if saved != expected:
        now = {"optim.decay_norm_and_bias": optim.decay_norm_and_bias,
               "finetune.backbone_lr_factor": backbone_lr_factor}
        then = {"optim.decay_norm_and_bias": before_optim.get("decay_norm_and_bias"),
                "finetune.backbone_lr_factor": before_finetune.get("backbone_lr_factor")}
        what = ", ".join(f"model.{k} {then[k]} -> {now[k]}" for k in now if then[k] is not None and then[k] != now[k])
        raise CheckpointError(f"checkpoint {path} has {len(saved)} parameter group(s) of {saved} parameters, this run "
                              f"{len(expected)} of {expected} ({what or 'the parameter groups'}): resume with the "
                              f"checkpoint's settings, or start a new run from its weights with "
                              f"--model.finetune.weights {path}")


class ResumedOptimizerSettings(L.Callback):
    """After a resume: this run's optimizer settings (explicit flags, a new global batch) over the checkpoint's,
    keeping its state and the schedule's position (Lightning restores between on_fit_start and on_train_start)."""

    def __init__(self) -> None:
        self._configured: list[dict] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._configured = [{k: v for k, v in group.items() if k != "params"}
                            for group in trainer.optimizers[0].param_groups] if trainer.ckpt_path else []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._configured:
            return
        optimizer = trainer.optimizers[0]
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        changed = []
        for index, (group, configured) in enumerate(zip(optimizer.param_groups, self._configured)):
            for key, value in configured.items():
                if key != "lr" and group.get(key) != value:
                    changed.append(f"{group.get('name', index)}.{key}: {group.get(key)} -> {value}")
                    group[key] = value
        scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * factor(scheduler.last_epoch)
        if changed:
            rank_zero_info("resumed with this run's optimizer settings: " + "; ".join(changed))
        self._configured = []
