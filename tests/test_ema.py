"""EMA callback: averaged weights differ, validation and the best checkpoint use them, resume is exact, dp works.

    python -m pytest tests/test_ema.py -q
"""

import warnings

import classifier_engine.strategies  # noqa: F401  registers strategy="dp"
import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torchmetrics import MeanMetric

from project.callbacks.ema import EMA, torchvision_ema_decay
from project.data import ImageNetDataModule


class TinyClassifier(L.LightningModule):
    """A few convolutions with BatchNorm in `network`, a torchmetrics val loss, and a configure_model as ours has."""

    def __init__(self):
        super().__init__()
        self.network = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 3),
        )
        self.val_loss = MeanMetric()
        self.configure_model_calls = 0

    def configure_model(self) -> None:
        self.configure_model_calls += 1
        self.network.to(memory_format=torch.channels_last)

    def forward(self, images):
        return self.network(images)

    def training_step(self, batch, batch_idx):
        images, targets = batch
        return F.cross_entropy(self(images), targets)

    def validation_step(self, batch, batch_idx):
        images, targets = batch
        self.val_loss.update(F.cross_entropy(self(images), targets), weight=targets.numel())
        self.log("val/loss", self.val_loss)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)


def data(root) -> ImageNetDataModule:
    return ImageNetDataModule(root=str(root), batch_size=8, num_workers=0, pin_memory=False, train_crop_size=32,
                              train_crop_scale=(0.5, 1.0), eval_resize_size=32, eval_crop_size=32, seed=3)


def fit(root, run_dir, ema: EMA, *, model_seed=0, ckpt_path=None, callbacks=(), strategy="auto", precision="32-true",
        **trainer_kwargs):
    torch.manual_seed(model_seed)
    model = TinyClassifier()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=precision, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=run_dir,
                        enable_checkpointing=bool(callbacks), callbacks=[ema, *callbacks], **trainer_kwargs)
    trainer.fit(model, datamodule=data(root), ckpt_path=ckpt_path)
    return trainer, model


def validate(root, state_dict) -> float:
    model = TinyClassifier()
    model.load_state_dict(state_dict)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    return trainer.validate(model, datamodule=data(root), verbose=False)[0]["val/loss"]


def max_relative_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-12)).item()
               for k in a)


def test_validation_and_the_best_checkpoint_use_the_averaged_weights(tiny_root, tmp_path):
    best = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val/loss", mode="min", save_top_k=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, model = fit(tiny_root, tmp_path, EMA(decay=0.7, every_n_steps=1), callbacks=[best], max_epochs=3)
    assert not [w for w in caught if "configure_model" in str(w.message)]
    assert model.configure_model_calls == 1  # Lightning's own call only: the callback never calls it
    checkpoint = torch.load(best.best_model_path, weights_only=True)
    averaged, raw = checkpoint["state_dict"], checkpoint["current_model_state"]
    assert averaged.keys() == raw.keys()
    assert max_relative_difference(averaged, raw) > 1e-3  # EMA weights differ from the raw ones
    bn_mean = "network.1.running_mean"
    assert not torch.allclose(averaged[bn_mean], raw[bn_mean])  # BatchNorm statistics are averaged too
    # The logged (best) val/loss is what the checkpoint's state_dict gives, and not what the raw weights give.
    assert validate(tiny_root, averaged) == pytest.approx(best.best_model_score.item(), rel=1e-6)
    assert validate(tiny_root, raw) != pytest.approx(best.best_model_score.item(), rel=1e-3)
    # The averaged copy follows the network's memory format, set in configure_model after the callback's setup.
    averaged_conv = trainer.callbacks[0].average[0].weight
    assert averaged_conv.is_contiguous(memory_format=torch.channels_last)


def test_ema_is_a_copy_of_the_weights_during_the_warmup(tiny_root, tmp_path):
    every_epoch = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    fit(tiny_root, tmp_path, EMA(decay=0.7, every_n_steps=1, warmup_epochs=1), callbacks=[every_epoch], max_epochs=2,
        limit_val_batches=0)
    first = torch.load(tmp_path / "ckpt" / "epoch=0.ckpt", weights_only=True)
    second = torch.load(tmp_path / "ckpt" / "epoch=1.ckpt", weights_only=True)
    assert max_relative_difference(first["state_dict"], first["current_model_state"]) == 0
    assert max_relative_difference(second["state_dict"], second["current_model_state"]) > 1e-3


def test_stop_mid_epoch_and_resume_gives_the_uninterrupted_raw_and_averaged_weights(tiny_root, tmp_path):
    def ema():  # 5 steps per epoch; copies until step 6 (first update after the warmup), then averages every 2 steps
        return EMA(decay=0.8, every_n_steps=2, warmup_epochs=1)

    trainer, _ = fit(tiny_root, tmp_path / "whole", ema(), max_epochs=3)
    trainer.save_checkpoint(tmp_path / "whole.ckpt")  # after training: raw weights must still be current_model_state
    step_7 = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=7, save_top_k=-1)
    fit(tiny_root, tmp_path / "stopped", ema(), callbacks=[step_7], max_epochs=3, max_steps=7)
    (stopped,) = (tmp_path / "ckpt").glob("*step=7.ckpt")
    trainer, _ = fit(tiny_root, tmp_path / "resumed", ema(), model_seed=1, ckpt_path=stopped, max_epochs=3)
    assert trainer.global_step == 15
    trainer.save_checkpoint(tmp_path / "resumed.ckpt")
    whole = torch.load(tmp_path / "whole.ckpt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed.ckpt", weights_only=True)
    assert max_relative_difference(resumed["current_model_state"], whole["current_model_state"]) <= 1e-6
    assert max_relative_difference(resumed["state_dict"], whole["state_dict"]) <= 1e-6
    assert max_relative_difference(whole["state_dict"], whole["current_model_state"]) > 1e-3
    assert int(resumed["averaging_state"]["n_averaged"]) == int(whole["averaging_state"]["n_averaged"]) == 8


def test_under_dp_training_and_validation_match_a_single_device(tiny_root, tmp_path):
    runs = {}
    for strategy in ("auto", "dp"):
        best = ModelCheckpoint(dirpath=tmp_path / strategy, monitor="val/loss", mode="min", save_top_k=1)
        fit(tiny_root, tmp_path / strategy, EMA(decay=0.7, every_n_steps=1), callbacks=[best], strategy=strategy,
            max_epochs=2)
        runs[strategy] = best
    dp = torch.load(runs["dp"].best_model_path, weights_only=True)
    single = torch.load(runs["auto"].best_model_path, weights_only=True)
    assert runs["dp"].best_model_score.item() == pytest.approx(runs["auto"].best_model_score.item(), rel=1e-6)
    assert max_relative_difference(dp["state_dict"], single["state_dict"]) <= 1e-6
    assert max_relative_difference(dp["current_model_state"], single["current_model_state"]) <= 1e-6
    assert validate(tiny_root, dp["state_dict"]) == pytest.approx(runs["dp"].best_model_score.item(), rel=1e-6)


def test_torchvision_decay_adjustment():
    # torchvision's ResNet-50 V2: 8 GPUs x 128, EMA every 32 steps, 600 epochs, --model-ema-decay 0.99998
    assert torchvision_ema_decay(0.99998, 8 * 128 * 32, 600) == pytest.approx(1 - 2e-5 * 8 * 128 * 32 / 600)
    assert torchvision_ema_decay(0.99998, 8 * 128 * 32, 600) == pytest.approx(0.998908, abs=1e-6)
    assert torchvision_ema_decay(0.9, 10_000, 1) == 0.0  # alpha is capped at 1: the EMA is the weights
    with pytest.raises(ValueError, match="epochs > 0"):
        torchvision_ema_decay(0.99, 32, 0)


def test_adjusted_decay_follows_the_global_batch_interval_and_run_length(tiny_root, tmp_path):
    trainer, _ = fit(tiny_root, tmp_path, EMA(decay=0.999, every_n_steps=2, adjust_decay=True), max_epochs=3,
                     limit_val_batches=0)
    # 8 images per step (one process), an update every 2 steps, 3 epochs (distinct numbers: none can stand in
    # for another)
    assert trainer.callbacks[0].update_decay == pytest.approx(1 - 0.001 * 8 * 2 / 3)


def test_under_bf16_true_the_average_stays_float32_and_validation_does_not_round_it(tiny_root, tmp_path):
    states = {}
    for name, val_batches in (("validated", None), ("unvalidated", 0)):
        every_epoch = ModelCheckpoint(dirpath=tmp_path / name, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
        trainer, model = fit(tiny_root, tmp_path / name, EMA(decay=0.7, every_n_steps=1), callbacks=[every_epoch],
                             max_epochs=2, precision="bf16-true", limit_val_batches=val_batches)
        assert model.network[0].weight.dtype == torch.bfloat16
        trainer.save_checkpoint(tmp_path / f"{name}-end.ckpt")
        states[name] = torch.load(tmp_path / name / "epoch=1.ckpt", weights_only=True)["state_dict"]
        end = torch.load(tmp_path / f"{name}-end.ckpt", weights_only=True)["state_dict"]
        # After training the module holds the average in bf16; the checkpoint still gets it unrounded.
        assert max_relative_difference(end, states[name]) == 0
    assert states["validated"]["network.0.weight"].dtype == torch.float32
    assert max_relative_difference(states["validated"], states["unvalidated"]) == 0
