"""Take SIGTERM over from Lightning: its flag, and its per-step broadcast of it under DDP (Lightning PR #20825).

LastCheckpoint agrees on stop signals every `check_every_n_steps` steps; a SIGTERM that set Lightning's flag first is
moved over to ours (else: exit 0, no checkpoint, Lightning #19916). Versions and canaries: docs/workarounds.md.
"""

import lightning as L


def skip_lightning_sigterm_broadcast(trainer: L.Trainer) -> None:
    """Replace the epoch loop's per-step broadcast with a no-op (an instance attribute: this Trainer only)."""
    if hasattr(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor"):
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None


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
