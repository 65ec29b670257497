"""Strategies the Trainer lacks; importing this package registers them by name: "dp", "fsdp2", "fsdp2_sharded"."""

from classifier_engine.strategies.dp import DataParallelStrategy
from classifier_engine.strategies.fsdp import FSDPStrategy

__all__ = ["DataParallelStrategy", "FSDPStrategy"]
