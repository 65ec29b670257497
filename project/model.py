"""ImageClassifier: the LightningModule holding the training logic around a plain nn.Module network.

    python -m project fit --config configs/quickstart.yaml
    python -m project fit --config configs/quickstart.yaml --config configs/recipe/finetune.yaml  # ImageNet weights

Options come in groups (network, finetune, optim, loss): `--print_config` shows them as `model.<group>.<field>`.
"""

from collections.abc import Callable
from dataclasses import asdict
from typing import Optional

import lightning as L
import torch
import torch.nn.functional as F
from classifier_engine import ConfigError, Decision, Monitor, StepSeed, batch_seed, checkpoint_activations, shard
from classifier_engine.options import PositiveInt, check_arguments
from lightning.pytorch.utilities import rank_zero_info
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from project.backbones import Network, NetworkRunner, build_network, shard_blocks
from project.callbacks.finetuning import FineTuning, FreezeBackbone
from project.mixing import Loss
from project.optim import (
    Optimization,
    ResumedOptimizerSettings,
    build_optimization,
    check_optimizer_state_fits,
    scaled_lr,
)
from project.weights import fetch_weights, load_pretrained


def _group(kind: type, value):
    """A config group as its dataclass; a dict of its fields is taken too (a checkpoint's hparams hold dicts)."""
    return value if isinstance(value, kind) else kind(**value)


def _check_network_choice(arch: Optional[str], backbone, zero_init_residual: bool) -> None:
    if arch is None and backbone is None:
        raise ConfigError("model.arch is null and there is no model.backbone: name a torchvision network "
                          "(--model.arch resnet50) or your own (--model.backbone.class_path my_module.MyNet)")
    if zero_init_residual and backbone is not None:
        raise ConfigError("model.zero_init_residual applies to the torchvision ResNets of model.arch, and "
                          "model.backbone replaces them: drop --model.zero_init_residual")


def _evaluation_metrics(num_classes: int) -> tuple[MeanMetric, MulticlassAccuracy, MulticlassAccuracy]:
    """Loss (the mean over samples), top-1 and top-5 accuracy: sums of counts, exact at any world size."""
    # MeanMetric's NaN test read two tensors on the host every batch; "disable" weighs every value 1 (drops a given
    # weight), so it gets per-sample losses. A NaN loss makes val/loss NaN (the test dropped it).
    loss = MeanMetric(nan_strategy="disable")
    loss.set_dtype(torch.float64)  # sums of many float32 losses drift with the summation order, i.e. the world size
    return (loss, MulticlassAccuracy(num_classes, top_k=1, average="micro"),
            MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro"))


def network_choice(given) -> list[Decision]:
    """A pass of the run plan: the network built (`model.backbone` replaces `model.arch`, null then in the config)."""
    model = given.config.model.get("init_args")
    if model is None or "arch" not in model:
        return []
    backbone = model.get("backbone")
    if backbone is None:
        return [Decision("network", model.arch, "model.arch")]
    path = backbone.get("class_path") if hasattr(backbone, "get") else str(backbone)
    if model.get("arch") is not None and any(word.split("=")[0] in ("--model.arch", "--model.init_args.arch")
                                             for word in given.argv or ()):  # (a flag: config files may set both)
        raise ConfigError(f"--model.arch {model.arch} and model.backbone {path}: the backbone replaces the arch; drop "
                          "--model.arch, or build it with --model.backbone=null")
    edits = (("model.init_args.arch", None),) if model.get("arch") is not None else ()
    return [Decision("network", path, "model.backbone (model.arch is not built: null in the config)", edits=edits)]


def learning_rate(given) -> list[Decision]:
    """A pass of the run plan: the LR the optimizer starts from, lr_per_256 scaled by the plan's global batch."""
    model, batch = given.config.model.get("init_args"), given.decided.value("global batch")
    if model is None or not batch or "optim" not in model:
        return []
    lr = scaled_lr(model.optim.lr_per_256, batch["global"])
    return [Decision("learning rate", lr, f"model.optim.lr_per_256 {model.optim.lr_per_256} x global batch "
                     f"{batch['global']} / 256", text=f"{lr:.6g}")]


class ImageClassifier(L.LightningModule):
    """Supervised image classification with the ImageNet recipe as defaults (SGD, warmup + cosine, LR per 256); the
    whole network is the plain nn.Module `self.network` (project.backbones.HasNetwork). The engine's contract:
    classifier_engine.ClassificationModel."""

    monitor = Monitor("val/acc1", "max")  # the best checkpoint, sweeps' default metric, the progress bar
    weights_option = "model.finetune.weights"  # what a refused checkpoint's message offers: its weights, a new head

    def __init__(self, num_classes: PositiveInt = 1000, arch: Optional[str] = "resnet50",
                 backbone: Optional[Callable[[int], Network]] = None, zero_init_residual: bool = False,
                 finetune: FineTuning = FineTuning(), optim: Optimization = Optimization(), loss: Loss = Loss(),
                 channels_last: bool = False, compile: bool = False, batch_size: Optional[PositiveInt] = None,
                 seed: int = 0, image_sizes: Optional[dict[str, PositiveInt]] = None,
                 activation_checkpointing: bool = False):
        """
        Args:
            num_classes: number of classes; linked from the data module, never set by hand.
            arch: torchvision classification network to build (resnet50, efficientnet_v2_s, convnext_tiny, vit_b_16,
                ...; an unknown name lists them all); not built (and null in the saved config) when `backbone` is given.
            backbone: your own network instead of `arch`: `class_path: my_module.MyNet`, a class called with
                num_classes, and its `init_args`.
            zero_init_residual: start each residual branch's last BN at zero (ResNets; helps large-batch training).
            finetune: starting from pretrained weights: the weights, epochs with a frozen backbone, the backbone's LR.
            optim: the optimizer and its LR schedule (LR per 256 images, warmup, decay, weight decay).
            loss: the training loss: cross-entropy or BCE, label smoothing, MixUp/CutMix.
            channels_last: run the network in NHWC memory format (faster convolutions with AMP on GPUs).
            compile: torch.compile the network (checkpoints keep the plain module's parameter names).
            batch_size: images per batch per process (dp: the whole batch); linked from data.batch_size, scales the LR.
            seed: the run seed, linked from seed_everything: each step's random stream and MixUp/CutMix draws.
            image_sizes: the side of every image the network will see, by the option that sets it; linked from the
                data module. A ViT is built for that size; an `arch` that cannot take one is refused at once.
            activation_checkpointing: recompute each block's activations in the backward pass (backbones.shard_blocks):
                less memory for ~1/3 more compute; for networks too big for the GPU (configs/fsdp.yaml).
        """
        # A Python caller's or checkpoint's values (the CLI checked its own), checked into the locals hparams record.
        checked = check_arguments(ImageClassifier.__init__, locals(), "model")
        num_classes, batch_size, image_sizes = checked["num_classes"], checked["batch_size"], checked["image_sizes"]
        _check_network_choice(arch, backbone, zero_init_residual)
        arch = arch if backbone is None else None  # what save_hyperparameters records: the network built
        super().__init__()
        self.finetune, self.optim = _group(FineTuning, finetune), _group(Optimization, optim)
        self.loss = _group(Loss, loss)
        # Plain dicts in the hparams: checkpoints load with weights_only=True and parse back through the CLI.
        finetune, optim, loss = asdict(self.finetune), asdict(self.optim), asdict(self.loss)
        self.save_hyperparameters(ignore=["backbone"], logger=False)  # the trackers get the whole config instead
        self.network = backbone(num_classes) if backbone is not None else build_network(
            arch, num_classes, zero_init_residual=zero_init_residual, weights=self.finetune.weights,
            image_sizes=image_sizes)
        self.runner = NetworkRunner(channels_last=channels_last, compile=compile)
        self.mixer = self.loss.mixer(num_classes)
        self.val_loss, self.val_acc1, self.val_acc5 = _evaluation_metrics(num_classes)
        self.test_loss, self.test_acc1, self.test_acc5 = _evaluation_metrics(num_classes)

    # -- building ------------------------------------------------------------------------------------------------
    def prepare_data(self) -> None:
        # Once per node, before any rank reads the torch hub cache (a file already there is used without network).
        # hparams.arch is null beside a backbone: its weights are a file, never a torchvision name.
        if self.finetune.weights:
            fetch_weights(self.finetune.weights, arch=self.hparams.arch)

    def setup(self, stage: str) -> None:
        if stage == "fit" and self.finetune.weights and self.trainer.ckpt_path is None:
            report = load_pretrained(self.network, self.finetune.weights, arch=self.hparams.arch,
                                     num_classes=self.hparams.num_classes)
            rank_zero_info(report.summary())

    def configure_model(self) -> None:
        if self.hparams.activation_checkpointing:
            checkpoint_activations(shard_blocks(self.network))
        if self.device_mesh is not None:  # strategy fsdp2 (a ModelParallelStrategy): FSDP2, one shard per process
            shard(self.network, shard_blocks(self.network), self.device_mesh["data_parallel"], self.trainer.precision)
        self.runner.configure(self.network)

    def configure_callbacks(self) -> list[L.Callback]:
        # What this module's training needs, present whoever builds the Trainer (the CLI, a notebook, a test).
        callbacks: list[L.Callback] = [StepSeed(self.hparams.seed), ResumedOptimizerSettings()]
        if self.finetune.freeze_backbone_epochs > 0:
            callbacks.append(FreezeBackbone(self.finetune.freeze_backbone_epochs))
        return callbacks

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # Lightning calls this before it restores the optimizer and before anything is logged for a resume.
        try:
            resuming = self.trainer.state.fn == "fit"
        except RuntimeError:  # load_from_checkpoint: no Trainer, no optimizer to restore
            return
        if resuming:
            check_optimizer_state_fits(self.trainer.ckpt_path, checkpoint, self.network, self.optim,
                                       self.finetune.backbone_lr_factor)

    # -- steps ---------------------------------------------------------------------------------------------------
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.runner(self.network, images)

    def on_train_start(self) -> None:
        global_batch = self.global_batch_size()
        # Logged the Lightning way, once per fit; not in hparams: checkpoint hparams must stay valid CLI arguments.
        self.log_dict({"train/effective_lr": scaled_lr(self.optim.lr_per_256, global_batch),
                       "train/global_batch_size": float(global_batch)}, sync_dist=True)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        # MixUp/CutMix draws depend on (seed, epoch, batch index): the same after a resume and on every rank.
        images, targets = self.mixer(images, labels, batch_seed(self.hparams.seed, self.current_epoch, batch_idx))
        loss = self.loss(self(images), targets)
        # Every step, so a callback monitoring train/loss always sees the current value (docs/benchmarks.md has the
        # cost). Not prog_bar=True: Lightning would read it on the host every step (engine/callbacks/progress_bar.py).
        self.log("train/loss", loss)
        return loss

    def _evaluate(self, batch, loss_metric: MeanMetric, acc1: MulticlassAccuracy, acc5: MulticlassAccuracy, stage: str):
        images, targets = batch
        logits = self(images)
        # Per-sample losses summed: the exact mean over samples, whatever the shard sizes per rank.
        loss_metric.update(F.cross_entropy(logits, targets, reduction="none"))
        acc1.update(logits, targets)
        acc5.update(logits, targets)
        # Metric objects sync their sums across ranks at epoch end: exact, unlike averaging per-rank means.
        self.log_dict({f"{stage}/loss": loss_metric, f"{stage}/acc1": acc1, f"{stage}/acc5": acc5})

    def validation_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, self.val_loss, self.val_acc1, self.val_acc5, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, self.test_loss, self.test_acc1, self.test_acc5, "test")

    def predict_step(self, batch, batch_idx: int) -> torch.Tensor:
        images = batch[0] if isinstance(batch, (list, tuple)) else batch
        return self(images)  # logits: the engine's prediction CSV takes the top 5 classes

    def exportable(self) -> torch.nn.Module:
        """The contract's: what export writes and the FLOP count runs on, without the training wrapper."""
        return self.network

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
        global_batch = self.global_batch_size()
        lr = scaled_lr(self.optim.lr_per_256, global_batch)  # (the run plan's "learning rate" line says it)
        return build_optimization(self.optim, self.network, self.trainer, lr=lr,
                                  backbone_lr_factor=self.finetune.backbone_lr_factor)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, map_location=None, hparams_file=None, strict=None,
                             weights_only: bool = True, **kwargs):
        """Lightning's, but weights_only=True by default: checkpoints are untrusted values, the caller names classes.
        Their `_instantiator` (builds any class_path, GHSA-qqmf-gpg7-g8gw) and `backbone` are never used."""
        kwargs = {"backbone": None, **kwargs, "_instantiator": None}
        return super().load_from_checkpoint(checkpoint_path, map_location=map_location, hparams_file=hparams_file,
                                            strict=strict, weights_only=weights_only, **kwargs)
