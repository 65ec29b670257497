"""strategy="fsdp2": torch's FSDP2 (`fully_shard`) through Lightning's ModelParallelStrategy, on CPU (gloo) too.

    python -m project fit --config configs/quickstart.yaml --config configs/fsdp.yaml --trainer.devices=2

The model shards itself in configure_model with `shard` (which blocks: the room's choice); docs/how-it-works.md#fsdp.
"""

import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, OptimStateKeyType, fully_shard
from torch.utils.checkpoint import checkpoint

from project.engine.errors import ConfigError


def checkpoint_activations(blocks: Iterable[nn.Module]) -> None:
    """Recompute each block's activations in the backward pass instead of keeping them: less memory, ~1/3 more compute.
    The forward is wrapped in place (no wrapper module), so parameter names and checkpoints stay as they were."""
    for block in blocks:
        if not isinstance(block.forward, functools.partial):  # configure_model may run more than once
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def shard(network: nn.Module, blocks: Iterable[nn.Module], mesh: Any) -> None:
    """FSDP2: each block's parameters sharded over `mesh` (gathered just before the block runs, freed after), then
    the rest with the root. Once: a network already sharded is left as it is."""
    if isinstance(network, FSDPModule):
        return
    # Each rank shards its own copy: they must start equal, from rank 0's (as DDP broadcasts them), or the ranks'
    # shards would be pieces of different initialisations (each process draws its own).
    group = mesh.get_group()
    with torch.no_grad():
        for tensor in [*network.parameters(), *network.buffers()]:
            dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(network, mesh=mesh)


class FSDPStrategy(ModelParallelStrategy):
    """ModelParallelStrategy as pure data parallelism (every process one shard; no tensor parallelism), whose
    checkpoints are the project's: one file, gathered on rank 0, written atomically, read with weights_only=True."""

    strategy_name = "fsdp2"

    def __init__(self, **kwargs: Any) -> None:
        # Sharded (torch distributed checkpoint) folders are not offered: see docs/how-it-works.md#fsdp.
        super().__init__(tensor_parallel_size=1, save_distributed_checkpoint=False, **kwargs)

    def setup_environment(self) -> None:
        if self._layer_sync is not None:  # ModelParallelStrategy never applies it: BatchNorm would stay per rank
            raise ConfigError("sync_batchnorm is not applied under strategy fsdp2 (its BatchNorm layers would keep "
                              "per-process statistics): set --trainer.sync_batchnorm=false, or use strategy ddp")
        # Lightning's "auto" is one data-parallel group per node; here every process is one (tensor_parallel_size=1).
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    # Exact evaluation gives ranks shards of unequal batch counts: a forward that all-gathers would wait forever for a
    # rank with no batch left. Evaluation runs on weights gathered once, at its start, on every rank; sharded after.
    # Buffers are not sharded: each rank's BatchNorm statistics are its own data's. Every rank evaluates rank 0's, the
    # ones a checkpoint keeps (DDP broadcasts them before each forward for the same reason).
    def on_validation_start(self) -> None:
        self._gather(True)
        with torch.no_grad():
            for buffer in self.model.buffers():
                dist.broadcast(buffer, src=0)

    def on_validation_end(self) -> None:
        self._gather(False)

    on_test_start = on_predict_start = on_validation_start
    on_test_end = on_predict_end = on_validation_end

    def _gather(self, gathered: bool) -> None:
        sharded = [module for module in self.model.modules() if isinstance(module, FSDPModule)]
        for index, module in enumerate(sharded):
            # FSDP2's own defaults when not evaluating: the root (the first) keeps its weights after the forward
            module.set_reshard_after_forward(not gathered and index > 0, recurse=False)
            module.unshard() if gathered else module.reshard()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """The full checkpoint through the CheckpointIO (the run plan's copy, or a weights_only read), its weights and
        optimizer state then scattered into the shards. Lightning's own reads it again with torch's default."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if path.is_dir():
            raise ConfigError(f"{path} is a folder (a sharded torch distributed checkpoint): strategy fsdp2 resumes "
                              "from the one-file checkpoints it writes (last.ckpt)")
        loaded = self.checkpoint_io.load_checkpoint(path)
        full = StateDictOptions(full_state_dict=True, strict=self.lightning_module.strict_loading)
        set_model_state_dict(self.model, loaded["state_dict"], options=full)
        for optimizer, state in zip(self.optimizers, loaded.get("optimizer_states", [])):
            state = FullyShardedDataParallel.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_NAME, self.model)
            set_optimizer_state_dict(self.model, optimizer, state, options=full)
        return loaded

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="torch FSDP2, one-file checkpoints")


if FSDPStrategy.strategy_name not in StrategyRegistry:
    FSDPStrategy.register_strategies(StrategyRegistry)

