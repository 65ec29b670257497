"""Strategies the Trainer lacks; importing this package registers them by name (strategy="dp")."""

from project.engine.strategies.dp import DataParallelStrategy

__all__ = ["DataParallelStrategy"]
