"""Under torchrun, each restart's process group in a namespace of its own in the agent's store (torch #135712).

    torchrun --nproc_per_node=2 --max-restarts=3 -m classifier_engine fit --config CONFIG --trainer.devices=2
"""

import os
from datetime import timedelta

import lightning as L
import torch.distributed as dist
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_warn


def init_attempt_process_group(trainer: L.Trainer, timeout: timedelta) -> bool:
    """Create the default process group in this torchrun attempt's namespace; False where nothing needs doing."""
    env, strategy = os.environ, trainer.strategy
    if (not isinstance(strategy, DDPStrategy) or not isinstance(strategy.cluster_environment, TorchElasticEnvironment)
            or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not dist.is_available() or dist.is_initialized()):
        return False
    if env.get("GROUP_WORLD_SIZE", "1") != "1":
        if int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
            rank_zero_warn("torchrun on several nodes with --max-restarts: a restart can fail to connect (torch "
                           "#135712); start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and --rdzv-backend=c10d")
        return False
    device = strategy.root_device
    backend = strategy.process_group_backend or dist.Backend.default_device_backend_map.get(device.type, "gloo")
    # The client's timeout bounds every wait on a peer's key: connecting is bounded by --ddp_timeout_minutes.
    agent_store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout)
    store = dist.PrefixStore(f"classifier_engine/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent_store)
    dist.init_process_group(backend, store=store, rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                            timeout=timeout, device_id=device if device.type != "cpu" else None)
    return True
