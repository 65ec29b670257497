"""What activation checkpointing does with BatchNorm: its running statistics updated once a step, the gradients the
same. (Each BatchNorm its own float32 FSDP unit or gathered with its block: the template's tests/test_fsdp.py, on its
ResNet.)

    python -m pytest engine/tests/test_fsdp_units.py
"""

import copy

import torch
import torchvision

from classifier_engine.strategies.fsdp import checkpoint_activations


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
