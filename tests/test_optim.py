"""The ImageNet optimisation recipe: LR per 256 scaled by the global batch, warmup then cosine/step, no-decay groups.

    python -m pytest tests/test_optim.py
"""

import math
import os
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import lightning as L
import pytest
import torch
from classifier_engine import ConfigError
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

from conftest import read_scalars, tiny_args
from project import cli_main
from project.backbones import build_network
from project.optim import (
    Optimization,
    build_optimizer,
    build_schedule,
    parameter_groups,
    scaled_lr,
    steps_fused,
    warmup_then_decay,
)


def _factors(total_steps: int, warmup_steps: int, schedule: str, **kwargs) -> list[float]:
    """The LR factor the scheduler applies at each optimizer step, read from a real SGD optimizer."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = warmup_then_decay(optimizer, total_steps=total_steps, warmup_steps=warmup_steps, schedule=schedule,
                                  **kwargs)
    factors = []
    for _ in range(total_steps):
        factors.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return factors


def test_linear_scaling_rule():
    assert scaled_lr(0.1, 256) == pytest.approx(0.1)
    assert scaled_lr(0.1, 1024) == pytest.approx(0.4)
    assert scaled_lr(0.2, 8) == pytest.approx(0.00625)


def test_warmup_rises_linearly_then_cosine_decays_to_zero():
    factors = _factors(total_steps=10, warmup_steps=4, schedule="cosine")
    assert factors[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    expected_cosine = [0.5 * (1 + math.cos(math.pi * k / 6)) for k in range(6)]
    assert factors[4:] == pytest.approx(expected_cosine)
    assert factors[4] == pytest.approx(1.0) and factors[-1] < 0.07


def test_step_schedule_multiplies_by_gamma_at_each_milestone():
    factors = _factors(total_steps=10, warmup_steps=2, schedule="step", milestones=[4, 7], gamma=0.1)
    assert factors == pytest.approx([0.5, 1, 1, 1, 0.1, 0.1, 0.1, 0.01, 0.01, 0.01])


def test_step_every_epochs_steps_the_lr_every_k_epochs_to_the_runs_end():
    # 3 batches an epoch, 7 epochs; every 2 epochs as torchvision's --lr-step-size 2 (configs/model/mobilenet_v3_large)
    trainer = SimpleNamespace(estimated_stepping_batches=21, num_training_batches=3, accumulate_grad_batches=1)
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_schedule(optimizer, trainer, Optimization(schedule="step", warmup_epochs=0, step_every_epochs=2,
                                                                step_gamma=0.5))
    factors = []
    for _ in range(21):
        factors.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert factors == pytest.approx([1.0] * 6 + [0.5] * 6 + [0.25] * 6 + [0.125] * 3)
    with pytest.raises(ConfigError, match="both say when the LR steps: keep one of them"):
        Optimization(schedule="step", step_every_epochs=2, step_milestones=[5])


def test_no_warmup_starts_at_the_full_lr():
    assert _factors(total_steps=3, warmup_steps=0, schedule="cosine")[0] == pytest.approx(1.0)


def test_unknown_schedule_is_refused():
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="schedule must be 'cosine', 'linear' or 'step', got 'exponential'"):
        warmup_then_decay(optimizer, total_steps=3, warmup_steps=0, schedule="exponential")


def test_linear_schedule_decays_to_zero_after_the_warmup():
    factors = _factors(total_steps=6, warmup_steps=2, schedule="linear")
    assert factors == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25])  # reaches 0 one step past the end


def _is_norm_or_bias(network: nn.Module, name: str) -> bool:
    module = network.get_submodule(name.rsplit(".", 1)[0])
    return name.endswith(".bias") or isinstance(module, nn.modules.batchnorm._BatchNorm)


def test_norm_and_bias_parameters_can_be_excluded_from_weight_decay():
    network = build_network("resnet18", 4)
    decay, no_decay = parameter_groups(network, 5e-5, decay_norm_and_bias=False)
    assert decay["weight_decay"] == 5e-5 and no_decay["weight_decay"] == 0.0
    ids_no_decay = {id(p) for p in no_decay["params"]}
    ids_decay = {id(p) for p in decay["params"]}
    for name, p in network.named_parameters():
        expected = _is_norm_or_bias(network, name)
        assert (id(p) in ids_no_decay) == expected, name
        assert (id(p) in ids_decay) != expected, name
    assert "fc.bias" in {n for n, p in network.named_parameters() if id(p) in ids_no_decay}


def test_by_default_every_parameter_gets_weight_decay():
    network = build_network("resnet18", 4)
    (group,) = parameter_groups(network, 1e-4, decay_norm_and_bias=True)
    assert group["weight_decay"] == 1e-4
    assert len(group["params"]) == len(list(network.parameters()))


@pytest.fixture(scope="module")
def accumulated_run(tiny_root, tmp_path_factory):
    """A fit whose global batch is 8 per device x 1 device x 2 accumulated batches = 16.

    tiny_root's 5 batches per epoch make 3 optimizer steps (the last takes a single batch): 0.67 warmup epochs are
    2 steps and the milestone at epoch 1 is step 3. The run's length is given in steps only, so Lightning has not
    sized the epoch yet when the schedule is built.
    """
    cli = cli_main(["fit", *tiny_args(
        tiny_root, tmp_path_factory.mktemp("accumulated"), "--trainer.max_epochs=-1", "--trainer.max_steps=6",
        "--trainer.accumulate_grad_batches=2", "--model.optim.lr_per_256=0.256", "--model.optim.warmup_epochs=0.67",
        "--model.optim.schedule=step", "--model.optim.step_milestones=[1]", "--model.optim.step_gamma=0.1",
        "--model.optim.decay_norm_and_bias=false", "--model.optim.weight_decay=5e-5",
    )])
    return cli, read_scalars(Path(cli.trainer.log_dir))


def test_fit_scales_lr_by_global_batch_with_accumulation_and_logs_it(accumulated_run):
    cli, scalars = accumulated_run
    assert [v for _, v in scalars["train/global_batch_size"]] == [16]
    assert [v for _, v in scalars["train/effective_lr"]] == pytest.approx([0.256 * 16 / 256])
    assert cli.trainer.global_step == 6


def test_fit_converts_warmup_and_milestone_epochs_to_optimizer_steps(accumulated_run):
    _, scalars = accumulated_run
    base = 0.256 * 16 / 256
    # Two parameter groups (decay_norm_and_bias=false): LearningRateMonitor logs one key each, the same schedule.
    for key in ("train/lr/decay", "train/lr/no_decay"):
        # (LearningRateMonitor writes at each batch start of a logged step: twice per step with accumulation 2.)
        logged = [value for _step, value in sorted(dict(scalars[key]).items())]
        assert logged == pytest.approx([base / 2, base, base, base / 10, base / 10, base / 10])


def test_fit_excludes_norm_and_bias_from_weight_decay_when_asked(accumulated_run):
    cli, _ = accumulated_run
    decay, no_decay = cli.trainer.optimizers[0].param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (5e-5, 0.0)
    assert {id(p) for p in no_decay["params"]} == {
        id(p) for n, p in cli.model.network.named_parameters() if _is_norm_or_bias(cli.model.network, n)
    }


def test_a_run_without_end_is_refused_before_training(tiny_root, tmp_path):
    with pytest.raises(ValueError, match="the run has no end.*set --trainer.max_epochs or --trainer.max_steps"):
        cli_main(["fit", *tiny_args(tiny_root, tmp_path, "--trainer.max_epochs=-1")])
    assert not list(tmp_path.rglob("*.ckpt"))


# -- resuming: the optimizer state must fit, and this run's settings go over the checkpoint's ------------------------

def _fit_tiny(tiny_root, run_dir, *, ckpt_path=None, logger=False, **model_options):
    """One optimizer step of a resnet18 on tiny_root with a plain Trainer (no CLI), saved to run_dir/step.ckpt."""
    import lightning as L

    from project import ImageClassifier, ImageNetDataModule

    model = ImageClassifier(num_classes=3, arch="resnet18", batch_size=8, **model_options)
    data = ImageNetDataModule(root=str(tiny_root), batch_size=8, num_workers=0, pin_memory=False, train_crop_size=32,
                              eval_resize_size=32, eval_crop_size=32)
    trainer = L.Trainer(accelerator="cpu", max_steps=1 if ckpt_path is None else 2, limit_val_batches=0,
                        logger=logger, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=run_dir)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    trainer.save_checkpoint(run_dir / "step.ckpt")
    return trainer


def test_a_resume_with_another_optimizer_stops_before_anything_is_logged(tiny_root, tmp_path):
    from classifier_engine.errors import CheckpointError
    from lightning.pytorch.loggers import TensorBoardLogger

    from project.optim import Optimization

    _fit_tiny(tiny_root, tmp_path / "first")
    path = tmp_path / "first" / "step.ckpt"
    logger = TensorBoardLogger(tmp_path / "logs")
    with pytest.raises(CheckpointError, match=rf"checkpoint {path} was trained with model.optim.optimizer=sgd, "
                                              rf"this run asks for adamw: its optimizer state cannot continue; resume "
                                              rf"with sgd, or start a new run from its weights with "
                                              rf"--model.finetune.weights {path}"):
        _fit_tiny(tiny_root, tmp_path / "second", ckpt_path=path, logger=logger, optim=Optimization(optimizer="adamw"))
    # Lightning opens the logger (an empty event file) before it restores a checkpoint; nothing was logged into it.
    assert not list((tmp_path / "logs").rglob("hparams.yaml"))
    assert read_scalars(tmp_path / "logs" / "lightning_logs" / "version_0") == {}


def test_a_resume_with_other_parameter_groups_names_the_setting_that_changed(tiny_root, tmp_path):
    from classifier_engine.errors import CheckpointError

    _fit_tiny(tiny_root, tmp_path / "first")
    path = tmp_path / "first" / "step.ckpt"
    # A dict of the group's fields works as the dataclass does (that is what a checkpoint's hparams hold).
    with pytest.raises(CheckpointError, match=r"has 1 parameter group\(s\) of \[62\] parameters, this run 2 of "
                                              r"\[21, 41\] \(model.optim.decay_norm_and_bias True -> False\)"):
        _fit_tiny(tiny_root, tmp_path / "second", ckpt_path=path, optim={"decay_norm_and_bias": False})
    with pytest.raises(CheckpointError, match=r"\(model.finetune.backbone_lr_factor 1.0 -> 0.5\): resume with the "
                                              r"checkpoint's settings"):
        _fit_tiny(tiny_root, tmp_path / "third", ckpt_path=path, finetune={"backbone_lr_factor": 0.5})


def test_a_resume_runs_with_this_runs_optimizer_settings_and_says_which(tiny_root, tmp_path, caplog):
    from project.optim import Optimization

    _fit_tiny(tiny_root, tmp_path / "first", optim=Optimization(weight_decay=1e-4, momentum=0.9))
    resumed = _fit_tiny(tiny_root, tmp_path / "second", ckpt_path=tmp_path / "first" / "step.ckpt",
                        optim=Optimization(weight_decay=5e-4, momentum=0.8, lr_per_256=0.4))
    assert resumed.global_step == 2
    (group,) = resumed.optimizers[0].param_groups
    assert (group["weight_decay"], group["momentum"]) == (5e-4, 0.8)
    assert group["initial_lr"] == pytest.approx(0.4 * 8 / 256)
    (line,) = [r.getMessage() for r in caplog.records if "resumed with this run's optimizer settings" in r.getMessage()]
    assert "0.weight_decay: 0.0001 -> 0.0005" in line and "0.momentum: 0.9 -> 0.8" in line


def fp16_trainer(**kwargs) -> L.Trainer:
    """16-mixed as on a GPU: the precision plugin with a GradScaler (on CPU Lightning would make it bf16-mixed)."""
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    return L.Trainer(accelerator="cpu", devices=1, plugins=[plugin], logger=False, enable_checkpointing=False, **kwargs)


@pytest.mark.parametrize("trainer, fused", [
    (lambda: fp16_trainer(), True),
    (lambda: fp16_trainer(gradient_clip_val=1.0), False),  # Lightning refuses clipping with a fused optimizer
    (lambda: L.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", logger=False), False),  # no GradScaler
    (lambda: L.Trainer(accelerator="cpu", devices=1, logger=False), False),
])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_sgd_and_adamw_step_fused_under_a_grad_scaler_without_clipping(trainer, fused, optimizer):
    # GradScaler.step reads its inf/NaN check on the host every step (.item()) unless the optimizer steps fused.
    network = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    assert steps_fused(trainer(), network) is fused
    groups = parameter_groups(network, 1e-4, decay_norm_and_bias=True)
    built = build_optimizer(Optimization(optimizer=optimizer), groups, lr=0.1, fused=fused)
    assert getattr(built, "_step_supports_amp_scaling", False) is fused  # what GradScaler and Lightning look at
    assert built.defaults["fused"] is (True if fused else None)  # else torch's default (foreach), not the slow loop


def test_fsdp2_shards_are_not_stepped_fused(tmp_path):
    # torch has no fused SGD for DTensors: "aten._fused_sgd_.default does not have a sharding strategy registered".
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    network = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    with mock.patch.dict(os.environ):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        try:
            fully_shard(network, mesh=init_device_mesh("cpu", (1,)))
            assert not steps_fused(fp16_trainer(), network)
        finally:
            dist.destroy_process_group()
