"""The last line of a fit: where the run went (its run dir, its best and last checkpoints), how to look at it, and
whether its input kept up (callbacks/data_bound.py).

    python -m classifier_engine fit --config CONFIG      # run dir ...; best checkpoint ...; last ...; look at it ...
"""

import os
from pathlib import Path
from typing import Any, Optional

import lightning as L

from classifier_engine.callbacks.data_bound import worker_cost
from classifier_engine.callbacks.throughput import ThroughputLogger
from classifier_engine.run.last_checkpoint import LastCheckpoint
from classifier_engine.run.trackers import how_to_look


def where_the_run_went(trainer: L.Trainer, run_dir: Optional[Path] = None) -> str:
    """The run dir (the plan's; else Lightning's), its checkpoints and how to look at it."""
    last = next((c.path for c in trainer.callbacks if isinstance(c, LastCheckpoint) and c.path), None)
    checkpoint, run_dir = trainer.checkpoint_callback, Path(run_dir or trainer.log_dir or trainer.default_root_dir)
    parts = [f"run dir {relative(run_dir)}"]
    if checkpoint and checkpoint.best_model_path:
        score = checkpoint.best_model_score
        monitored = f" ({checkpoint.monitor} {float(score):.4f})" if score is not None else ""
        parts.append(f"best checkpoint {relative(checkpoint.best_model_path)}{monitored}")
    if last:
        parts.append(f"last {relative(last)}")
    if looks := how_to_look(trainer.loggers, Path(relative(run_dir))):
        parts.append("look at it with: " + ", ".join(looks))
    if verdict := verdict_line(trainer):
        parts.append(verdict)
    return "; ".join(parts)


def relative(path: os.PathLike | str) -> str:
    """A path as the README shows it: relative to the working directory when it lies below it."""
    absolute = os.path.abspath(path)
    inside = absolute.startswith(os.getcwd().rstrip(os.sep) + os.sep)
    return os.path.relpath(absolute) if inside else str(path)


def verdict_line(trainer: Any) -> Optional[str]:
    """The whole run's verdict for the fit's last line (None without a ThroughputLogger or before any step)."""
    logger = next((c for c in trainer.callbacks if isinstance(c, ThroughputLogger)), None)
    if logger is None:
        return None
    verdict = logger.verdict
    verdict.cost = verdict.cost or worker_cost(trainer.train_dataloader, trainer.current_epoch)  # a fit cut short
    judged = verdict.judge(trainer, verdict.run)
    return f"over the run, {judged[0]}" if judged else None

