"""The run wing: what makes a run safe to start, stop and continue. The recipe (model, data) never needs it.

    python -m project fit --config configs/quickstart.yaml --ckpt_path last

The CLI calls one function, `start_run(subcommand, config)` (resume.py: which checkpoint, which run dir; for a fit the
run dir created and locked). The file for each question: run_dirs.py (version_N names), lock.py (one writer per run
dir), checkpoint_io.py (atomic writes, trusted loads), checkpoint_checks.py (does the checkpoint fit the model and
data), last_checkpoint.py (last.ckpt, stops), signals.py, launchers.py (torchrun, srun), slurm.py (job id, requeue),
saved_config.py (config.yaml), training_steps.py (which batch ends step, log, validate), trackers.py (one tracked run
a run), sweep.py and sweep_trials.py (Optuna sweeps).
"""

from project.engine.run.resume import RunPlan, start_run

__all__ = ["RunPlan", "start_run"]
