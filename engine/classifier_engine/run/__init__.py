"""The run wing: what makes a run safe to start, stop and continue, one question per file (docs/reliability.md).

    python -m classifier_engine fit --config CONFIG --ckpt_path last      # the CLI calls start_run (resume.py)
"""

from classifier_engine.run.resume import RunPlan, start_run

__all__ = ["RunPlan", "start_run"]
