"""FreezeBackbone trains only the classifier head until its epoch, then the whole network; resumes agree.

    python -m pytest tests/test_freeze_backbone.py
"""

import os
import subprocess
import sys
import textwrap
from unittest import mock

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import REPO
from project.callbacks.finetuning import FreezeBackbone

STEPS_PER_EPOCH = 3


class SmallClassifier(L.LightningModule):
    """A conv + BN backbone and a linear head in `self.network`, as ImageClassifier holds its network."""

    def __init__(self):
        super().__init__()
        self.network = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(8, 4),
        )

    def training_step(self, batch, batch_idx):
        images, targets = batch
        return nn.functional.cross_entropy(self.network(images), targets)

    def configure_optimizers(self):
        # Every parameter in one group from the start, weight decay and momentum on: a frozen parameter must still
        # not move, because it gets no gradient at all.
        return torch.optim.SGD(self.network.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        images = torch.randn(4 * STEPS_PER_EPOCH, 3, 8, 8, generator=generator)
        targets = torch.randint(0, 4, (4 * STEPS_PER_EPOCH,), generator=generator)
        return DataLoader(TensorDataset(images, targets), batch_size=4)


class Snapshots(L.Callback):
    """After every training step: the step's epoch, requires_grad of the conv, and copies of the tensors."""

    def __init__(self):
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        conv, bn, head = pl_module.network[0], pl_module.network[1], pl_module.network[5]
        self.steps.append({
            "epoch": trainer.current_epoch,
            "conv_trains": conv.weight.requires_grad,
            "groups": len(trainer.optimizers[0].param_groups),
            "conv": conv.weight.detach().clone(),
            "bn": bn.weight.detach().clone(),
            "bn_mean": bn.running_mean.clone(),
            "head": head.weight.detach().clone(),
        })


def fit(model, tmp_path, *callbacks, max_epochs=3, ckpt_path=None, strategy="auto"):
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=max_epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        callbacks=list(callbacks), default_root_dir=tmp_path, strategy=strategy,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def test_backbone_stays_put_until_the_unfreeze_epoch_then_trains(tmp_path):
    torch.manual_seed(0)
    model = SmallClassifier()
    initial_conv = model.network[0].weight.detach().clone()
    snapshots = Snapshots()
    fit(model, tmp_path, FreezeBackbone(unfreeze_at_epoch=2), snapshots)

    frozen = [s for s in snapshots.steps if s["epoch"] < 2]
    trained = [s for s in snapshots.steps if s["epoch"] == 2]
    assert len(frozen) == 2 * STEPS_PER_EPOCH and len(trained) == STEPS_PER_EPOCH
    assert not any(s["conv_trains"] for s in frozen) and all(s["conv_trains"] for s in trained)
    assert all(torch.equal(s["conv"], initial_conv) for s in frozen)  # despite weight decay and momentum
    assert not torch.equal(frozen[0]["head"], frozen[-1]["head"])  # the head trains meanwhile
    assert not torch.equal(frozen[0]["bn"], frozen[-1]["bn"])  # train_bn=True: BatchNorm trains too
    assert not torch.equal(trained[-1]["conv"], initial_conv)
    assert {s["groups"] for s in snapshots.steps} == {1}  # no parameter group was added


def test_train_bn_false_also_freezes_batchnorm_weights_and_statistics(tmp_path):
    torch.manual_seed(0)
    model = SmallClassifier()
    bn = model.network[1]
    initial_weight, initial_mean = bn.weight.detach().clone(), bn.running_mean.clone()
    snapshots = Snapshots()
    fit(model, tmp_path, FreezeBackbone(unfreeze_at_epoch=1, train_bn=False), snapshots)

    frozen = [s for s in snapshots.steps if s["epoch"] == 0]
    assert all(torch.equal(s["bn"], initial_weight) and torch.equal(s["bn_mean"], initial_mean) for s in frozen)
    assert not torch.equal(snapshots.steps[-1]["bn_mean"], initial_mean)  # statistics tracked again after
    assert bn.track_running_stats and bn.weight.requires_grad


def test_the_frozen_line_names_batchnorm_layers_only_where_there_are_some(tmp_path, caplog):
    # A ConvNeXt (LayerNorm only) was said to train "classifier.2 and the BatchNorm layers".
    no_bn = SmallClassifier()
    no_bn.network[1] = nn.Identity()
    for model, said in ((SmallClassifier(), "training 5 and the BatchNorm layers (52 of"),
                        (no_bn, "training 5 (36 of")):
        caplog.clear()
        with caplog.at_level("INFO"):
            fit(model, tmp_path, FreezeBackbone(unfreeze_at_epoch=1), max_epochs=1)
        assert said in caplog.text, caplog.text


def test_unfreeze_at_epoch_zero_freezes_nothing(tmp_path):
    snapshots = Snapshots()
    fit(SmallClassifier(), tmp_path, FreezeBackbone(unfreeze_at_epoch=0), snapshots, max_epochs=1)
    assert all(s["conv_trains"] for s in snapshots.steps)


@pytest.mark.parametrize("resume_step", [4, 7])  # in frozen epoch 1; in epoch 2, the first unfrozen one
def test_a_mid_epoch_resume_freezes_and_unfreezes_on_the_same_schedule(tmp_path, resume_step):
    torch.manual_seed(0)
    model = SmallClassifier()
    initial_conv = model.network[0].weight.detach().clone()
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=resume_step, save_top_k=-1, filename="{step}")
    fit(model, tmp_path, FreezeBackbone(unfreeze_at_epoch=2), saver, max_epochs=1 + resume_step // STEPS_PER_EPOCH)
    checkpoint = tmp_path / f"step={resume_step}.ckpt"
    assert checkpoint.is_file()

    snapshots = Snapshots()  # a new process would build a fresh model and callback: so do we
    fit(SmallClassifier(), tmp_path, FreezeBackbone(unfreeze_at_epoch=2), snapshots, ckpt_path=checkpoint)
    resumed_epoch = resume_step // STEPS_PER_EPOCH
    assert snapshots.steps[0]["epoch"] == resumed_epoch  # really resumed inside that epoch
    for s in snapshots.steps:
        assert s["conv_trains"] == (s["epoch"] >= 2), s["epoch"]
    if resumed_epoch < 2:
        saved = torch.load(checkpoint, weights_only=True)["state_dict"]["network.0.weight"]
        assert torch.equal(saved, initial_conv)
        assert all(torch.equal(s["conv"], saved) for s in snapshots.steps if s["epoch"] < 2)


@pytest.fixture
def one_rank_process_group():
    """A one-process DDP run in this process; its env vars and process group must not leak into later tests."""
    with mock.patch.dict(os.environ):
        yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_freezing_under_ddp_without_unused_parameter_detection_names_the_strategy_to_use(
    tmp_path, one_rank_process_group
):
    with pytest.raises(ValueError, match="--trainer.strategy=ddp_find_unused_parameters_true"):
        fit(SmallClassifier(), tmp_path, FreezeBackbone(unfreeze_at_epoch=1), max_epochs=1,
            strategy=DDPStrategy(process_group_backend="gloo"))


TWO_RANKS = """
import sys, torch, lightning as L
sys.path.insert(0, {tests!r})
from test_freeze_backbone import SmallClassifier
from project.callbacks.finetuning import FreezeBackbone
torch.manual_seed(0)
model = SmallClassifier()
initial = model.network[0].weight.detach().clone()
after_frozen_epoch = {{}}
class AfterFrozenEpoch(L.Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            after_frozen_epoch["conv"] = pl_module.network[0].weight.detach().clone()
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_find_unused_parameters_true", max_epochs=2,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    callbacks=[FreezeBackbone(unfreeze_at_epoch=1), AfterFrozenEpoch()])
trainer.fit(model)
params = {{name: p.detach() for name, p in model.network.named_parameters()}}
torch.save({{"initial": initial, "params": params, **after_frozen_epoch}}, {out!r} + f"/rank{{trainer.global_rank}}.pt")
"""


@pytest.mark.slow
def test_two_ddp_ranks_stay_identical_through_freeze_and_unfreeze(tmp_path):
    # Each rank sees different batches: equal weights at the end mean the unfrozen gradients were all-reduced.
    # (Parameters only: BatchNorm running statistics are per rank under DDP, broadcast from rank 0 at each forward.)
    script = tmp_path / "two_ranks.py"
    script.write_text(textwrap.dedent(TWO_RANKS.format(tests=str(REPO / "tests"), out=str(tmp_path))))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    for name, value in rank0["params"].items():
        assert torch.equal(value, rank1["params"][name]), name
    assert torch.equal(rank0["conv"], rank0["initial"])  # frozen in epoch 0: DDP left its gradient None
    assert not torch.equal(rank0["params"]["0.weight"], rank0["initial"])  # then it trained
