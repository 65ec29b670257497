"""The best checkpoint's metric checked against what the model logs, at a fit's first validation (the sanity check's
when it runs): a metric it never logs is one line there, not Lightning's error after a whole epoch without last.ckpt.

    python -m classifier_engine fit --config CONFIG --checkpoint.monitor METRIC
"""

import lightning as L
from lightning.pytorch.callbacks import Callback

from classifier_engine.errors import ConfigError
from classifier_engine.run.last_checkpoint import LastCheckpoint


class MonitorLogged(Callback):
    """Runs before ModelCheckpoint, which Lightning calls last; saves last.ckpt first when steps were trained."""

    def __init__(self, metric: str):
        self.metric, self.checked = metric, False

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A training metric (train/loss) is first logged after the sanity check: checked at the next validation.
        if self.checked or trainer.state.fn != "fit" or (trainer.sanity_checking and self.metric.startswith("train")):
            return
        self.checked = True
        if self.metric in trainer.callback_metrics:
            return
        logged = ", ".join(sorted(key for key in trainer.callback_metrics if key not in ("epoch", "step"))) or "none"
        error = ConfigError(f"the best checkpoint's metric {self.metric!r} is not one the model logs at validation "
                            f"(it logs {logged}): log it, or name one of those in the model's Monitor or "
                            "--checkpoint.monitor")
        for last in (c for c in trainer.callbacks if isinstance(c, LastCheckpoint)):
            last.keep_the_step(trainer, error, again=True)
        raise error
