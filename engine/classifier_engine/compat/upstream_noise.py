"""Upstream lines that tell a user nothing, kept out of a run's output: Lightning's pytree calling torch's deprecated
LeafSpec (a FutureWarning a run), its litlogger advertisement, and a resumed run's own checkpoint folder called "not
empty". Each warning is one line (`UserWarning: message`), without the source line Python adds.

    python -m classifier_engine fit --config CONFIG      # CLASSIFIER_ENGINE_DEBUG=1 keeps Python's own warning format
"""

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

LEAF_SPEC = r"`isinstance\(treespec, LeafSpec\)` is deprecated"  # Lightning #21326 (its utilities/_pytree.py)
NOT_EMPTY = r"Checkpoint directory .* exists and is not empty"  # ModelCheckpoint.setup, on every resume into a run dir


def _no_tips(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("💡 Tip:")


def one_line(message: Any, category: type, filename: str, lineno: int, line: Any = None) -> str:
    return f"{category.__name__}: {message}\n"


def quiet_upstream_noise(debugging: bool = False) -> None:
    """Once a process (the entry point, cli_main): repeated calls change nothing."""
    warnings.filterwarnings("ignore", message=LEAF_SPEC, category=FutureWarning)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_no_tips)  # (a filter it holds already is not added again)
    if not debugging:
        warnings.formatwarning = one_line


@contextmanager
def resumed_run_dir(resumed: bool) -> Iterator[None]:
    """Around a resumed fit: ModelCheckpoint's "exists and is not empty" about the run's own checkpoints goes."""
    with warnings.catch_warnings():
        if resumed:
            warnings.filterwarnings("ignore", message=NOT_EMPTY)
        yield
