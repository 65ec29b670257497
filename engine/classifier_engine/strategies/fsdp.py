"""strategy="fsdp2" (or "fsdp2_sharded"): torch's FSDP2 (`fully_shard`) by Lightning's ModelParallelStrategy, CPU too.

    python -m classifier_engine fit --config CONFIG --trainer.strategy=fsdp2 --trainer.devices=2

The model shards itself in configure_model with `shard` (which blocks: the room's choice); docs/how-it-works.md#fsdp.
"""

import contextlib
import contextvars
import functools
import glob
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from classifier_engine.errors import ConfigError
from classifier_engine.run.run_dirs import SHARDS
from classifier_engine.run.sharded_checkpoints import by_position
from classifier_engine.storage.files import fsync_directory


def checkpoint_activations(blocks: Iterable[nn.Module]) -> None:
    """Recompute each block's activations in the backward pass instead of keeping them: less memory, ~1/3 more compute.
    The forward is wrapped in place (no wrapper module), so parameter names and checkpoints stay as they were; the
    recomputation leaves BatchNorm's running statistics as the forward left them (updated once a step, not twice)."""
    for block in blocks:
        if not isinstance(block.forward, functools.partial):  # configure_model may run more than once
            contexts = functools.partial(_recomputing, [m for m in block.modules() if isinstance(m, _BatchNorm)])
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False, context_fn=contexts)


def _recomputing(norms: list[_BatchNorm]) -> tuple[Any, Any]:
    """checkpoint's contexts for the forward (none) and for the recomputation (the statistics kept)."""
    return contextlib.nullcontext(), _statistics_kept(norms)


@contextlib.contextmanager
def _statistics_kept(norms: list[_BatchNorm]):
    buffers = [b for norm in norms for b in (norm.running_mean, norm.running_var, norm.num_batches_tracked)
               if b is not None]
    saved = [b.clone() for b in buffers]
    try:
        yield
    finally:  # also when checkpoint stops the recomputation early (by raising once it has what it needs)
        with torch.no_grad():
            for buffer, value in zip(buffers, saved):
                buffer.copy_(value)


def _float_affine_forward(norm: _BatchNorm, input: torch.Tensor) -> torch.Tensor:
    """_BatchNorm.forward with the weight and bias its block gathered in low precision cast to its statistics' dtype
    (F.batch_norm takes bf16 inputs with float32 weights and statistics, not bf16 weights with float32 statistics)."""
    tracking = norm.training and norm.track_running_stats
    if tracking and norm.num_batches_tracked is not None:
        norm.num_batches_tracked.add_(1)
    momentum = (norm.momentum if norm.momentum is not None else 1 / float(norm.num_batches_tracked)) if tracking else 0
    stats = not norm.training or norm.track_running_stats
    dtype = norm.running_mean.dtype if norm.running_mean is not None else torch.float32
    weight, bias = (None if p is None else p.to(dtype) for p in (norm.weight, norm.bias))
    return F.batch_norm(input, norm.running_mean if stats else None, norm.running_var if stats else None, weight, bias,
                        norm.training or norm.running_mean is None, momentum, norm.eps)


# The weights FSDP2 gathers (and the forward runs on) by the Trainer's precision; without one, mixed precision
# gathered float32 weights that autocast then cast. Gradients are reduced in float32, as ddp reduces them.
GATHERED_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
_BATCHNORM_UNITS = contextvars.ContextVar("batchnorm_units", default=True)  # FSDPStrategy's, while configure_model runs


def shard(network: nn.Module, blocks: Iterable[nn.Module], mesh: Any, precision: str = "32-true",
          batchnorm_units: Optional[bool] = None) -> None:
    """FSDP2: each block's parameters sharded over `mesh` (gathered just before the block runs, freed after), then
    the rest with the root; under mixed precision, gathered in its dtype, each BatchNorm its own float32 unit
    (`batchnorm_units`; None: the FSDPStrategy's) or in its block's, cast back to float32 for the normalization.
    Once: a sharded network is left as it is."""
    if isinstance(network, FSDPModule):
        return
    # Each rank shards its own copy: they must start equal, from rank 0's (as DDP broadcasts them), or the ranks'
    # shards would be pieces of different initialisations (each process draws its own).
    # configure_model runs before the network moves to its device, and NCCL broadcasts device tensors only: there,
    # one tensor at a time through the device (gloo: in place).
    group, device = mesh.get_group(), torch.device(mesh.device_type)
    with torch.no_grad():
        for tensor in [*network.parameters(), *network.buffers()]:
            moved = tensor.to(device)
            dist.broadcast(moved, src=dist.get_global_rank(group, 0), group=group)
            if moved is not tensor:
                tensor.copy_(moved)
    dtype = GATHERED_DTYPES.get(precision)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    own_units = _BATCHNORM_UNITS.get() if batchnorm_units is None else batchnorm_units
    # BatchNorm refuses low-precision weights beside float32 statistics: float32 units of their own, as FSDP1 made them
    # (pytorch#75478; ~160 more small all-gathers a ResNet-50 step), or cast back in their block's unit
    for module in network.modules() if dtype is not None else ():
        if isinstance(module, _BatchNorm) and own_units:
            fully_shard(module, mesh=mesh)
        elif isinstance(module, _BatchNorm):
            module.forward = functools.partial(_float_affine_forward, module)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(network, mesh=mesh, mp_policy=policy)


class FSDPStrategy(ModelParallelStrategy):
    """ModelParallelStrategy as pure data parallelism (every process one shard; no tensor parallelism), whose
    checkpoints are the project's: written atomically, read weights-only, one file or (sharded) a file and a folder."""

    strategy_name = "fsdp2"

    def __init__(self, sharded: bool = False, batchnorm_units: bool = True, **kwargs: Any) -> None:
        """
        Args:
            sharded: each process writes its own shards of a checkpoint (torch distributed checkpoint), into a folder
                beside the .ckpt file, which keeps the rest: no gather on rank 0. False: one file, as under ddp.
            batchnorm_units: under mixed precision each BatchNorm is its own float32 unit (its own all-gather); False
                gathers it with its block, in the block's dtype (`shard`; bench/gpu_all.sh measures both).
        """
        super().__init__(tensor_parallel_size=1, save_distributed_checkpoint=sharded, **kwargs)
        self.batchnorm_units = batchnorm_units

    @contextlib.contextmanager
    def model_sharded_context(self):
        token = _BATCHNORM_UNITS.set(self.batchnorm_units)  # what `shard` reads in the model's configure_model
        try:
            yield
        finally:
            _BATCHNORM_UNITS.reset(token)

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
        """The full checkpoint through the CheckpointIO (the run plan's copy, or a weights-only read; a sharded one's
        folder read in), its weights and optimizer state then scattered into the shards. (Lightning's own reads meta.pt
        with torch's default, DCP's .metadata with pickle.load.)"""
        loaded = self.checkpoint_io.load_checkpoint(Path(self.broadcast(str(checkpoint_path))))
        full = StateDictOptions(full_state_dict=True, strict=self.lightning_module.strict_loading)
        set_model_state_dict(self.model, loaded["state_dict"], options=full)
        names = {param: name for name, param in self.model.named_parameters()}
        for optimizer, state in zip(self.optimizers, loaded.get("optimizer_states", [])):
            # By position in the groups, as torch.optim loads it (FSDP's rekey goes by model order: wrong for a ddp
            # checkpoint whose groups are not in model order, decay_norm_and_bias=false)
            state = by_position(state, [names[param] for group in optimizer.param_groups for param in group["params"]])
            set_optimizer_state_dict(self.model, optimizer, state, options=full)
        return loaded

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        # Every rank writes its shards into a new folder; then rank 0 replaces the .ckpt file (atomically) with the
        # rest and the folder's name. Until that rename the previous checkpoint (file and folder) is the one read.
        path = Path(self.broadcast(str(filepath)))
        folder = path.with_name(self.broadcast(f".{path.name}.{time.time_ns()}.shards"))
        optimizers = enumerate(checkpoint.pop("optimizer_states", []))
        tensors = {"state_dict": checkpoint.pop("state_dict"), **{f"optimizer_{i}": state for i, state in optimizers}}
        # Buffers are not sharded and differ per rank: rank 0's are kept, as in a one-file checkpoint.
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(folder),  # fsyncs every file
                 planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
        if self.is_global_zero:
            fsync_directory(folder)  # the shards' names (DCP fsyncs their contents), before the file that names them
            self.checkpoint_io.save_checkpoint({**checkpoint, SHARDS: folder.name}, path)
            remove_shards(path, keep=folder.name)

    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)  # ModelCheckpoint's, of checkpoints no longer in its top k
        if self.is_global_zero:
            remove_shards(Path(filepath))

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="torch FSDP2, one-file checkpoints")
        strategy_registry.register(f"{cls.strategy_name}_sharded", cls, description="torch FSDP2, sharded checkpoints",
                                   sharded=True)


def remove_shards(path: Path, keep: str = "") -> None:
    """Delete the shard folders of checkpoint `path` but `keep`: earlier saves, and saves killed before their file."""
    for folder in path.parent.glob(f".{glob.escape(path.name)}.*.shards"):
        if folder.name != keep and folder.name[len(path.name) + 2:-len(".shards")].isdigit():
            shutil.rmtree(folder, ignore_errors=True)


if FSDPStrategy.strategy_name not in StrategyRegistry:
    FSDPStrategy.register_strategies(StrategyRegistry)

