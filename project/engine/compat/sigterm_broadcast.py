"""Take SIGTERM over from Lightning: its flag, and its per-step broadcast of it (a blocking collective and a
GPU-to-host read on every DDP step).

Lightning 2.5.2-2.6.6 (PR #20825) broadcasts a "SIGTERM received" flag from rank 0 at the start of every training
step under DDP and reads it with .item() (training_epoch_loop._broadcast_sigterm_tensor; its cost is Lightning #21487;
PR #21640, open, would make it every n steps). Our LastCheckpoint replaces Lightning's SIGTERM handler, so that flag
is never set, and agrees on stop signals itself every `check_every_n_steps` steps: the broadcast is pure cost here.
A SIGTERM that arrived before our handler replaced Lightning's (the moment between Lightning installing its own and
the sanity check) set Lightning's flag, which would make it stop at the next batch end with exit code 0 and no
checkpoint (Lightning #19916): the flag is moved over to ours. Delete when Lightning no longer broadcasts every step
by default and exits non-zero on SIGTERM (canaries: tests/test_compat.py).
"""

import lightning as L


def skip_lightning_sigterm_broadcast(trainer: L.Trainer) -> bool:
    """Replace the epoch loop's per-step broadcast with a no-op for this fit; True if there was one to replace."""
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "_broadcast_sigterm_tensor"):
        return False
    loop._broadcast_sigterm_tensor = lambda: None  # instance attribute: this Trainer only
    return True


def restore_lightning_sigterm_broadcast(trainer: L.Trainer) -> None:
    """Undo skip_lightning_sigterm_broadcast (bench/overhead.py --lightning-sigterm-broadcast measures its cost)."""
    vars(trainer.fit_loop.epoch_loop).pop("_broadcast_sigterm_tensor", None)


def take_over_lightning_sigterm(trainer: L.Trainer) -> bool:
    """Skip the per-step broadcast; clear Lightning's SIGTERM flag and say whether it was set."""
    skip_lightning_sigterm_broadcast(trainer)
    connector = trainer._signal_connector
    received = bool(getattr(connector, "received_sigterm", False))
    connector.received_sigterm = False
    return received
