"""MixUp/CutMix on the training batch, seeded per batch (engine/docs/how-it-works.md#seeds), and the soft-target loss.

    python -m project fit --config configs/quickstart.yaml --model.loss.mixup_alpha=0.2 --model.loss.label_smoothing=0.1
"""

from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from classifier_engine import ConfigError
from classifier_engine.options import BelowOne, NonNegativeFloat, UnitInterval, check_fields
from torchvision.transforms import v2


class BatchMixer:
    """MixUp and/or CutMix (one per batch when both are on): soft targets (batch, num_classes); alphas 0: unchanged.
    The draws are on the CPU and nothing is read back from the device: no host-device sync per batch."""

    def __init__(self, num_classes: int, mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0):
        if mixup_alpha < 0 or cutmix_alpha < 0:
            raise ConfigError(f"mixup_alpha and cutmix_alpha must be >= 0 (0 disables), got {mixup_alpha}, "
                              f"{cutmix_alpha}")
        choices = []
        if mixup_alpha > 0:
            choices.append(v2.MixUp(alpha=mixup_alpha, num_classes=num_classes))
        if cutmix_alpha > 0:
            choices.append(v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes))
        # Both on: torchvision's reference picks one per batch with equal odds (v2.RandomChoice).
        self.transform = None if not choices else choices[0] if len(choices) == 1 else v2.RandomChoice(choices)

    def __call__(self, images: torch.Tensor, targets: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.transform is None:
            return images, targets
        # v2.MixUp/CutMix draw from the global CPU generator: forked, the run's own random stream stays where it was.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            return self.transform(images, targets)


def soft_target_loss(logits: torch.Tensor, targets: torch.Tensor, *,
                     loss: Literal["cross_entropy", "bce"] = "cross_entropy", label_smoothing: float = 0.0,
                     bce_target_threshold: Optional[float] = None) -> torch.Tensor:
    """The training loss on hard (N,) or soft (N, C) targets smoothed as target * (1 - s) + s / C, as torchvision's and
    (bce) timm's "ResNet strikes back" recipes do; bce: a mean over batch and classes, targets > threshold -> 1."""
    if loss == "cross_entropy":
        return F.cross_entropy(logits, targets, label_smoothing=label_smoothing)
    if loss != "bce":
        raise ConfigError(f"loss must be 'cross_entropy' or 'bce', got {loss!r}")
    num_classes = logits.shape[-1]
    # float32: BCE's targets are as small as s / C (1e-4 for ImageNet), which bf16 logits' dtype would round.
    if targets.ndim == 1:
        targets = F.one_hot(targets, num_classes)  # on a GPU with num_classes given, no host check (no sync)
    targets = targets.float()
    if label_smoothing > 0:
        targets = targets * (1.0 - label_smoothing) + label_smoothing / num_classes
    if bce_target_threshold is not None:
        targets = (targets > bce_target_threshold).float()
    return F.binary_cross_entropy_with_logits(logits.float(), targets)


@dataclass(frozen=True)
class Loss:
    """The training loss and the mixing of its targets: `model.loss`.

    Args:
        name: "cross_entropy", or "bce" (binary cross-entropy per class, the "ResNet strikes back" recipe).
        label_smoothing: label smoothing of the training loss, in [0, 1) (combined with MixUp/CutMix targets).
        bce_target_threshold: with name "bce", binarize the mixed, smoothed targets above this, in [0, 1] (RSB A1 0.2).
        mixup_alpha: MixUp's Beta(alpha, alpha) on the training batch, >= 0 (0 disables).
        cutmix_alpha: CutMix's alpha, >= 0 (0 disables); with both on, one of the two per batch.
    """

    name: Literal["cross_entropy", "bce"] = "cross_entropy"
    label_smoothing: BelowOne = 0.0
    bce_target_threshold: Optional[UnitInterval] = None
    mixup_alpha: NonNegativeFloat = 0.0
    cutmix_alpha: NonNegativeFloat = 0.0

    def __post_init__(self) -> None:
        check_fields(self, "model.loss")  # a Python caller's or a checkpoint's values; the CLI checked its own
        if self.bce_target_threshold is not None and self.name != "bce":
            raise ConfigError(f"model.loss.bce_target_threshold applies to model.loss.name=bce, got {self.name}: set "
                              "--model.loss.name=bce or drop --model.loss.bce_target_threshold")

    def mixer(self, num_classes: int) -> BatchMixer:
        return BatchMixer(num_classes, self.mixup_alpha, self.cutmix_alpha)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return soft_target_loss(logits, targets, loss=self.name, label_smoothing=self.label_smoothing,
                                bce_target_threshold=self.bce_target_threshold)
