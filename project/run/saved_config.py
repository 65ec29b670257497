"""config.yaml in the run dir: the resolved config of the run's latest start; earlier starts are kept beside it.

LightningCLI's SaveConfigCallback either refuses an existing config.yaml (a resumed run then died) or overwrites it.
A resumed run here writes its config.yaml after renaming the previous one to config.<n>.yaml (n = 1, 2, ...), so
`--config <run>/config.yaml` reproduces the latest settings and no earlier one is lost; and it does so at train start,
once the checkpoint has been restored: a resume that fails to restore leaves the run's config.yaml as it was.
"""

from pathlib import Path

from lightning.pytorch.cli import SaveConfigCallback


class KeepingSaveConfigCallback(SaveConfigCallback):
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit" and trainer.ckpt_path is not None:
            return  # a resume: written in on_train_start, after the checkpoint has loaded
        self._save(trainer, pl_module, stage)

    def on_train_start(self, trainer, pl_module) -> None:
        self._save(trainer, pl_module, "fit")

    def _save(self, trainer, pl_module, stage: str) -> None:
        if not self.already_saved and self.save_to_log_dir:
            previous = Path(trainer.log_dir or "") / self.config_filename  # log_dir is a collective: every rank asks
            if trainer.is_global_zero and previous.is_file():
                stem, suffix = previous.stem, previous.suffix
                n = 1
                while (kept := previous.with_name(f"{stem}.{n}{suffix}")).exists():
                    n += 1
                previous.rename(kept)
        super().setup(trainer, pl_module, stage)
