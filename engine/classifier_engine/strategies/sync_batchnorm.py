"""`sync_batchnorm: true` that also works on CPU (gloo), where torch's SyncBatchNorm refuses to run.

    python -m classifier_engine fit --config CONFIG --trainer.strategy=ddp --trainer.sync_batchnorm=true
"""

import torch
import torch.distributed as dist
from lightning.pytorch.plugins import TorchSyncBatchNorm
from torch import nn
from torch.distributed.nn.functional import all_reduce


class GlooSyncBatchNorm(nn.BatchNorm2d):
    """BatchNorm whose training statistics span all ranks; same parameters and buffers as nn.BatchNorm2d."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, ...), got {input.dim()}D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not (self.training and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(input)
        channels = input.shape[1]
        dims, shape = [0, *range(2, input.dim())], (1, channels, *([1] * (input.dim() - 2)))
        count = torch.tensor([input.numel() / channels], dtype=input.dtype, device=input.device)
        mean = input.mean(dims)
        m2 = (input - mean.view(shape)).pow(2).sum(dims)
        # An all-gather made of an all-reduce of one filled row per rank: differentiable, and gloo supports it.
        rows = input.new_zeros(dist.get_world_size(), 1 + 2 * channels)
        rows = rows.index_copy(0, torch.tensor([dist.get_rank()], device=input.device),
                               torch.cat([count, mean, m2])[None])
        rows = all_reduce(rows)
        counts, means, m2s = rows[:, :1], rows[:, 1 : 1 + channels], rows[:, 1 + channels :]
        total = counts.sum()
        global_mean = (counts * means).sum(0) / total
        global_m2 = (m2s + counts * (means - global_mean).pow(2)).sum(0)
        biased_var = global_m2 / total
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                self.running_mean.lerp_(global_mean.detach(), momentum)
                self.running_var.lerp_((global_m2 / (total - 1)).detach(), momentum)
        output = (input - global_mean.view(shape)) * torch.rsqrt(biased_var + self.eps).view(shape)
        if self.affine:
            output = output * self.weight.view(shape) + self.bias.view(shape)
        return output


def _replace(module: nn.Module, found: type, made: type) -> nn.Module:
    """Every `found` norm layer in module (not already a `made` one) replaced by a `made` one with its state."""
    if isinstance(module, found) and type(module) is not made:
        norm = made(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
        # The very Parameters and buffers handed over (as convert_sync_batchnorm does): an earlier optimizer still works
        if module.affine:
            norm.weight, norm.bias = module.weight, module.bias
        if module.track_running_stats:
            norm.running_mean, norm.running_var = module.running_mean, module.running_var
            norm.num_batches_tracked = module.num_batches_tracked
        return norm.train(module.training)
    for name, child in module.named_children():
        module.add_module(name, _replace(child, found, made))
    return module


class SyncBatchNormAnyBackend(TorchSyncBatchNorm):
    """Lightning's sync_batchnorm plugin, with GlooSyncBatchNorm where the process group is gloo (CPU)."""

    def apply(self, model: nn.Module) -> nn.Module:
        if dist.is_initialized() and dist.get_backend() == "gloo":
            return _replace(model, nn.modules.batchnorm._BatchNorm, GlooSyncBatchNorm)
        return super().apply(model)

    def revert(self, model: nn.Module) -> nn.Module:
        return _replace(super().revert(model), GlooSyncBatchNorm, nn.BatchNorm2d)
