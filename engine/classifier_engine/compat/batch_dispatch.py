"""Lightning's per-batch dispatch without its no-op work on the callbacks the engine and Lightning own: inherited no-op
hooks skipped. A user's objects (their module, their callbacks) are theirs: never changed."""

import lightning as L

# Called on every callback every batch, no-ops too; Lightning skips a hook that is None (trainer/call.py).
BATCH_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
               "on_before_optimizer_step", "on_before_zero_grad", "on_validation_batch_start",
               "on_validation_batch_end")
OWN = ("classifier_engine.", "lightning.")  # the packages whose callback classes are not the user's


class LeanBatchDispatch(L.Callback):
    """Acts at setup, when the Trainer's callbacks are final (the module's own attached)."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for callback in trainer.callbacks:
            if not type(callback).__module__.startswith(OWN):
                continue
            for hook in BATCH_HOOKS:
                if hook not in vars(callback) and getattr(type(callback), hook) is getattr(L.Callback, hook):
                    setattr(callback, hook, None)
