"""Lightning's per-batch dispatch without its no-op work: inherited no-op hooks skipped, step signatures read once."""

import inspect

import lightning as L

# Called on every callback and on the module, no-ops too; Lightning skips a hook that is None (trainer/call.py). The
# module keeps its validation batch hooks: the evaluation loop inspects their signatures.
TRAIN_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
               "on_before_optimizer_step", "on_before_zero_grad")
BATCH_HOOKS = (*TRAIN_HOOKS, "on_validation_batch_start", "on_validation_batch_end")


class LeanBatchDispatch(L.Callback):
    """Acts at setup, when the Trainer's callbacks are final (the module's own attached)."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        callbacks = [(c, L.Callback, BATCH_HOOKS) for c in trainer.callbacks]
        for owner, base, hooks in [*callbacks, (pl_module, L.LightningModule, TRAIN_HOOKS)]:
            for hook in hooks:
                if hook not in vars(owner) and getattr(type(owner), hook) is getattr(base, hook):
                    setattr(owner, hook, None)
        for name in ("training_step", "validation_step"):  # self.log and the loops inspect them at every step
            step = getattr(type(pl_module), name)
            if inspect.isfunction(step) and step is not getattr(L.LightningModule, name):
                step.__signature__ = inspect.signature(step, follow_wrapped=False)
