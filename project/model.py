"""ImageClassifier: the LightningModule holding the training logic around a plain nn.Module network.

    python -m project fit --config configs/quickstart.yaml
    python -m project fit --config configs/quickstart.yaml --config configs/recipe/finetune.yaml   # from ImageNet weights
"""

from collections.abc import Callable
from typing import Literal, Optional

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from project.backbones import build_network
from project.callbacks.ema import EMA
from project.callbacks.finetuning import FreezeBackbone
from project.mixing import BatchMixer, soft_target_loss
from project.optim import build_optimizer, build_schedule, parameter_groups, scaled_lr
from project.seeds import batch_seed, step_seed
from project.weights import fetch_weights, load_pretrained
from project.errors import ConfigError


class ImageClassifier(L.LightningModule):
    """Supervised image classification with the ImageNet recipe as defaults (SGD, warmup + cosine, LR per 256)."""

    def __init__(
        self,
        num_classes: int = 1000,
        arch: str = "resnet50",
        backbone: Optional[Callable[[int], nn.Module]] = None,
        weights: Optional[str] = None,
        zero_init_residual: bool = False,
        optimizer: Literal["sgd", "adamw", "rmsprop"] = "sgd",
        lr_per_256: float = 0.1,
        momentum: float = 0.9,
        nesterov: bool = False,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        eps: Optional[float] = None,
        weight_decay: float = 1e-4,
        decay_norm_and_bias: bool = True,
        backbone_lr_factor: float = 1.0,
        freeze_backbone_epochs: int = 0,
        schedule: Literal["cosine", "step", "linear"] = "cosine",
        warmup_epochs: float = 5.0,
        step_milestones: list[int] = [30, 60, 80],
        step_gamma: float = 0.1,
        label_smoothing: float = 0.0,
        loss: Literal["cross_entropy", "bce"] = "cross_entropy",
        bce_target_threshold: Optional[float] = None,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        ema_decay: Optional[float] = None,
        ema_every_n_steps: int = 32,
        ema_adjust_decay: bool = False,
        grad_clip_norm: Optional[float] = None,
        channels_last: bool = False,
        compile: bool = False,
        batch_size: Optional[int] = None,
        seed: int = 0,
    ):
        """
        Args:
            num_classes: number of classes; linked from the data module, never set by hand.
            arch: torchvision classification network to build (resnet50, efficientnet_v2_s, convnext_tiny, vit_b_16,
                ...; an unknown name lists them all).
            backbone: your own network instead of `arch`: a class called with num_classes (class_path/init_args).
            weights: start from these weights: a torchvision weights name of `arch` (IMAGENET1K_V1, IMAGENET1K_V2,
                DEFAULT), or the path of a state_dict or of one of our .ckpt files. A head for another class count
                is replaced (and said so); any other mismatch stops with the first differing key. Not applied when
                resuming (--ckpt_path): the checkpoint holds the weights then.
            zero_init_residual: start each residual branch's last BN at zero (ResNets; helps large-batch training).
            optimizer: "sgd" (momentum, nesterov), "adamw" (adamw_betas, eps) or "rmsprop" (momentum, eps; alpha 0.9).
            lr_per_256: learning rate per 256 images; the real LR is scaled by the global batch at setup.
            momentum: SGD/RMSprop momentum.
            nesterov: use Nesterov momentum (SGD).
            adamw_betas: AdamW's betas.
            eps: AdamW/RMSprop epsilon (None: torch's default).
            weight_decay: weight decay (decoupled for AdamW).
            decay_norm_and_bias: apply weight decay to norm weights and biases too (False excludes them).
            backbone_lr_factor: LR multiplier of everything but the classifier head (e.g. 0.1 when fine-tuning).
            freeze_backbone_epochs: train only the classifier head for this many epochs, then everything.
            schedule: after the warmup, "cosine" decay to 0, "linear" decay to 0 (FFCV), or "step" decay by
                `step_gamma` at `step_milestones` (epochs).
            warmup_epochs: linear warmup length in epochs (fractions allowed), stepped per optimizer step.
            step_milestones: epochs at which the "step" schedule multiplies the LR by `step_gamma`.
            step_gamma: the "step" schedule's factor.
            label_smoothing: label smoothing of the training loss (combined with MixUp/CutMix targets).
            loss: "cross_entropy", or "bce" (binary cross-entropy per class, the "ResNet strikes back" recipe).
            bce_target_threshold: with loss "bce", binarize the (mixed, smoothed) targets above this (RSB A1: 0.2).
            mixup_alpha: MixUp's Beta(alpha, alpha) on the training batch (0 disables).
            cutmix_alpha: CutMix's alpha (0 disables); with both on, one of the two per batch.
            ema_decay: keep an exponential moving average of the weights with this decay per update (None: no
                EMA); validation, test, predict, export and the best checkpoint then use the averaged weights.
            ema_every_n_steps: update the average every this many optimizer steps (torchvision: 32).
            ema_adjust_decay: derive the per-update decay from ema_decay as torchvision does (global batch,
                interval and epochs: torchvision's 0.99998 means this).
            grad_clip_norm: clip the gradients' total norm to this (None: off).
            channels_last: run the network in NHWC memory format (faster convolutions with AMP on GPUs).
            compile: torch.compile the network (checkpoints keep the plain module's parameter names).
            batch_size: images per batch per process (dp: the whole batch); linked from data.batch_size, it scales
                the LR with the global batch.
            seed: the run seed, linked from seed_everything: the model's random stream at each step and the
                MixUp/CutMix draws of each batch derive from it.
        """
        super().__init__()
        self.save_hyperparameters(ignore=["backbone"])
        self.network = backbone(num_classes) if backbone is not None else build_network(
            arch, num_classes, zero_init_residual=zero_init_residual, weights=weights
        )
        self._custom_network = backbone is not None
        self._compiled_network: Optional[nn.Module] = None
        self.mixer = BatchMixer(num_classes, mixup_alpha, cutmix_alpha)
        top5 = min(5, num_classes)
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()
        self.val_acc1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_acc5 = MulticlassAccuracy(num_classes, top_k=top5, average="micro")
        self.test_acc1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.test_acc5 = MulticlassAccuracy(num_classes, top_k=top5, average="micro")
        for mean in (self.val_loss, self.test_loss):
            # sums of many float32 losses drift with the summation order, i.e. with the world size
            mean.set_dtype(torch.float64)

    # -- building ------------------------------------------------------------------------------------------------
    def _weights_arch(self) -> Optional[str]:
        """The torchvision arch whose weights names `weights` may use; None for a custom backbone (files only)."""
        return None if self._custom_network else self.hparams.arch

    def prepare_data(self) -> None:
        # Once per node, before any rank reads the torch hub cache (a file already there is used without network).
        if self.hparams.weights:
            fetch_weights(self.hparams.weights, arch=self._weights_arch())

    def setup(self, stage: str) -> None:
        if stage == "fit" and self.hparams.weights and self.trainer.ckpt_path is None:
            report = load_pretrained(self.network, self.hparams.weights, arch=self._weights_arch(),
                                     num_classes=self.hparams.num_classes)
            rank_zero_info(report.summary())

    def configure_model(self) -> None:
        if self.hparams.channels_last:
            self.network.to(memory_format=torch.channels_last)
        if self.hparams.compile and self._compiled_network is None:
            # Kept out of the registered submodules so state_dict keys never gain an `_orig_mod.` prefix.
            object.__setattr__(self, "_compiled_network", torch.compile(self.network))

    def configure_callbacks(self) -> list[L.Callback]:
        hp = self.hparams
        callbacks: list[L.Callback] = []
        if hp.ema_decay is not None:
            callbacks.append(EMA(decay=hp.ema_decay, every_n_steps=hp.ema_every_n_steps, warmup_epochs=hp.warmup_epochs,
                                 adjust_decay=hp.ema_adjust_decay))
        if hp.freeze_backbone_epochs > 0:
            callbacks.append(FreezeBackbone(hp.freeze_backbone_epochs))
        return callbacks

    # -- steps ---------------------------------------------------------------------------------------------------
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.hparams.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        compiled = self._compiled_network
        # Replicas made by DataParallel own a copy of `network`; only the original runs the compiled graph.
        if compiled is not None and getattr(compiled, "_orig_mod", None) is self.network:
            return compiled(images)
        return self.network(images)

    def on_train_start(self) -> None:
        if self.trainer.ckpt_path is not None:
            self._apply_configured_hyperparameters()

    def _apply_configured_hyperparameters(self) -> None:
        """After a resume: this run's optimizer settings (explicit flags, a new global batch) over the checkpoint's,
        keeping its state (momentum, Adam moments) and the schedule's position. A no-op when nothing changed."""
        optimizer = self.trainer.optimizers[0]
        scheduler = self.trainer.lr_scheduler_configs[0].scheduler
        changed = []
        for index, (group, configured) in enumerate(zip(optimizer.param_groups, self._configured_groups)):
            for key, value in configured.items():
                if key != "lr" and group.get(key) != value:
                    changed.append(f"{group.get('name', index)}.{key}: {group.get(key)} -> {value}")
                    group[key] = value
        scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * factor(scheduler.last_epoch)
        if changed:
            rank_zero_info("resumed with this run's optimizer settings: " + "; ".join(changed))

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        # The model's randomness (dropout, stochastic depth) in a batch depends on (seed, epoch, batch, rank) only,
        # so a run resumed at any batch draws what an uninterrupted one draws. Host-side only: no device sync.
        seed = step_seed(self.hparams.seed, self.current_epoch, batch_idx, self.trainer.global_rank)
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        hp = self.hparams
        images, labels = batch
        # MixUp/CutMix draws depend on (seed, epoch, batch index): the same after a resume and on every rank.
        images, targets = self.mixer(images, labels, batch_seed(hp.seed, self.current_epoch, batch_idx))
        loss = soft_target_loss(self(images), targets, loss=hp.loss, label_smoothing=hp.label_smoothing,
                                bce_target_threshold=hp.bce_target_threshold)
        # Every step, so a callback monitoring train/loss always sees the current value (logging it only on the
        # steps Lightning writes would save ~0.7 ms per step on a CPU: docs/benchmarks.md, not worth that). Not
        # prog_bar=True: Lightning would read it on the host every step (project.callbacks.progress_bar).
        self.log("train/loss", loss)
        return loss

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        if self.hparams.grad_clip_norm is not None:
            gradient_clip_val, gradient_clip_algorithm = self.hparams.grad_clip_norm, "norm"
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                            gradient_clip_algorithm=gradient_clip_algorithm)

    def _evaluate(self, batch, loss_metric: MeanMetric, acc1: MulticlassAccuracy, acc5: MulticlassAccuracy, stage: str):
        images, targets = batch
        logits = self(images)
        # A weighted mean of batch means is the exact mean over samples, whatever the shard sizes per rank.
        loss_metric.update(F.cross_entropy(logits, targets), weight=targets.numel())
        acc1.update(logits, targets)
        acc5.update(logits, targets)
        # Metric objects sync their sums across ranks at epoch end: exact, unlike averaging per-rank means.
        self.log(f"{stage}/loss", loss_metric)
        self.log(f"{stage}/acc1", acc1)
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

    # -- optimisation --------------------------------------------------------------------------------------------
    def global_batch_size(self) -> int:
        """Images per optimizer step over all processes: per-process batch x processes x accumulation."""
        per_process = self.hparams.batch_size
        if per_process is None:
            raise ConfigError("ImageClassifier(batch_size=...) is needed to scale the LR by the global batch: pass the "
                             "data module's batch size (python -m project links it from data.batch_size)")
        # trainer.world_size counts processes: for dp (one process) the batch is already the global one.
        return per_process * self.trainer.world_size * self.trainer.accumulate_grad_batches

    def configure_optimizers(self):
        hp = self.hparams
        global_batch = self.global_batch_size()
        lr = scaled_lr(hp.lr_per_256, global_batch)
        rank_zero_info(f"learning rate {lr:.6g} = lr_per_256 {hp.lr_per_256} x global batch {global_batch} / 256")
        for logger in self.loggers:  # not in hparams: checkpoint hparams must stay valid CLI arguments
            logger.log_metrics({"train/effective_lr": lr, "train/global_batch_size": global_batch}, step=self.global_step)
        groups = parameter_groups(self.network, hp.weight_decay, decay_norm_and_bias=hp.decay_norm_and_bias,
                                  lr=lr, backbone_lr_factor=hp.backbone_lr_factor)
        optimizer = build_optimizer(hp.optimizer, groups, lr=lr, momentum=hp.momentum, nesterov=hp.nesterov,
                                    betas=tuple(hp.adamw_betas), eps=hp.eps)
        scheduler = build_schedule(optimizer, self.trainer, warmup_epochs=hp.warmup_epochs, schedule=hp.schedule,
                                   milestones=hp.step_milestones, gamma=hp.step_gamma)
        # What this run's settings make of each group (LR, weight decay, momentum, ...): a resume restores the
        # checkpoint's optimizer, hyperparameters included, and on_train_start puts these back over them.
        self._configured_groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        # Named for LearningRateMonitor: train/lr (train/lr/<group> when there are several groups).
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "train/lr"}}

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, map_location=None, hparams_file=None, strict=None,
                             weights_only: bool = True, **kwargs):
        """Lightning's, but weights_only=True by default whatever torch's default is: checkpoints are untrusted."""
        return super().load_from_checkpoint(checkpoint_path, map_location=map_location, hparams_file=hparams_file,
                                            strict=strict, weights_only=weights_only, **kwargs)
