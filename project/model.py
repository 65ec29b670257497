"""ImageClassifier: the LightningModule holding the training logic around a plain nn.Module network.

    python -m project fit --config configs/quickstart.yaml
"""

import math
from collections.abc import Callable
from typing import Literal, Optional

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from project.backbones import build_resnet
from project.optim import parameter_groups, scaled_lr, warmup_then_decay
from project.seeds import step_seed


class ImageClassifier(L.LightningModule):
    """Supervised image classification with the ImageNet recipe as defaults (SGD, warmup + cosine, LR per 256)."""

    def __init__(
        self,
        num_classes: int = 1000,
        arch: str = "resnet50",
        backbone: Optional[Callable[[int], nn.Module]] = None,
        zero_init_residual: bool = False,
        lr_per_256: float = 0.1,
        momentum: float = 0.9,
        nesterov: bool = False,
        weight_decay: float = 1e-4,
        decay_norm_and_bias: bool = True,
        schedule: Literal["cosine", "step"] = "cosine",
        warmup_epochs: float = 5.0,
        step_milestones: list[int] = [30, 60, 80],
        step_gamma: float = 0.1,
        label_smoothing: float = 0.0,
        channels_last: bool = False,
        compile: bool = False,
        batch_size: Optional[int] = None,
        seed: int = 0,
    ):
        """
        Args:
            num_classes: number of classes; linked from the data module, never set by hand.
            arch: torchvision ResNet-family network to build (resnet18 ... resnext101_64x4d).
            backbone: your own network instead of `arch`: a class called with num_classes (class_path/init_args).
            zero_init_residual: start each residual branch's last BN at zero (helps large-batch training).
            lr_per_256: learning rate per 256 images; the real LR is scaled by the global batch at setup.
            momentum: SGD momentum.
            nesterov: use Nesterov momentum.
            weight_decay: L2 weight decay.
            decay_norm_and_bias: apply weight decay to norm weights and biases too (False excludes them).
            schedule: "cosine" decay to 0, or "step" decay by `step_gamma` at `step_milestones` (epochs).
            warmup_epochs: linear warmup length in epochs (fractions allowed), stepped per optimizer step.
            step_milestones: epochs at which the "step" schedule multiplies the LR by `step_gamma`.
            step_gamma: the "step" schedule's factor.
            label_smoothing: label smoothing of the training loss.
            channels_last: run the network in NHWC memory format (faster convolutions with AMP on GPUs).
            compile: torch.compile the network (checkpoints keep the plain module's parameter names).
            batch_size: images per batch per process (dp: the whole batch); linked from data.batch_size, it scales
                the LR with the global batch.
            seed: the run seed, linked from seed_everything: the model's random stream at each step derives from it.
        """
        super().__init__()
        self.save_hyperparameters(ignore=["backbone"])
        self.network = backbone(num_classes) if backbone is not None else build_resnet(
            arch, num_classes, zero_init_residual=zero_init_residual
        )
        self._compiled_network: Optional[nn.Module] = None
        top5 = min(5, num_classes)
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()
        self.val_acc1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_acc5 = MulticlassAccuracy(num_classes, top_k=top5, average="micro")
        self.test_acc1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.test_acc5 = MulticlassAccuracy(num_classes, top_k=top5, average="micro")
        for mean in (self.val_loss, self.test_loss):
            # sums of many float32 losses drift with the summation order, i.e. with the world size
            mean.set_dtype(torch.float64)

    def configure_model(self) -> None:
        if self.hparams.channels_last:
            self.network.to(memory_format=torch.channels_last)
        if self.hparams.compile and self._compiled_network is None:
            # Kept out of the registered submodules so state_dict keys never gain an `_orig_mod.` prefix.
            object.__setattr__(self, "_compiled_network", torch.compile(self.network))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.hparams.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        compiled = self._compiled_network
        # Replicas made by DataParallel own a copy of `network`; only the original runs the compiled graph.
        if compiled is not None and getattr(compiled, "_orig_mod", None) is self.network:
            return compiled(images)
        return self.network(images)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        # The model's randomness (dropout, stochastic depth) at a step depends on (seed, step, rank) only, so a run
        # resumed at any batch draws what an uninterrupted one draws. Host-side only: no device sync.
        seed = step_seed(self.hparams.seed, self.trainer.global_step, self.trainer.global_rank)
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, targets = batch
        loss = F.cross_entropy(self(images), targets, label_smoothing=self.hparams.label_smoothing)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def _evaluate(self, batch, loss_metric: MeanMetric, acc1: MulticlassAccuracy, acc5: MulticlassAccuracy, stage: str):
        images, targets = batch
        logits = self(images)
        # A weighted mean of batch means is the exact mean over samples, whatever the shard sizes per rank.
        loss_metric.update(F.cross_entropy(logits, targets), weight=targets.numel())
        acc1.update(logits, targets)
        acc5.update(logits, targets)
        # Metric objects sync their sums across ranks at epoch end: exact, unlike averaging per-rank means.
        self.log(f"{stage}/loss", loss_metric, prog_bar=True)
        self.log(f"{stage}/acc1", acc1, prog_bar=True)
        self.log(f"{stage}/acc5", acc5)

    def validation_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, self.val_loss, self.val_acc1, self.val_acc5, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, self.test_loss, self.test_acc1, self.test_acc5, "test")

    def predict_step(self, batch, batch_idx: int) -> dict[str, torch.Tensor]:
        images = batch[0] if isinstance(batch, (list, tuple)) else batch
        probs = self(images).float().softmax(dim=1)
        top = probs.topk(min(5, probs.shape[1]), dim=1)
        return {"probs": top.values, "classes": top.indices}

    def global_batch_size(self) -> int:
        """Images per optimizer step over all processes: per-process batch x processes x accumulation."""
        per_process = self.hparams.batch_size
        if per_process is None:
            raise ValueError("ImageClassifier(batch_size=...) is needed to scale the LR by the global batch: pass the "
                             "data module's batch size (python -m project links it from data.batch_size)")
        # trainer.world_size counts processes: for dp (one process) the batch is already the global one.
        return per_process * self.trainer.world_size * self.trainer.accumulate_grad_batches

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, map_location=None, hparams_file=None, strict=None,
                             weights_only: bool = True, **kwargs):
        """Lightning's, but weights_only=True by default whatever torch's default is: checkpoints are untrusted."""
        return super().load_from_checkpoint(checkpoint_path, map_location=map_location, hparams_file=hparams_file,
                                            strict=strict, weights_only=weights_only, **kwargs)

    def configure_optimizers(self):
        hp = self.hparams
        global_batch = self.global_batch_size()
        lr = scaled_lr(hp.lr_per_256, global_batch)
        rank_zero_info(f"learning rate {lr:.6g} = lr_per_256 {hp.lr_per_256} x global batch {global_batch} / 256")
        for logger in self.loggers:  # not in hparams: checkpoint hparams must stay valid CLI arguments
            logger.log_metrics({"train/effective_lr": lr, "train/global_batch_size": global_batch}, step=self.global_step)
        groups = parameter_groups(self.network, hp.weight_decay, decay_norm_and_bias=hp.decay_norm_and_bias)
        optimizer = torch.optim.SGD(groups, lr=lr, momentum=hp.momentum, nesterov=hp.nesterov)

        total_steps = self.trainer.estimated_stepping_batches
        if math.isinf(total_steps):
            raise ValueError(
                "the LR schedule needs a known length, got trainer.max_epochs=-1 and trainer.max_steps=-1 (no end): "
                "set --trainer.max_epochs or --trainer.max_steps"
            )
        if math.isinf(self.trainer.num_training_batches):
            # Given max_steps alone Lightning does not size the epoch, but warmup and milestones are counted in epochs.
            self.trainer.fit_loop.setup_data()
        # Rounded up as Lightning counts: an epoch's last, partial accumulation window still steps the optimizer.
        steps_per_epoch = max(1, math.ceil(self.trainer.num_training_batches / self.trainer.accumulate_grad_batches))
        scheduler = warmup_then_decay(
            optimizer,
            total_steps=int(total_steps),
            warmup_steps=round(hp.warmup_epochs * steps_per_epoch),
            schedule=hp.schedule,
            milestones=[m * steps_per_epoch for m in hp.step_milestones],
            gamma=hp.step_gamma,
        )
        # Named for LearningRateMonitor: train/lr (train/lr/<group> when the groups' LRs differ).
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "train/lr"}}
