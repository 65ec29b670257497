"""Fine-tuning: the `model.finetune` options, and training only the classifier head for the first epochs.

    python -m project fit --config configs/quickstart.yaml --model.finetune.weights=DEFAULT \
        --model.finetune.freeze_backbone_epochs=2 --model.finetune.backbone_lr_factor=0.1
"""

from dataclasses import dataclass
from typing import Optional

import lightning as L
from classifier_engine import ConfigError
from classifier_engine.options import NonNegativeInt, PositiveFloat, check_arguments, check_fields
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from project.backbones import HasNetwork, classifier_head


@dataclass(frozen=True)
class FineTuning:
    """Starting from pretrained weights: `model.finetune`.

    Args:
        weights: a torchvision weights name of `arch` (IMAGENET1K_V1, DEFAULT, ...), or a state_dict or .ckpt file; a
            head for another class count is replaced. Not applied when resuming (--ckpt_path).
        freeze_backbone_epochs: train only the classifier head for this many epochs (>= 0), then everything.
        backbone_lr_factor: LR multiplier of everything but the classifier head, > 0 (e.g. 0.1 when fine-tuning).
    """

    weights: Optional[str] = None
    freeze_backbone_epochs: NonNegativeInt = 0
    backbone_lr_factor: PositiveFloat = 1.0

    def __post_init__(self) -> None:
        # The weights are looked up in prepare_data, not here: a checkpoint's hparams may name a file since removed.
        check_fields(self, "model.finetune")
        if self.weights is not None and not self.weights.strip():
            raise ConfigError("model.finetune.weights is empty: give a torchvision weights name (DEFAULT, "
                              "IMAGENET1K_V1, ...) or the path of a state_dict or .ckpt file, or leave it null")


class FreezeBackbone(L.Callback):
    """Freeze all of `pl_module.network` (HasNetwork) but its classifier head until epoch `unfreeze_at_epoch`; why
    not Lightning's BackboneFinetuning (it adds a parameter group, freezes before DDP): docs/fine-tuning.md."""

    def __init__(self, unfreeze_at_epoch: NonNegativeInt, train_bn: bool = True) -> None:
        """
        Args:
            unfreeze_at_epoch: first epoch (0-based) in which the whole network trains; 0 freezes nothing.
            train_bn: keep training the frozen part's BatchNorm layers (weights and running statistics), as Lightning.
        """
        checked = check_arguments(FreezeBackbone.__init__, locals(), "FreezeBackbone")
        self.unfreeze_at_epoch, self.train_bn = checked["unfreeze_at_epoch"], checked["train_bn"]
        self._frozen: list[nn.Module] = []  # what this process froze, and so what it gives back

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Every start, mid-epoch resumes too (unlike on_train_epoch_start): a resumed run freezes as the first did.
        if trainer.current_epoch >= self.unfreeze_at_epoch:
            return  # a fresh network trains whole already
        if not isinstance(pl_module, HasNetwork):
            raise ConfigError(f"FreezeBackbone needs the network in `{type(pl_module).__name__}.network` "
                              "(project.backbones.HasNetwork)")
        ddp = trainer.strategy.model
        if isinstance(ddp, DistributedDataParallel) and not ddp.find_unused_parameters:
            # DDP waits for a gradient of every parameter it was built with; frozen ones never send one.
            raise ConfigError("freezing the backbone under DDP needs unused-parameter detection: set --trainer.strategy"
                              "=ddp_find_unused_parameters_true (or DDPStrategy(find_unused_parameters=True))")
        network = pl_module.network
        head_name, head = classifier_head(network)
        head_parts = set(head.modules())
        # Only modules that train now: a part the network keeps frozen by design stays frozen after the unfreeze.
        self._frozen = [module for module in BaseFinetuning.flatten_modules(network)
                        if module not in head_parts and any(p.requires_grad for p in module.parameters(recurse=False))]
        BaseFinetuning.freeze(self._frozen, train_bn=self.train_bn)
        trainable = sum(p.numel() for p in network.parameters() if p.requires_grad)
        total = sum(p.numel() for p in network.parameters())
        batch_norms = any(isinstance(module, nn.modules.batchnorm._BatchNorm) for module in self._frozen)
        bn = " and the BatchNorm layers" if self.train_bn and batch_norms else ""
        rank_zero_info(f"backbone frozen until epoch {self.unfreeze_at_epoch}: training {head_name}{bn} "
                       f"({trainable:,} of {total:,} parameters)")

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._frozen and trainer.current_epoch >= self.unfreeze_at_epoch:
            # make_trainable also turns the running statistics of BatchNorm layers frozen with train_bn=False back on.
            BaseFinetuning.make_trainable(self._frozen)
            self._frozen = []
            rank_zero_info(f"backbone unfrozen at epoch {self.unfreeze_at_epoch}: training the whole network")
