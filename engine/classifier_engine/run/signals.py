"""Stop requests only set a flag; the training loop acts on it (why: docs/reliability.md#stop-signals).

    kill -TERM <pid>      # or docker stop, scancel, Ctrl+C: checkpoint at the next agreed batch end, exit 143
"""

import signal
import time
from typing import Any, Callable, Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def as_requested(signum: int) -> int:
    """What a stop signal asks for: SIGHUP (the terminal went away) is a SIGTERM; the others are themselves."""
    return signal.SIGTERM if signum == signal.SIGHUP else signum


class StopRequests:
    """Flag-only handlers until `restore`; `received`: the first stop signal (0: none); a TERM/HUP goes to `forward`."""

    def __init__(self, signums: tuple[int, ...], forward: Optional[Callable[[int], None]] = None):
        self.received = 0
        self.received_at = 0.0  # time.monotonic() of the first stop signal: how long until its checkpoint is durable
        self._forward = forward
        self._previous = {signum: signal.signal(signum, self._handle) for signum in signums}

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt  # the second Ctrl+C: stop now, without the checkpoint
        first = not self.received
        self.received = self.received or signum
        self.received_at = self.received_at or time.monotonic()
        if first and self._forward is not None and signum in (signal.SIGTERM, signal.SIGHUP):
            self._forward(as_requested(signum))

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader worker_init_fn: a worker ignores the stop signals its process group gets; its parent stops it."""
    for signum in (*STOP_SIGNALS, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)
