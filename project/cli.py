"""The command line: LightningCLI with the data module's class count linked into the model.

    python -m project fit --config configs/quickstart.yaml
    python -m project validate --config configs/quickstart.yaml --ckpt_path <run>/checkpoints/last.ckpt
    python -m project fit --print_config
"""

from typing import Optional

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import project.strategies  # noqa: F401  registers strategy="dp" before any Trainer is built
from project.callbacks import ReseedEachEpoch
from project.data import ImageNetDataModule
from project.launch import check_process_count
from project.model import ImageClassifier


class ImageClassifierCLI(LightningCLI):
    """Defined in the package (not __main__) so ddp_spawn can pickle it."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.monitor": "val/acc1",
                "checkpoint.mode": "max",
                "checkpoint.save_last": True,
                "checkpoint.filename": "epoch{epoch:03d}-val_acc1={val/acc1:.4f}",
                "checkpoint.auto_insert_metric_name": False,
            }
        )

    def instantiate_trainer(self, **kwargs):
        trainer = super().instantiate_trainer(**kwargs)
        check_process_count(trainer.world_size, trainer.num_devices, trainer.num_nodes)
        return trainer


def cli_main(args: Optional[list[str]] = None, *, run: bool = True) -> ImageClassifierCLI:
    """Entry point of `python -m project`; tests call it in-process with a list of arguments."""
    return ImageClassifierCLI(
        ImageClassifier,
        ImageNetDataModule,
        args=args,
        run=run,
        seed_everything_default=42,  # fixed, so a resumed or requeued job continues the same data order
        trainer_defaults={"callbacks": [ReseedEachEpoch()]},
        save_config_kwargs={"overwrite": True},  # a resumed run rewrites the same resolved config
        parser_kwargs={"prog": "python -m project"},
    )
