"""config.yaml in the run dir: the resolved config of the run's latest start; earlier starts are kept beside it.

    python -m project fit --config <run dir>/config.yaml      # the latest settings of that run

LightningCLI's SaveConfigCallback writes into `trainer.log_dir` (the logger's folder: None for an MLflow logger with
an http URI) and either refuses an existing config.yaml (a resumed run then died) or overwrites it. Here a fit writes
into the run dir its plan chose (project.engine.run.resume), whatever the logger; a resumed run renames the previous
config.yaml to config.<n>.yaml (n = 1, 2, ...) first, so no earlier one is lost, and does so at train start, once the
checkpoint has been restored: a resume that fails to restore leaves the run's config.yaml as it was. Without a
planned run dir (validate, test, predict) it is Lightning's callback.
"""

from pathlib import Path
from typing import Optional

import yaml
from lightning.pytorch.cli import SaveConfigCallback

from project.engine.run.checkpoint_io import atomic_write
from project.engine.run.trackers import log_config, record_tracked_runs


def keep_previous(path: Path) -> None:
    """Rename an existing `path` to the first free <stem>.<n><suffix>."""
    if not path.is_file():
        return
    n = 1
    while (kept := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    path.rename(kept)


class KeepingSaveConfigCallback(SaveConfigCallback):
    def __init__(self, *args, run_dir: Optional[Path] = None, **kwargs):
        """
        Args:
            run_dir: where config.yaml goes (the run plan's run dir); None: Lightning's trainer.log_dir.
        """
        self.run_dir = Path(run_dir) if run_dir is not None else None
        if self.run_dir is not None:
            kwargs["save_to_log_dir"] = False  # save_config below writes it, on rank 0 only
        super().__init__(*args, **kwargs)

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit" and trainer.ckpt_path is not None:
            return  # a resume: written in on_train_start, after the checkpoint has loaded
        self._save(trainer, pl_module, stage)

    def on_train_start(self, trainer, pl_module) -> None:
        self._save(trainer, pl_module, "fit")

    def _save(self, trainer, pl_module, stage: str) -> None:
        if self.run_dir is None and not self.already_saved and self.save_to_log_dir:
            previous = Path(trainer.log_dir or "") / self.config_filename  # log_dir is a collective: every rank asks
            if trainer.is_global_zero:
                keep_previous(previous)
        super().setup(trainer, pl_module, stage)  # every rank: it ends with a broadcast

    def save_config(self, trainer, pl_module, stage: str) -> None:
        if self.run_dir is None:
            return
        path = self.run_dir / self.config_filename
        keep_previous(path)
        text = self.parser.dump(self.config, skip_none=False)
        if self.multifile:
            self.parser.save(self.config, str(path), skip_none=False, overwrite=True, multifile=True)
        else:
            atomic_write(path, lambda file: file.write(text), mode="w")
        # The trackers (MLflow, W&B, ...) get the same config, and their run ids are kept for a resume.
        log_config(trainer.loggers, yaml.safe_load(text) or {}, path)
        record_tracked_runs(trainer.loggers, self.run_dir)
