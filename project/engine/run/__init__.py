"""The run wing: what makes a run safe to start, stop and continue. The recipe (model, data) never needs it.

    python -m project fit --config configs/quickstart.yaml --ckpt_path last

The CLI calls one function, `start_run(subcommand, config)`: a RunPlan with the checkpoint loaded once and, for a
fit, the run dir already created and locked; the rest of the wing is what the run meets afterwards.

| question                                    | file                  |
|---------------------------------------------|-----------------------|
| which checkpoint, which run dir? (the plan) | resume.py             |
| where a run's files go, version_N names     | run_dirs.py           |
| may this process write into the run dir?    | lock.py               |
| write any file atomically; load checkpoints | checkpoint_io.py      |
| does the checkpoint fit the model and data  | checkpoint_checks.py  |
| last.ckpt: when it is written, stop agreed  | last_checkpoint.py    |
| SIGTERM / SIGHUP / SIGINT / SIGUSR1         | signals.py            |
| who launched us (torchrun, srun), counts    | launchers.py          |
| Slurm job id, requeue                       | slurm.py              |
| config.yaml of each start                   | saved_config.py       |
| which batch ends step, log, validate        | training_steps.py     |
| experiment trackers: one tracked run a run  | trackers.py           |
| hyperparameter sweeps (Optuna), their trials| sweep.py, sweep_trials.py |
"""

from project.engine.run.resume import RunPlan, start_run

__all__ = ["RunPlan", "start_run"]
