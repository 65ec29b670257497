"""Skip Lightning's per-step SIGTERM broadcast: a blocking collective and a GPU-to-host read on every DDP step.

Lightning 2.5.2-2.6.6 (PR #20825) broadcasts a "SIGTERM received" flag from rank 0 at the start of every training
step under DDP and reads it with .item() (training_epoch_loop._broadcast_sigterm_tensor; its cost is Lightning #21487;
PR #21640, open, would make it every n steps). Our LastCheckpoint replaces Lightning's SIGTERM handler, so that flag
is never set, and agrees on stop signals itself every `check_every_n_steps` steps: the broadcast is pure cost here.
Delete when Lightning no longer broadcasts every step by default (canary: tests/test_compat.py).
"""

import lightning as L


def skip_lightning_sigterm_broadcast(trainer: L.Trainer) -> bool:
    """Replace the epoch loop's per-step broadcast with a no-op for this fit; True if there was one to replace."""
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "_broadcast_sigterm_tensor"):
        return False
    loop._broadcast_sigterm_tensor = lambda: None  # instance attribute: this Trainer only
    return True
