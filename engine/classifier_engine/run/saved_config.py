"""config.yaml in the run dir: the resolved config of the run's latest fit (docs/reliability.md#configyaml).

    python -m classifier_engine fit --config <run dir>/config.yaml      # the latest settings of that run
"""

import os
from pathlib import Path
from typing import Optional

import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import SaveConfigCallback

from classifier_engine.config_edits import apply_edits
from classifier_engine.run.run_dirs import CHECKPOINTS
from classifier_engine.run.tracked_runs import record_tracked_runs
from classifier_engine.run.trackers import kind_of, log_config, logger_entries
from classifier_engine.storage.files import atomic_write, keep_aside


class KeepingSaveConfigCallback(SaveConfigCallback):
    def __init__(self, *args, run_dir: Optional[Path] = None, **kwargs):
        """`run_dir`: the fit's run dir (the run plan's), where config.yaml and the checkpoints go; None: not a fit."""
        self.run_dir = Path(run_dir) if run_dir is not None else None
        kwargs["save_to_log_dir"] = False  # save_config below writes it, on rank 0 only
        super().__init__(*args, **kwargs)

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.run_dir is None and stage == "fit" and trainer.log_dir:  # cli_main(run=False), then trainer.fit
            self.run_dir = Path(trainer.log_dir)
        if self.run_dir is None:
            return  # validate/test/predict: a later export or fit reads the run's config.yaml, which stays the fit's
        for callback in trainer.callbacks:
            # Set here, not in the parsed config: config.yaml keeps no run dir, so `--config <run>/config.yaml`
            # starts a new run (ModelCheckpoint's own choice follows the first logger: an MLflow run's id, say).
            # Real path, as ModelCheckpoint makes a dirpath it is given: its resumed state names the same folder
            # (else Lightning forgets the earlier best: "The dirpath has changed").
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
                callback.dirpath = os.path.realpath(self.run_dir / CHECKPOINTS)
        if self.config.get("ckpt_path") is None:  # (the plan's choice: trainer.ckpt_path is not set yet)
            super().setup(trainer, pl_module, stage)  # a resume writes in on_train_start, once the checkpoint loaded

    def on_train_start(self, trainer, pl_module) -> None:
        if self.run_dir is not None:
            super().setup(trainer, pl_module, "fit")

    def save_config(self, trainer, pl_module, stage: str) -> None:
        path = self.run_dir / self.config_filename
        keep_aside(path)  # a previous start's, as config.<n>.yaml
        config = self.config.clone()
        # The tracked run's identity (trackers.json keeps it for a resume), not a setting: a new run from this
        # config.yaml must not continue this run's MLflow or W&B run, nor write into its dir.
        apply_edits(config, [(f"{prefix}.init_args.{key}", None) for prefix, entry in logger_entries(config.trainer)
                             for key in {"mlflow": ("run_id",), "wandb": ("id", "save_dir")}.get(kind_of(entry), ())])
        text = self.parser.dump(config, skip_none=False)
        atomic_write(path, lambda file: file.write(text), mode="w")
        log_config(trainer.loggers, yaml.safe_load(text) or {}, path)
        record_tracked_runs(trainer.loggers, self.run_dir)
