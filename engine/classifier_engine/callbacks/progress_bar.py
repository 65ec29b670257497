"""The progress bar, read on the host only when it refreshes (docs/how-it-works.md#performance-you-can-see).

    python -m classifier_engine fit --config CONFIG        # refreshes every trainer.log_every_n_steps steps
"""

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar

from classifier_engine.callbacks.throughput import ThroughputLogger


class StepProgressBar(TQDMProgressBar):
    """TQDMProgressBar that shows our metrics without asking Lightning to convert them every step."""

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        metrics = trainer.callback_metrics
        monitor = trainer.checkpoint_callback.monitor if trainer.checkpoint_callback else None
        for key in [*(k for k in metrics if k.endswith("loss")), *([monitor] if monitor else [])]:
            if key in metrics and metrics[key].numel() == 1:
                items[key] = round(float(metrics[key]), 4)  # the host reads it here, at a refresh only
        for callback in trainer.callbacks:
            if isinstance(callback, ThroughputLogger) and callback.windows:
                window = callback.windows[-1]
                items["img/s"] = round(window["perf/images_per_sec"])
                items["wait"] = round(window["perf/data_wait"], 2)
        return items
