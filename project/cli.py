"""The command line: LightningCLI with the data module's class count linked into the model.

    python -m project fit --config configs/quickstart.yaml
    python -m project validate --config configs/quickstart.yaml --ckpt_path <run>/checkpoints/last.ckpt
    python -m project fit --print_config
"""

import os
from typing import Optional

from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

import project.strategies  # noqa: F401  registers strategy="dp" before any Trainer is built
from project.callbacks import PredictionCsvWriter, ReseedEachEpoch
from project.callbacks.checkpoint import LatestModelCheckpoint
from project.callbacks.throughput import ThroughputLogger
from project.data import ImageNetDataModule
from project.launchers import check_process_count
from project.strategies.sync_batchnorm import SyncBatchNormAnyBackend
from project.model import ImageClassifier
from project.run_dir import find_last_checkpoint, pin_logger_version, version_number, version_of
from project.slurm import RequeueOnSignal, pin_run_to_slurm_job
from project.compat.batch_limits import Trainer


def run_seed(seed_everything) -> int:
    """The run seed the data order and augmentations derive from; `seed_everything: false` or `true` give 0."""
    return seed_everything if isinstance(seed_everything, int) and not isinstance(seed_everything, bool) else 0


class ImageClassifierCLI(LightningCLI):
    """Defined in the package (not __main__) so ddp_spawn can pickle it."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
        parser.link_arguments("seed_everything", "data.seed", compute_fn=run_seed)
        parser.add_lightning_class_args(LatestModelCheckpoint, "checkpoint")
        # `predict` writes a CSV (--predictions.output); in the other subcommands the callback does nothing.
        parser.add_lightning_class_args(PredictionCsvWriter, "predictions")
        parser.set_defaults(
            {
                "checkpoint.monitor": "val/acc1",
                "checkpoint.mode": "max",
                "checkpoint.save_last": True,
                "checkpoint.filename": "epoch{epoch:03d}-val_acc1={val/acc1:.4f}",
                "checkpoint.auto_insert_metric_name": False,
            }
        )

    def before_instantiate_classes(self) -> None:
        if self.subcommand == "fit":
            self._resume_into_same_run(self.config[self.subcommand])
        if self.subcommand:
            # After the "last" lookup: inside a Slurm job, the job's run dir and preemption checkpoint take over.
            pin_run_to_slurm_job(self.config[self.subcommand], self.subcommand)

    @staticmethod
    def _resume_into_same_run(config: Namespace) -> None:
        root = config.trainer.default_root_dir or os.getcwd()
        if config.ckpt_path == "last":
            found = find_last_checkpoint(root)
            if found is None:
                rank_zero_warn(f"--ckpt_path last: no checkpoint under {root} yet; starting from scratch")
            else:
                rank_zero_info(f"--ckpt_path last: resuming from {found}")
            config.ckpt_path = str(found) if found else None
        version = version_of(config.ckpt_path, root) if config.ckpt_path else None
        # Only the default logger is pinned; a logger configured by the user is left as configured.
        if version is not None and config.trainer.logger in (None, True):
            pin_logger_version(config.trainer, root, version_number(version))

    def instantiate_trainer(self, **kwargs):
        trainer_config = self.config_init[self.subcommand]["trainer"] if self.subcommand else self.config_init["trainer"]
        if trainer_config.get("sync_batchnorm"):
            # Lightning's own plugin needs CUDA; this one picks torch's SyncBatchNorm or a gloo one at set-up.
            plugins = trainer_config.get("plugins") or []
            plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
            trainer_config["plugins"] = [*plugins, SyncBatchNormAnyBackend()]
        trainer = super().instantiate_trainer(**kwargs)
        check_process_count(trainer.world_size, trainer.num_devices, trainer.num_nodes)
        return trainer


def cli_main(args: Optional[list[str]] = None, *, run: bool = True) -> ImageClassifierCLI:
    """Entry point of `python -m project`; tests call it in-process with a list of arguments."""
    return ImageClassifierCLI(
        ImageClassifier,
        ImageNetDataModule,
        trainer_class=Trainer,  # Lightning's, with `limit_*_batches: 1` meaning one batch (project/compat/batch_limits.py)
        args=args,
        run=run,
        seed_everything_default=42,  # fixed, so a resumed or requeued job continues the same data order
        trainer_defaults={"callbacks": [ReseedEachEpoch(), ThroughputLogger(), RequeueOnSignal()]},
        save_config_kwargs={"overwrite": True},  # a resumed run rewrites the same resolved config
        parser_kwargs={"prog": "python -m project"},
    )
