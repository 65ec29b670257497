"""Workarounds for bugs and gaps in Lightning, torch and jsonargparse, each with its upstream issue and when to delete it.

Every entry has a canary test in tests/test_compat.py that runs the stock library on the same case, marked
xfail(strict=True): when an upgrade fixes the bug, the canary passes, the suite turns red, and the entry (and the code it
names) can be deleted. README "Workarounds" lists the same table.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Workaround:
    name: str
    where: str  # the code that exists because of it
    upstream: str  # issue or PR
    seen: str  # versions it was seen on
    delete_when: str
    canary: str  # the test in tests/test_compat.py


WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround(
        name="batch limits parsed float-first: `--trainer.limit_val_batches=1` means 100 %",
        where="project/compat/batch_limits.py (Trainer with int-first limit_*_batches and overfit_batches)",
        upstream="Lightning annotates the limits Union[float, int]; jsonargparse tries the types in order",
        seen="lightning 2.5-2.6.6, jsonargparse 4.30-4.53",
        delete_when="a stock LightningCLI parses `--trainer.limit_val_batches=1` as the int 1",
        canary="test_canary_stock_cli_parses_a_batch_limit_of_1_as_a_float",
    ),
)
