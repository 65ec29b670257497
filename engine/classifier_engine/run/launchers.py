"""What started this process (torchrun, srun, Lightning, a person), and whether its process count fits the Trainer.

    torchrun --nproc_per_node=2 -m classifier_engine fit ...  # error: 2 processes, the Trainer expects 1
"""

import os
import re
from typing import Any, Optional

from classifier_engine.errors import ConfigError, LauncherError


def torchelastic_restart() -> Optional[int]:
    """How often torchrun restarted this job's workers (0 on the first attempt), or None outside torchrun."""
    env = os.environ
    return int(env.get("TORCHELASTIC_RESTART_COUNT", 0)) if "TORCHELASTIC_RUN_ID" in env else None


def check_process_count(world_size: int, num_devices: int, num_nodes: int) -> None:
    """Raise if torchrun's or srun's process count differs from devices x nodes (duplicate rank-0 runs, or a hang)."""
    env = os.environ
    # An srun step, not the batch script (Slurm 22.05: SLURM_STEP_NUM_TASKS exists only in a step). Under DDP
    # Lightning's SLURMEnvironment.validate_settings catches --ntasks-per-node != devices; this, the single device.
    if "TORCHELASTIC_RUN_ID" in env and "WORLD_SIZE" in env:
        count, launcher = int(env["WORLD_SIZE"]), "torchrun"
    elif ("SLURM_STEP_NUM_TASKS" in env and "SLURM_PROCID" in env
          and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")):
        count, launcher = int(env["SLURM_STEP_NUM_TASKS"]), "srun"
    else:
        return  # started by hand or by Lightning
    if count != world_size:
        raise LauncherError(
            f"{launcher} started {count} processes but the Trainer expects {world_size} (trainer.devices={num_devices} "
            f"x trainer.num_nodes={num_nodes}). Make them agree: e.g. --trainer.devices="
            f"{max(1, count // max(1, num_nodes))} --trainer.num_nodes={num_nodes} with a distributed strategy "
            f"(--trainer.strategy=ddp), or start {world_size} process(es)."
            + (" Under an sbatch script, leave --trainer.devices/--trainer.num_nodes out: it sets them from"
               " the allocation (--ntasks-per-node, --nodes)." if launcher == "srun" else ""))


def check_devices(devices: Any, accelerator: Any) -> None:
    """trainer.devices in a form the Trainer reads: Lightning raises a TypeError (CPU) or ValueError (GPU) on others."""
    text = str(devices).replace(" ", "")
    if text == "auto" or (text.isdigit() and int(text) > 0):
        return
    if accelerator != "cpu" and re.fullmatch(r"-1|\[?\d+(,\d+)*,?\]?", text):
        return
    on_gpus = ", -1 (all) or GPU indices (--trainer.devices=[0,1])" if accelerator != "cpu" else " (on CPU)"
    raise ConfigError(f"trainer.devices={devices!r}: expected a number of processes (--trainer.devices=2), "
                      f"auto{on_gpus}")
