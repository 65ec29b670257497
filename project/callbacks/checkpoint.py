"""ModelCheckpoint whose last.ckpt is always the newest state, so `--ckpt_path last` never repeats epochs.

Lightning 2.6 rewrites last.ckpt only when a top-k checkpoint was written at the same step: after an epoch that
does not improve the monitored metric, last.ckpt silently stays an epoch (or more) behind.
"""

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint


class LatestModelCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint (best by a metric, plus last.ckpt) with last.ckpt written at every save point."""

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._ensure_last_is_current(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._ensure_last_is_current(trainer)

    def _ensure_last_is_current(self, trainer: L.Trainer) -> None:
        every = self._every_n_epochs
        due = every >= 1 and (trainer.current_epoch + 1) % every == 0
        # "skip" is true once anything was saved at this global step, i.e. when the parent already wrote last.ckpt
        if self.save_last and due and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
