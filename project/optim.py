"""The optimisation recipe: parameter groups, LR scaled by the global batch, the optimizer, warmup then decay."""

import math
from collections.abc import Sequence
from typing import Optional

import lightning as L
import torch
from torch import nn

from project.backbones import classifier_head
from project.errors import ConfigError


def scaled_lr(lr_per_256: float, global_batch_size: int) -> float:
    """Linear scaling rule (Goyal et al. 2017): the LR is given per 256 images and grows with the global batch."""
    return lr_per_256 * global_batch_size / 256


def parameter_groups(network: nn.Module, weight_decay: float, *, decay_norm_and_bias: bool, lr: Optional[float] = None,
                     backbone_lr_factor: float = 1.0) -> list[dict]:
    """Groups by weight decay (norm weights and biases apart unless decay_norm_and_bias) and, when backbone_lr_factor
    is not 1, by LR (the classifier head at `lr`, the rest at lr x factor). Every parameter is in a group, frozen ones
    too (they get no gradient, so no update): unfreezing later needs no new group. Named for LearningRateMonitor
    (train/lr/<name>) when there are several; one group is plain train/lr."""
    if backbone_lr_factor <= 0:
        raise ConfigError(f"model.backbone_lr_factor must be > 0, got {backbone_lr_factor}")
    head_name = classifier_head(network)[0] + "." if backbone_lr_factor != 1.0 else None
    groups: dict[tuple[str, str], list[nn.Parameter]] = {}
    for name, p in network.named_parameters():
        part = "head" if head_name is None or name.startswith(head_name) else "backbone"
        # 1-d parameters are exactly the norm scales/shifts and the biases
        decay = "decay" if decay_norm_and_bias or p.ndim > 1 else "no_decay"
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


def build_optimizer(name: str, groups: list[dict], *, lr: float, momentum: float, nesterov: bool,
                    betas: tuple[float, float], eps: Optional[float]) -> torch.optim.Optimizer:
    """SGD, AdamW or RMSprop over the groups (each group's own lr and weight_decay win over the defaults)."""
    extra = {} if eps is None else {"eps": eps}
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, **extra)
    if name == "rmsprop":
        # torchvision's MobileNet/EfficientNet recipes: alpha 0.9 (eps 0.0316 in their configs)
        return torch.optim.RMSprop(groups, lr=lr, alpha=0.9, momentum=momentum, **extra)
    raise ConfigError(f"model.optimizer must be 'sgd', 'adamw' or 'rmsprop', got {name!r}")


def warmup_then_decay(
    optimizer: torch.optim.Optimizer,
    *,
    total_steps: int,
    warmup_steps: int,
    schedule: str,
    milestones: Sequence[int] = (),
    gamma: float = 0.1,
) -> torch.optim.lr_scheduler.LambdaLR:
    """LR factor per optimizer step: linear warmup from 1/warmup_steps to 1, then cosine or linear to 0, or steps."""
    if schedule not in ("cosine", "step", "linear"):
        raise ConfigError(f"schedule must be 'cosine', 'linear' or 'step', got {schedule!r}")
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


def build_schedule(optimizer: torch.optim.Optimizer, trainer: L.Trainer, *, warmup_epochs: float, schedule: str,
                   milestones: Sequence[int], gamma: float) -> torch.optim.lr_scheduler.LambdaLR:
    """warmup_then_decay sized from the trainer: warmup and milestones in epochs, the run's length in steps."""
    total_steps = trainer.estimated_stepping_batches
    if math.isinf(total_steps):
        raise ConfigError(
            "the LR schedule needs a known length, got trainer.max_epochs=-1 and trainer.max_steps=-1 (no end): "
            "set --trainer.max_epochs or --trainer.max_steps"
        )
    if math.isinf(trainer.num_training_batches):
        # Given max_steps alone Lightning does not size the epoch, but warmup and milestones are counted in epochs.
        trainer.fit_loop.setup_data()
    # Rounded up as Lightning counts: an epoch's last, partial accumulation window still steps the optimizer.
    steps_per_epoch = max(1, math.ceil(trainer.num_training_batches / trainer.accumulate_grad_batches))
    return warmup_then_decay(
        optimizer,
        total_steps=int(total_steps),
        warmup_steps=round(warmup_epochs * steps_per_epoch),
        schedule=schedule,
        milestones=[m * steps_per_epoch for m in milestones],
        gamma=gamma,
    )
