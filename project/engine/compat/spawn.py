"""Does this process run the training loop, or does it only spawn the processes that do (ddp_spawn)?

Lightning exposes the launcher, not a public "in this process": the one place that names its private launcher class.
"""

import lightning as L
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher


def trains_in_this_process(trainer: L.Trainer) -> bool:
    return not isinstance(trainer.strategy.launcher, _MultiProcessingLauncher)
