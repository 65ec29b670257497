"""A rank that ddp_spawn started and that stops on a signal leaves without Python's finalization (torch #190489).

After its last collective, a gloo worker thread may release the work, and with it a tensor whose Python object it
owns, only once the rank is exiting. Taking the GIL for that during interpreter finalization ends the thread with
pthread_exit inside a noexcept destructor: std::terminate, SIGABRT, exit 1 instead of 143 (3 of 9 CI runs).
So the rank leaves with os._exit once the exit handlers registered after this module's import have run:
finalization, the only window, never starts.
"""

import atexit
import logging
import os
import sys
from typing import Optional

_code: Optional[int] = None


def leave_at_exit(code: int) -> None:
    """This process ends with `code` (the SystemExit being raised), whatever ends it later: skip finalization."""
    global _code
    _code = code


def _leave() -> None:
    if _code is None:
        return
    # The handlers registered before this one are skipped: logging's, the one that writes, runs here; torch's, PIL's,
    # matplotlib's clear caches or flags; multiprocessing's ran already (its process end); weakref.finalize's
    # (a TemporaryDirectory's removal).
    try:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    finally:  # a stream closed under it (SIGHUP's terminal) must not reopen the window
        os._exit(_code)


# Registered at import, before the trackers' and W&B's (which register at their start): exit handlers run last
# registered first, so theirs run, then this one. Lightning spawns a rank by unpickling the trainer, which imports this.
atexit.register(_leave)
