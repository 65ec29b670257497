"""The run wing: what makes a run safe to start, stop and continue. The recipe (model, data) never needs it.

    python -m project fit --config configs/quickstart.yaml --ckpt_path last

The CLI calls `start_run(subcommand, config)` (resume.py: which checkpoint and run dir). Each other file answers one
question: run_dirs.py, lock.py (one writer), checkpoint_io.py (atomic writes, trusted loads), checkpoint_checks.py,
last_checkpoint.py (and stops), signals.py, launchers.py, slurm.py, saved_config.py (config.yaml), training_steps.py,
trackers.py, sweep.py and sweep_trials.py (Optuna).
"""

from project.engine.run.resume import RunPlan, start_run

__all__ = ["RunPlan", "start_run"]
