"""The run wing: what makes a run safe to start, stop and continue. The recipe (model, data) never imports it.

    python -m project fit --config configs/quickstart.yaml --ckpt_path last

| question                                   | file                  |
|--------------------------------------------|-----------------------|
| which checkpoint, which run dir?           | resume.py             |
| may this process write into the run dir?   | lock.py               |
| write and read checkpoint files safely     | checkpoint_io.py      |
| does the checkpoint fit the model and data | checkpoint_checks.py  |
| last.ckpt: when it is written, stop agreed | last_checkpoint.py    |
| SIGTERM / SIGINT / SIGUSR1 as requests     | signals.py            |
| who launched us (torchrun, srun), counts   | launchers.py          |
| Slurm job id, requeue                      | slurm.py              |
| config.yaml of each start                  | saved_config.py       |
| which batch ends step, log, validate       | training_steps.py     |
"""
