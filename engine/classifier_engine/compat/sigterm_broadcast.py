"""Take SIGTERM over from Lightning: its flag (else exit 0, no checkpoint) and its per-step broadcast under DDP."""

import lightning as L


def take_over_lightning_sigterm(trainer: L.Trainer) -> bool:
    """Skip the per-step broadcast (this Trainer only); clear Lightning's SIGTERM flag and say whether it was set."""
    if hasattr(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor"):
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None
    received = trainer.received_sigterm  # (public; clearing it is not)
    trainer._signal_connector.received_sigterm = False
    return received
