"""strategy="dp": torch DataParallel for Lightning 2, which removed its own (PR #16748).

    python -m classifier_engine fit --config CONFIG --trainer.strategy=dp --trainer.devices=8 --data.root /data/imagenet

What runs where: docs/how-it-works.md#what-stays-the-same-whichever-strategy-you-pick.
"""

from contextlib import nullcontext
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from torch import nn

from classifier_engine.errors import ConfigError


class _LightningForward(nn.Module):
    """The LightningModule's own forward as a module DataParallel can replicate (bypassing the patched one)."""

    def __init__(self, lightning_module: L.LightningModule):
        super().__init__()
        self.lightning_module = lightning_module
        self.autocast: Optional[tuple[str, torch.dtype]] = None  # the caller's, given to each replica (below)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        with torch.autocast(self.autocast[0], dtype=self.autocast[1]) if self.autocast else nullcontext():
            return type(module).forward(module, *args, **kwargs)


class _DataParallel(nn.DataParallel):
    """DataParallel whose replicas autocast to the caller's dtype. torch's parallel_apply re-enters autocast in each
    replica's thread with the enabled flag only, and the dtype is thread-local: bf16-mixed ran float16 (compat)."""

    def parallel_apply(self, replicas: Any, inputs: Any, kwargs: Any) -> Any:
        device_type = self.src_device_obj.type
        state = (device_type, torch.get_autocast_dtype(device_type)) if torch.is_autocast_enabled(device_type) else None
        for replica in replicas:
            replica.autocast = state
        return super().parallel_apply(replicas, inputs, kwargs)


class DataParallelStrategy(ParallelStrategy):
    """One process driving all visible GPUs of the node with torch.nn.DataParallel around the forward pass."""

    strategy_name = "dp"

    def __init__(self, parallel_devices: Optional[list[torch.device]] = None, **kwargs: Any):
        super().__init__(parallel_devices=parallel_devices, **kwargs)
        self.num_nodes = 1  # set by the Trainer from num_nodes; checked in setup_environment

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices, "dp: parallel_devices are set by the Trainer"
        return self.parallel_devices[0]

    # One process, whatever the cluster environment says.
    global_rank = local_rank = node_rank = property(lambda self: 0)
    world_size = property(lambda self: 1)
    is_distributed = property(lambda self: False)  # so Lightning adds no DistributedSampler: one process, global batch
    distributed_sampler_kwargs = property(lambda self: {"num_replicas": 1, "rank": 0})

    @property
    def device_ids(self) -> list[int]:
        return [d.index for d in self.parallel_devices or [] if d.type == "cuda"]

    def setup_environment(self) -> None:
        if self._layer_sync is not None:
            raise ConfigError("dp does not support sync_batchnorm: torch's SyncBatchNorm needs one process per GPU. "
                              "Use --trainer.strategy=ddp, or set --trainer.sync_batchnorm=false.")
        if self.num_nodes > 1:
            raise ConfigError("dp runs on one node: use --trainer.strategy=ddp for several nodes.")
        if not self.device_ids and len(self.parallel_devices or []) > 1:
            raise ConfigError(f"dp splits each batch over GPUs: on CPU it would run one process on one device, not "
                              f"{len(self.parallel_devices)}; use --trainer.devices=1 (the same run), or "
                              "--trainer.strategy=ddp for several CPU processes")
        super().setup_environment()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup(self, trainer: L.Trainer) -> None:
        super().setup(trainer)
        module = self.lightning_module
        wrapper = _DataParallel(_LightningForward(module), device_ids=self.device_ids or None)
        # An instance attribute shadows the class's forward for `module(x)`; set outside nn.Module.__setattr__
        # so the wrapper is not registered as a submodule (state_dict keys stay free of `module.`).
        object.__setattr__(module, "forward", wrapper)

    def teardown(self) -> None:
        if self.lightning_module is not None:  # the class's forward again (setup shadowed it on the instance)
            self.lightning_module.__dict__.pop("forward", None)
        super().teardown()

    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor  # one process: already computed on the gathered outputs

    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj


if DataParallelStrategy.strategy_name not in StrategyRegistry:
    StrategyRegistry.register("dp", DataParallelStrategy, description="torch DataParallel over the forward pass")
