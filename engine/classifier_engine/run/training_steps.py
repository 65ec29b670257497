"""Which batch ends follow an optimizer step, and which write step metrics: from public Trainer attributes only."""

import lightning as L


def after_optimizer_step(trainer: L.Trainer, batch_idx: int) -> bool:
    """True on a batch end right after an optimizer step (the last, partial window of an epoch steps too)."""
    return (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or batch_idx + 1 == trainer.num_training_batches


def is_logging_step(trainer: L.Trainer, batch_idx: int) -> bool:
    """True on the batch ends where Lightning writes step metrics (every log_every_n_steps optimizer steps)."""
    if not after_optimizer_step(trainer, batch_idx):
        return False
    if trainer.fast_dev_run:
        return True
    every = trainer.log_every_n_steps  # 0: Lightning writes no step metrics at all
    return every > 0 and (trainer.global_step % every == 0 or trainer.should_stop)


def validation_follows(trainer: L.Trainer, batch_idx: int) -> bool:
    """True when Lightning validates right after this batch end (an epoch's last, or every val_check_batch)."""
    if not trainer.enable_validation:
        return False
    every = trainer.check_val_every_n_epoch
    if every is not None and (trainer.current_epoch + 1) % every != 0:
        return False
    if batch_idx + 1 == trainer.num_training_batches:
        return True
    interval = trainer.val_check_batch
    return isinstance(interval, int) and interval > 0 and (batch_idx + 1) % interval == 0
