"""Strategies the Trainer lacks; importing this package registers them by name (strategy="dp", strategy="fsdp2")."""

from project.engine.strategies.dp import DataParallelStrategy
from project.engine.strategies.fsdp import FSDPStrategy

__all__ = ["DataParallelStrategy", "FSDPStrategy"]
