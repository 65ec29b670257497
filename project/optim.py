"""The ImageNet optimisation recipe: SGD parameter groups, LR scaled by the global batch, warmup then decay."""

import math
from collections.abc import Sequence

import torch
from torch import nn


def scaled_lr(lr_per_256: float, global_batch_size: int) -> float:
    """Linear scaling rule (Goyal et al. 2017): the LR is given per 256 images and grows with the global batch."""
    return lr_per_256 * global_batch_size / 256


def parameter_groups(network: nn.Module, weight_decay: float, *, decay_norm_and_bias: bool) -> list[dict]:
    """One group with weight decay and, unless decay_norm_and_bias, one without it for norm weights and biases."""
    if decay_norm_and_bias:
        return [{"params": [p for p in network.parameters() if p.requires_grad], "weight_decay": weight_decay}]
    decay, no_decay = [], []
    for p in network.parameters():
        if p.requires_grad:
            # 1-d parameters are exactly the norm scales/shifts and the biases in conv nets
            (no_decay if p.ndim <= 1 else decay).append(p)
    # Named so LearningRateMonitor logs train/lr/decay and train/lr/no_decay (one group is plain train/lr).
    return [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]


def warmup_then_decay(
    optimizer: torch.optim.Optimizer,
    *,
    total_steps: int,
    warmup_steps: int,
    schedule: str,
    milestones: Sequence[int] = (),
    gamma: float = 0.1,
) -> torch.optim.lr_scheduler.LambdaLR:
    """LR factor per optimizer step: linear warmup from 1/warmup_steps to 1, then cosine to 0 or steps of gamma."""
    if schedule not in ("cosine", "step"):
        raise ValueError(f"schedule must be 'cosine' or 'step', got {schedule!r}")
    total_steps = max(1, total_steps)
    warmup_steps = min(max(0, warmup_steps), total_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "cosine":
            progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return gamma ** sum(step >= m for m in milestones)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
