"""The command line: LightningCLI over ImageClassifier and ImageNetDataModule, with the run's safety rails.

    python -m project fit --config configs/quickstart.yaml
    python -m project validate --config configs/quickstart.yaml --ckpt_path <run>/checkpoints/last.ckpt
    python -m project fit --print_config

What it adds to LightningCLI, in the order a run meets it: links (the class count, the run seed and the batch size
flow from the data and the seed into the model; --print_config shows them); the resume plan (project.run.resume: which
checkpoint, which run dir, verified before anything is built); explicit values kept over a checkpoint's
hyperparameters (project.compat.ckpt_hparams); the Trainer's plugins (atomic checkpoint files, Slurm without
Lightning's signal-handler requeue, sync BN on gloo) and default callbacks; a check that the checkpoint fits the model
and the data; and for `fit`, the run dir's lock (project.run.lock) for the length of the run.
"""

import sys
from datetime import timedelta
from pathlib import Path
from typing import Optional

from jsonargparse import Namespace
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

import project.strategies  # noqa: F401  registers strategy="dp" before any Trainer is built
from project.run.last_checkpoint import LastCheckpoint
from project.callbacks.prediction_writer import PredictionCsvWriter
from project.callbacks.progress_bar import StepProgressBar
from project.callbacks.throughput import ThroughputLogger
from project.run.checkpoint_checks import check_checkpoint_fits
from project.run.checkpoint_io import AtomicCheckpointIO
from project.compat.batch_limits import Trainer
from project.compat.ckpt_hparams import explicit_values, keep_explicit_model_values
from project.compat.spawn import trains_in_this_process
from project.data import ImageNetDataModule
from project.errors import ConfigError, is_peer_failure, record_rank, user_message
from project.run.launchers import check_process_count
from project.errors import env_global_rank
from project.backbones import torchvision_weights
from project.model import ImageClassifier
from project.run.resume import RunPlan, next_version, plan_run
from project.run.lock import RunDirTaken, RunLock, claim
from project.run.saved_config import KeepingSaveConfigCallback
from project.run.slurm import cluster_environment, slurm_job_id, task_line
from project.strategies.sync_batchnorm import SyncBatchNormAnyBackend
from project.weights import eval_sizes


def run_seed(seed_everything) -> int:
    """The run seed the data order and augmentations derive from; `seed_everything: false` gives 0."""
    return seed_everything if isinstance(seed_everything, int) and not isinstance(seed_everything, bool) else 0


class ImageClassifierCLI(LightningCLI):
    """Defined in the package (not __main__) so ddp_spawn can pickle it."""

    plan: Optional[RunPlan] = None
    run_lock: Optional[RunLock] = None

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
        parser.link_arguments("data.batch_size", "model.batch_size")
        parser.link_arguments("seed_everything", "data.seed", compute_fn=run_seed)
        parser.link_arguments("seed_everything", "model.seed", compute_fn=run_seed)
        parser.add_argument("--ddp_timeout_minutes", type=float, default=10.0,
                            help="ddp/ddp_spawn: a rank that stops answering ends the job after this long (torch's "
                                 "default is 30 minutes)")
        # Checkpoint callbacks: best by val/acc1 (ModelCheckpoint), then last.ckpt, which must save after it.
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.add_lightning_class_args(LastCheckpoint, "last_checkpoint")
        parser.add_lightning_class_args(ThroughputLogger, "throughput")
        # `predict` writes a CSV (--predictions.output); in the other subcommands the callback does nothing.
        parser.add_lightning_class_args(PredictionCsvWriter, "predictions")
        parser.set_defaults({
            "checkpoint.monitor": "val/acc1",
            "checkpoint.mode": "max",
            "checkpoint.filename": "epoch{epoch:03d}-val_acc1={val/acc1:.4f}",
            "checkpoint.auto_insert_metric_name": False,
        })

    # -- after parsing: the resume plan, before Lightning reads the checkpoint's hyperparameters ------------------
    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        self._explicit = explicit_values(parser, args, self.config, subcommand)
        if subcommand:
            self.plan = plan_run(subcommand, self.config[subcommand])
            if subcommand == "fit" and self.plan.reason:
                rank_zero_info(self.plan.reason)
            for path, why in self.plan.skipped:
                rank_zero_warn(f"skipped checkpoint {path}: {why}")

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if self.subcommand == "fit" and config.trainer.max_epochs == -1 and config.trainer.max_steps in (None, -1):
            raise ConfigError("trainer.max_epochs=-1 and no trainer.max_steps: the run has no end, and the LR schedule "
                              "needs one; set --trainer.max_epochs or --trainer.max_steps")
        if self.plan and self.plan.hparams:
            for line in keep_explicit_model_values(config, self._explicit, self.plan.hparams):
                rank_zero_info(line)
        config.data.seed = config.model.seed = run_seed(config.seed_everything)  # after a random pick (true)
        apply_weights_eval_sizes(config, self._explicit)
        job_id = slurm_job_id()
        if job_id is not None and self.subcommand and self.plan is not None:
            print(task_line(job_id, self.plan.run_dir or config.trainer.default_root_dir), flush=True)

    def instantiate_trainer(self, **kwargs):
        trainer_config = self.config_init[self.subcommand]["trainer"] if self.subcommand else self.config_init["trainer"]
        plugins = trainer_config.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            plugins.append(AtomicCheckpointIO())
        if (environment := cluster_environment()) is not None:
            plugins.append(environment)
        if trainer_config.get("sync_batchnorm"):
            # Lightning's own plugin needs CUDA; this one picks torch's SyncBatchNorm or a gloo one at set-up.
            plugins.append(SyncBatchNormAnyBackend())
        trainer_config["plugins"] = plugins
        timeout = timedelta(minutes=self._config_value("ddp_timeout_minutes", 10.0))
        strategy = trainer_config.get("strategy")
        if strategy in ("ddp", "ddp_spawn"):
            trainer_config["strategy"] = DDPStrategy(timeout=timeout, start_method="spawn" if strategy == "ddp_spawn" else "popen")
        callbacks = list(trainer_config.get("callbacks") or [])
        own_bar = any(isinstance(c, ProgressBar) for c in callbacks)
        if trainer_config.get("enable_progress_bar", True) is not False and not own_bar:
            # Each refresh reads the logged tensors on the host (a GPU sync): only on logging steps.
            callbacks.append(StepProgressBar(refresh_rate=trainer_config.get("log_every_n_steps") or 50))
        trainer_config["callbacks"] = callbacks
        if trainer_config.get("enable_checkpointing") is False:
            # The checkpoint groups (best, last.ckpt) are callbacks too: without checkpointing, inert ones instead
            # (the Trainer refuses checkpoint callbacks with enable_checkpointing=false).
            config = self.config_init[self.subcommand] if self.subcommand else self.config_init
            for key in ("checkpoint", "last_checkpoint"):
                config[key] = Callback()
        trainer = super().instantiate_trainer(**kwargs)
        if trainer.loggers:  # LearningRateMonitor raises without a logger (Lightning #17159)
            trainer.callbacks.append(LearningRateMonitor(logging_interval="step"))
        check_process_count(trainer.world_size, trainer.num_devices, trainer.num_nodes)
        record_rank(trainer.global_rank, trainer.world_size)
        return trainer

    def _config_value(self, key: str, default):
        config = self.config[self.subcommand] if self.subcommand else self.config
        value = config.get(key)
        return default if value is None else value

    def after_instantiate_classes(self) -> None:
        super().after_instantiate_classes()
        if self.subcommand and self.plan and self.plan.ckpt_path is not None:
            check_checkpoint_fits(self.plan.ckpt_path, self.model, self.datamodule, resuming=self.subcommand == "fit")

    # -- fit: the run dir is claimed (created, locked) for the length of the run ---------------------------------
    def fit(self, model, datamodule=None, **kwargs) -> None:
        self.run_lock = self._claim_run_dir()
        try:
            self.trainer.fit(model, datamodule=datamodule, **kwargs)
            rank_zero_info(where_the_run_went(self.trainer))
        except BaseException as error:
            # A new run stopped by bad input before its first step (here, or on another rank) leaves nothing behind.
            # Only then: a crash or Ctrl+C keeps its logs; under ddp_spawn this process never trains (step 0).
            bad_input = user_message(error) is not None or is_peer_failure(error)
            if (self.run_lock is not None and self.trainer.global_step == 0 and bad_input
                    and not isinstance(error, KeyboardInterrupt) and trains_in_this_process(self.trainer)):
                self.run_lock.remove_failed_start()
            raise
        finally:
            if self.run_lock is not None:
                self.run_lock.release()

    def _claim_run_dir(self) -> Optional[RunLock]:
        plan = self.plan
        if plan is None or plan.run_dir is None or env_global_rank() != 0:
            return None  # the other ranks write nothing; rank 0's lock covers the job
        for _ in range(100):
            try:
                return claim(plan.run_dir, fresh=plan.fresh)
            except RunDirTaken:  # a run started at the same moment took this version: take the next one
                plan.run_dir = plan.run_dir.parent / f"version_{next_version(plan.run_dir.parent)}"
                self._repin(plan.run_dir)
        raise RuntimeError(f"could not create a new run dir under {plan.run_dir.parent}")

    def _repin(self, run_dir: Path) -> None:
        """Point the already built logger (or, for one we cannot pin, the checkpoints) at another version dir."""
        from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

        version = int(run_dir.name.removeprefix("version_"))
        config = self.config[self.subcommand]
        logger = self.trainer.logger
        if isinstance(logger, (TensorBoardLogger, CSVLogger)):
            config.trainer.logger.init_args.version = version  # what config.yaml will say
            self.trainer.loggers = [type(logger)(save_dir=logger.save_dir, name=logger.name, version=version)]
        elif self.trainer.checkpoint_callback is not None:
            self.trainer.checkpoint_callback.dirpath = str(run_dir / "checkpoints")
            config.checkpoint.dirpath = str(run_dir / "checkpoints")


def where_the_run_went(trainer) -> str:
    """The last line of a fit: the run dir, its checkpoints and the command to look at it."""
    from project.run.last_checkpoint import LastCheckpoint

    last = next((c.path for c in trainer.callbacks if isinstance(c, LastCheckpoint) and c.path), None)
    best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    score = trainer.checkpoint_callback.best_model_score if trainer.checkpoint_callback else None
    run_dir = Path(trainer.log_dir or trainer.default_root_dir)
    parts = [f"run dir {run_dir}"]
    if best:
        parts.append(f"best checkpoint {best}" + (f" ({trainer.checkpoint_callback.monitor} {float(score):.4f})" if score is not None else ""))
    if last:
        parts.append(f"last {last}")
    if trainer.loggers:
        parts.append(f"look at it with: tensorboard --logdir {run_dir.parent}")
    return "; ".join(parts)


def apply_weights_eval_sizes(config: Namespace, explicit: Namespace) -> None:
    """With torchvision weights, their evaluation resize/crop become data's defaults (an explicit value wins)."""
    model, data = config.model, config.data
    if not model.get("weights") or model.get("backbone") is not None or torchvision_weights(model.arch, model.weights) is None:
        return
    resize, crop = eval_sizes(model.arch, model.weights)
    given = explicit.get("data") or Namespace()
    for key, value in (("eval_resize_size", resize), ("eval_crop_size", crop)):
        if given.get(key) is None and data[key] != value:
            rank_zero_info(f"data.{key}: {value} (the evaluation transform of {model.arch} {model.weights})")
            data[key] = value


def cli_main(args: Optional[list[str]] = None, *, run: bool = True) -> ImageClassifierCLI:
    """Entry point of `python -m project`; tests call it in-process with a list of arguments."""
    record_rank(None)  # this run's Trainer records its own (a process may build several: notebooks, tests)
    return ImageClassifierCLI(
        ImageClassifier,
        ImageNetDataModule,
        trainer_class=Trainer,  # Lightning's, with `limit_*_batches: 1` meaning one batch (project/compat)
        args=args,
        run=run,
        seed_everything_default=42,  # fixed, so a resumed or requeued job continues the same data order
        auto_configure_optimizers=False,  # the model's configure_optimizers scales the LR: no --optimizer override
        save_config_callback=KeepingSaveConfigCallback,
        save_config_kwargs={"overwrite": True},  # a resumed run writes its config; the previous one is kept
        # Parse errors raise (main() prints them as one line) instead of printing the whole usage and exiting.
        parser_kwargs={"prog": "python -m project", "exit_on_error": False,
                       **{sub: {"exit_on_error": False} for sub in ("fit", "validate", "test", "predict")}},
    )


def main() -> None:
    """`python -m project`: user errors as one line and exit 2 (PROJECT_DEBUG=1 shows the traceback)."""
    from project.errors import check_config_files, exit_on_user_error

    def run() -> None:
        check_config_files(sys.argv[1:])
        cli_main()

    exit_on_user_error(run)
    close_process_group()


def close_process_group() -> None:
    """Destroy the process group a finished run leaves (torchrun, srun) before the interpreter exits: left to the
    interpreter's teardown, gloo's threads aborted a rank now and then ("terminate called without an active
    exception", exit -6)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # no rank tears down its sockets while another still talks to it
        dist.destroy_process_group()
