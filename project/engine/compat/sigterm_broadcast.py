"""Take SIGTERM over from Lightning: its flag, and its per-step broadcast of it under DDP (Lightning PR #20825).

Our LastCheckpoint agrees on stop signals every `check_every_n_steps` steps, so the broadcast is pure cost; a SIGTERM
that set Lightning's flag before our handler replaced Lightning's is moved over to ours (else: exit 0, no checkpoint,
Lightning #19916). Issue numbers, versions and canaries: docs/workarounds.md.
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
