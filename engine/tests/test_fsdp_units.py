"""What FSDP2 and activation checkpointing do with BatchNorm: each BatchNorm its own float32 unit, or gathered with its
block (FSDPStrategy(batchnorm_units=False)); its running statistics updated once a step under checkpointing.

    python -m pytest engine/tests/test_fsdp_units.py
"""

import copy
import os
from unittest import mock

import pytest
import torch
import torchvision

from classifier_engine.entry import close_process_group
from classifier_engine.strategies.fsdp import checkpoint_activations
from conftest import CONFIGS, cli_main, tiny_args

STRATEGY = "--trainer.strategy=classifier_engine.strategies.fsdp.FSDPStrategy"


def test_activation_checkpointing_updates_batchnorm_statistics_once_a_step_with_the_same_gradients():
    # The backward recomputes each block's forward: without care its BatchNorm layers update their running statistics
    # a second time (num_batches_tracked 2 after one step, and a momentum of ~0.19 instead of 0.1).
    torch.manual_seed(0)
    plain = torchvision.models.resnet18(num_classes=3)
    checkpointed = copy.deepcopy(plain)
    checkpoint_activations([checkpointed.layer1, checkpointed.layer2, checkpointed.layer3, checkpointed.layer4])
    images = torch.randn(4, 3, 32, 32)
    for network in (plain, checkpointed):
        network(images).sum().backward()
    statistics = plain.state_dict()
    assert checkpointed.state_dict()["layer1.0.bn1.num_batches_tracked"] == 1
    for name, value in checkpointed.state_dict().items():
        assert torch.equal(value, statistics[name]), name
    for a, b in zip(plain.parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def bf16_fsdp_fit(tiny_root, tmp_path, batchnorm_units: bool) -> tuple[dict, float]:
    """Two steps under fsdp2 at bf16-mixed (one gloo rank): the dtype a block's BatchNorm ran with, the last loss."""
    args = [*tiny_args(tiny_root, tmp_path, "--trainer.max_steps=2", "--trainer.limit_val_batches=1"),
            "--config", str(CONFIGS / "fsdp.yaml"), "--trainer.precision=bf16-mixed", STRATEGY,
            f"--trainer.strategy.batchnorm_units={str(batchnorm_units).lower()}"]
    seen = {}

    def record(module, inputs, out) -> None:
        if not out.is_meta:  # not the FLOP counter's weightless copy
            seen.update(weight=module.weight.dtype, statistics=module.running_mean.dtype, output=out.dtype)

    with mock.patch.dict(os.environ):  # the 1-process gloo group's MASTER_* stay out of the tests that follow
        try:
            cli = cli_main(args, run=False)
            cli.model.network.layer1[0].bn1.register_forward_hook(record)
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
            units = {type(m).__name__ for m in cli.model.network.modules() if hasattr(m, "reshard")}
        finally:
            close_process_group()
    assert cli.trainer.global_step == 2
    return {**seen, "units": units}, float(cli.trainer.callback_metrics["train/loss"])


@pytest.mark.slow  # two fits
def test_fsdp_gathers_batchnorm_with_its_block_in_bf16_and_trains_as_its_own_units_do(tiny_root, tmp_path):
    own, own_loss = bf16_fsdp_fit(tiny_root, tmp_path / "own", batchnorm_units=True)
    grouped, grouped_loss = bf16_fsdp_fit(tiny_root, tmp_path / "grouped", batchnorm_units=False)
    assert own == {"weight": torch.float32, "statistics": torch.float32, "output": torch.bfloat16,
                   "units": {"FSDPBatchNorm2d", "FSDPSequential", "FSDPResNet"}}
    assert grouped == {"weight": torch.bfloat16, "statistics": torch.float32, "output": torch.bfloat16,
                       "units": {"FSDPSequential", "FSDPResNet"}}  # no unit of its own: one all-gather less each
    # The second step's loss, after one update with BatchNorm's weights rounded to bf16 for the forward
    assert grouped_loss == pytest.approx(own_loss, rel=2e-2)
