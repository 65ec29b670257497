"""A resumed epoch continued at this run's batch index when its batches differ from the saving run's (another world
size or per-process batch): Lightning restores the batch index it saved and offers no public way to set it.

    python -m classifier_engine fit --config CONFIG --global_batch_size 1024 --trainer.devices 4 --ckpt_path last
"""

import lightning as L


def continue_epoch_at_batch(trainer: L.Trainer, batches: int) -> None:
    """Before the resumed epoch's loop starts (on_train_start): its first `batches` batches count as done. Every
    counter moves by the same amount, so Lightning's restart logic, which compares them, sees what it saved."""
    progress = trainer.fit_loop.epoch_loop.batch_progress  # private: Lightning #19764 (see WORKAROUNDS)
    shift = batches - progress.current.ready
    for counts in (progress.current, progress.total):
        counts.ready += shift
        counts.started += shift
        counts.processed += shift
        counts.completed += shift
