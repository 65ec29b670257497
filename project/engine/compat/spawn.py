"""Does this process run the training loop, or does it only spawn the processes that do (ddp_spawn)?

Under strategy=ddp_spawn the process that built the Trainer hands the fit to spawned processes and keeps an
untouched Trainer (global_step 0) whatever they did; Lightning exposes the launcher, not a public "in this process",
so this is the one place that names its private launcher class (tests/test_compat.py checks it still exists).
"""

import lightning as L
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher


def trains_in_this_process(trainer: L.Trainer) -> bool:
    return not isinstance(trainer.strategy.launcher, _MultiProcessingLauncher)
