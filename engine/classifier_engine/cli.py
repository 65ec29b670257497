"""LightningCLI over any LightningModule and LightningDataModule, with the run's safety rails (docs/how-it-works.md).

    python -m classifier_engine fit --model.class_path my_models.MyModule --data.class_path my_data.MyData
    python -m classifier_engine validate --config RUN/config.yaml --ckpt_path RUN/checkpoints/last.ckpt
"""

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Optional

import lightning as L
from jsonargparse import Namespace
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader

import classifier_engine.strategies  # noqa: F401  registers strategy="dp" before any Trainer is built
from classifier_engine import class_switch, contract
from classifier_engine.callbacks.prediction_writer import PredictionCsvWriter
from classifier_engine.callbacks.progress_bar import StepProgressBar
from classifier_engine.callbacks.throughput import ThroughputLogger
from classifier_engine.compat.batch_dispatch import LeanBatchDispatch
from classifier_engine.compat.batch_limits import Trainer
from classifier_engine.compat.ckpt_hparams import explicit_values, keep_explicit_model_values
from classifier_engine.compat.ckpt_read_once import CheckpointReadOnceCLI
from classifier_engine.compat.elastic_store import init_attempt_process_group
from classifier_engine.compat.log_device_move import skip_same_device_moves
from classifier_engine.compat.spawn import trains_in_this_process
from classifier_engine.compat.subclass_nulls import restore_nulls
from classifier_engine.data.predict import ImagePathDataset
from classifier_engine.errors import (
    ConfigError,
    env_global_rank,
    is_peer_failure,
    limited_yaml_mode,
    record_rank,
    user_message,
)
from classifier_engine.options import PositiveInt
from classifier_engine.run import RunPlan, start_run
from classifier_engine.run.checkpoint_checks import CheckpointValues, check_checkpoint_fits
from classifier_engine.run.checkpoint_io import AtomicCheckpointIO
from classifier_engine.run.global_batch import GlobalBatch, apply_global_batch, planned_world_size
from classifier_engine.run.last_checkpoint import LastCheckpoint, StopSignals, stops_reach_spawned_ranks
from classifier_engine.run.launchers import check_devices, check_process_count
from classifier_engine.run.remote_runs import RemoteRoot, mirror_remote_root
from classifier_engine.run.resume import looks_for_checkpoints
from classifier_engine.run.run_dirs import LOGS
from classifier_engine.run.saved_config import KeepingSaveConfigCallback
from classifier_engine.run.slurm import cluster_environment, slurm_job_id, task_line
from classifier_engine.run.tracker_outage import outlive_outages
from classifier_engine.run.trackers import continue_csv_logs, how_to_look, redact
from classifier_engine.samplers import ExactLoaders
from classifier_engine.strategies.fsdp import FSDPStrategy
from classifier_engine.strategies.sync_batchnorm import SyncBatchNormAnyBackend

ConfigHook = Callable[[Namespace, Namespace], None]
TidyHook = Callable[[Namespace], None]


@dataclass(frozen=True)
class Defaults:
    """What a config that names no class builds, from the entry point (`cli_main(model=..., data=...)`).
    config_hooks run on the subcommand's config (and the values given explicitly) before anything is built;
    tidy_hooks also before it is printed or saved, so `--print_config` and config.yaml show what is built."""

    model: Optional[type] = None
    data: Optional[type] = None
    config_hooks: Sequence[ConfigHook] = ()
    tidy_hooks: Sequence[TidyHook] = ()


LIMITED_YAML = limited_yaml_mode()  # on import: a ddp_spawn child unpickles the parser, never runs cli_main

class ProjectParser(LightningArgumentParser):
    tidy_hooks: Sequence[TidyHook] = ()  # the entry point's (Defaults), set by ProjectCLI.init_parser

    def dump(self, cfg: Namespace, *args, **kwargs) -> str:  # --print_config and the saved config.yaml
        if self.tidy_hooks and isinstance(cfg.get("model"), Namespace):
            cfg = cfg.clone()
            for hook in self.tidy_hooks:
                hook(cfg)
        return redact(super().dump(cfg, *args, **kwargs))  # a URI's password (a run's moved to the environment)


DDP_START_METHODS = {"ddp": "popen", "ddp_spawn": "spawn", "ddp_fork": "fork"}  # Lightning's names, our DDPStrategy
LINK_TARGETS = {"model": ("num_classes", "image_sizes", "batch_size", "seed"), "data": ("seed",)}


def run_seed(seed_everything) -> int:
    """The run seed the data order and augmentations derive from; `seed_everything: false` gives 0."""
    return seed_everything if isinstance(seed_everything, int) and not isinstance(seed_everything, bool) else 0


class ProjectCLI(CheckpointReadOnceCLI):
    """Defined in the package (not __main__) so ddp_spawn can pickle it."""

    plan: Optional[RunPlan] = None
    remote: Optional[RemoteRoot] = None  # an s3:// default_root_dir, the run working in its node-local mirror
    _checkpoint_io: Optional[AtomicCheckpointIO] = None
    linked_model_arguments = LINK_TARGETS["model"]

    def __init__(self, *args, defaults: Defaults = Defaults(), **kwargs) -> None:
        # LightningCLI runs the whole command in __init__: the run dir claimed while parsing is released (or, after
        # a failed start, removed) here.
        self.defaults = defaults
        try:
            super().__init__(*args, **kwargs)
        except BaseException as error:
            if self.plan is not None and self.plan.lock is not None and self._failed_before_training(error):
                self.plan.lock.remove_failed_start()
            raise
        finally:
            if self.plan is not None and self.plan.lock is not None:
                self.plan.lock.release()
            if self.remote is not None:  # what the run wrote since its last save (logs), then the lease
                if self.plan is not None and self.plan.run_dir is not None and env_global_rank() == 0:
                    self.remote.sync(self.plan.run_dir)
                self.remote.release()

    def _failed_before_training(self, error: BaseException) -> bool:
        """True when the start left nothing worth keeping: it stopped before the Trainer existed, or on bad input (here
        or on another rank) before its first step; a crash or Ctrl+C keeps its logs. ddp_spawn's parent never trains."""
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return True
        bad_input = user_message(error) is not None or is_peer_failure(error)
        return (trainer.global_step == 0 and bad_input and not isinstance(error, KeyboardInterrupt)
                and trains_in_this_process(trainer))

    def init_parser(self, **kwargs) -> LightningArgumentParser:
        parser = super().init_parser(**kwargs)
        parser.tidy_hooks = self.defaults.tidy_hooks
        return parser

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Links reach a class only when it has the argument (LINK_TARGETS: a class switch leaves them to the link).
        parser.link_arguments("data.num_classes", "model.init_args.num_classes", apply_on="instantiate")
        parser.link_arguments("data", "model.init_args.image_sizes", compute_fn=contract.image_sizes,
                              apply_on="instantiate")
        parser.link_arguments("data.init_args.batch_size", "model.init_args.batch_size")
        parser.link_arguments("seed_everything", "data.init_args.seed", compute_fn=run_seed)
        parser.link_arguments("seed_everything", "model.init_args.seed", compute_fn=run_seed)
        parser.set_defaults({key: {"class_path": f"{cls.__module__}.{cls.__qualname__}"}
                             for key, cls in (("model", self.defaults.model), ("data", self.defaults.data)) if cls})
        parser.add_argument("--ddp_timeout_minutes", type=float, default=10.0,
                            help="ddp(_spawn, _fork), fsdp2(_sharded): a rank that stops answering ends the job after "
                                 "this long (torch's default is 30 minutes)")
        parser.add_argument("--global_batch_size", type=Optional[PositiveInt], default=None,
                            help="fit: images per optimizer step at any world size (data.batch_size: the most per "
                                 "process; the accumulation follows): a resume on another number of GPUs is exact")
        # Checkpoint callbacks: the best by the model's Monitor (ModelCheckpoint), then last.ckpt, which saves after.
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.add_lightning_class_args(LastCheckpoint, "last_checkpoint")
        parser.add_lightning_class_args(ThroughputLogger, "throughput")
        # `predict` writes a CSV (--predictions.output); in the other subcommands the callback does nothing.
        parser.add_lightning_class_args(PredictionCsvWriter, "predictions")
        defaults = contract.monitor_options(self.defaults.model)  # a class chosen by class_path: parse_arguments
        parser.set_defaults({"checkpoint.auto_insert_metric_name": False, **defaults})

    @staticmethod
    def _monitor_options(config: Namespace, explicit: Namespace) -> dict[str, Any]:
        """The checkpoint options of the chosen model class's Monitor that were not given; without a Monitor,
        ModelCheckpoint's own defaults (the latest is kept as best)."""
        if explicit.get("checkpoint.monitor") is not None or not isinstance(config.get("model"), Namespace):
            return {}
        chosen = contract.monitor_options(config.model.get("class_path")) or {
            "checkpoint.monitor": None, "checkpoint.mode": "min", "checkpoint.filename": None}
        return {key: value for key, value in chosen.items() if explicit.get(key) is None}

    # -- after parsing: the run plan (the one read of the checkpoint), before its hyperparameters are parsed ------
    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        given = list(sys.argv[1:] if args is None else args) if not isinstance(args, (dict, Namespace)) else None
        # --print_config prints while parsing: the class switch's resets are found without it, then printed with it.
        quiet = [word for word in given if not word.startswith("--print_config")] if given is not None else None
        printing = given is not None and quiet != given
        super().parse_arguments(parser, quiet if printing else args)
        subcommand = self.config.get("subcommand")
        if given is not None:
            explicit = explicit_values(parser, quiet, self.config, subcommand, link_sources=("seed_everything",))
            config = self.config[subcommand] if subcommand else self.config
            resets = class_switch.resets(config, explicit, quiet, {"model": self.defaults.model, "data":
                                         self.defaults.data}, LINK_TARGETS)
            if printing:  # printed as the run will use it: the chosen class's Monitor, not the default class's
                resets += [f"--{key}={'null' if value is None else value}"
                           for key, value in self._monitor_options(config, explicit).items()]
            if resets or printing:
                self.config = parser.parse_args([*given, *resets])
            restore_nulls(self.config[subcommand] if subcommand else self.config, given)
        self._explicit = explicit_values(parser, args, self.config, subcommand)
        config = self.config[subcommand] if subcommand else self.config
        for key, value in self._monitor_options(config, self._explicit).items():
            config[key] = value
        if subcommand:
            resume = looks_for_checkpoints(subcommand, self.config[subcommand].get("ckpt_path"))
            self.remote = mirror_remote_root(self.config[subcommand], LOGS, resume)
            self.plan = start_run(subcommand, self.config[subcommand])
            if self.remote is not None and subcommand == "fit" and env_global_rank() == 0:
                self.remote.claim(self.plan.run_dir)
            self.save_config_kwargs = {**self.save_config_kwargs, "run_dir": self.plan.run_dir}
            if subcommand == "fit" and self.plan.reason:
                rank_zero_info(self.plan.reason)
            for path, why in self.plan.skipped:
                rank_zero_warn(f"skipped checkpoint {path}: {why}")

    def loaded_checkpoint(self) -> Optional[dict]:
        """For the checkpoint's hyperparameters (compat/ckpt_read_once.py): the plan's load, not a new one."""
        return self.plan.checkpoint if self.plan is not None else None

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if self.subcommand == "fit" and config.trainer.max_epochs == -1 and config.trainer.max_steps in (None, -1):
            raise ConfigError("trainer.max_epochs=-1 and no trainer.max_steps: the run has no end, and the LR schedule "
                              "needs one; set --trainer.max_epochs or --trainer.max_steps")
        check_devices(config.trainer.devices, config.trainer.accelerator)
        if self.subcommand == "fit" and (line := apply_global_batch(config, self._explicit)):
            rank_zero_info(line)
        hparams = self.plan.checkpoint.get("hyper_parameters") if self.plan and self.plan.checkpoint else None
        for line in keep_explicit_model_values(config, self._explicit, hparams or {}):
            rank_zero_info(line)
        for part in (config.model, config.data):  # after a random pick (seed_everything: true)
            if part.get("init_args") is not None and "seed" in part.init_args:
                part.init_args.seed = run_seed(config.seed_everything)
        for hook in self.defaults.tidy_hooks:
            hook(config)
        for hook in self.defaults.config_hooks:
            hook(config, self._explicit)
        if (job_id := slurm_job_id()) is not None and self.subcommand and self.plan is not None:
            print(task_line(job_id, self.plan.run_dir or config.trainer.default_root_dir), flush=True)

    def instantiate_trainer(self, **kwargs):
        init = self.config_init[self.subcommand] if self.subcommand else self.config_init
        config = self.config[self.subcommand] if self.subcommand else self.config
        trainer_config = init["trainer"]
        plugins = trainer_config.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            self._checkpoint_io = AtomicCheckpointIO(self.remote)
            plugins.append(self._checkpoint_io)
        if (environment := cluster_environment()) is not None:
            plugins.append(environment)
        if trainer_config.get("sync_batchnorm"):
            # Lightning's own plugin needs CUDA; this one picks torch's SyncBatchNorm or a gloo one at set-up.
            plugins.append(SyncBatchNormAnyBackend())
        trainer_config["plugins"] = plugins
        timeout = timedelta(minutes=config.get("ddp_timeout_minutes") or 10.0)
        strategy = trainer_config.get("strategy")
        if strategy in DDP_START_METHODS:
            trainer_config["strategy"] = DDPStrategy(timeout=timeout, start_method=DDP_START_METHODS[strategy])
        elif strategy in ("fsdp2", "fsdp2_sharded"):
            trainer_config["strategy"] = FSDPStrategy(timeout=timeout, sharded=strategy == "fsdp2_sharded")
        callbacks = list(trainer_config.get("callbacks") or [])
        own_bar = any(isinstance(c, ProgressBar) for c in callbacks)
        if trainer_config.get("enable_progress_bar", True) is not False and not own_bar:
            # Each refresh reads the logged tensors on the host (a GPU sync): only on logging steps.
            callbacks.append(StepProgressBar(refresh_rate=trainer_config.get("log_every_n_steps") or 50))
        trainer_config["callbacks"] = callbacks
        if trainer_config.get("enable_checkpointing") is False:
            # The checkpoint groups (best, last.ckpt) are callbacks too: without checkpointing, an inert one and the
            # stop signals alone (the Trainer refuses checkpoint callbacks with enable_checkpointing=false).
            init["checkpoint"] = Callback()
            init["last_checkpoint"] = StopSignals(init["last_checkpoint"].check_every_n_steps)
        # Any data module's plain loaders: exact evaluation and a resumable training order (classifier_engine.samplers).
        callbacks += [ExactLoaders(self.datamodule, run_seed(config.seed_everything)), CheckpointValues()]
        if self.subcommand == "fit" and config.get("global_batch_size"):
            callbacks.append(GlobalBatch(config.global_batch_size, planned_world_size(config.trainer),
                                         bool(trainer_config.get("sync_batchnorm"))))
        trainer = super().instantiate_trainer(**kwargs)
        skip_same_device_moves(trainer)  # self.log without Lightning's no-op move (classifier_engine/compat)
        trainer.callbacks.append(LeanBatchDispatch())  # and its per-batch dispatch without no-op hooks (the same)
        if trainer.loggers:  # LearningRateMonitor raises without a logger (Lightning #17159)
            trainer.callbacks.append(LearningRateMonitor(logging_interval="step"))
        check_process_count(trainer.world_size, trainer.num_devices, trainer.num_nodes)
        record_rank(trainer.global_rank, trainer.world_size)
        init_attempt_process_group(trainer.strategy, timeout)  # a torchrun restart must not meet the last one's keys
        return trainer

    def after_instantiate_classes(self) -> None:
        super().after_instantiate_classes()
        contract.check_data(self.datamodule)
        contract.check_model(self.model)
        resume_step = None
        if self.subcommand and self.plan and self.plan.ckpt_path is not None:
            # The plan's load, checked, then handed to Lightning's restore (the file is not read again); the plan
            # keeps no reference to it (its memory map goes with its last user).
            checkpoint, self.plan.checkpoint = self.plan.checkpoint, None
            check_checkpoint_fits(self.plan.ckpt_path, checkpoint, self.model, self.datamodule)
            if self.subcommand == "fit" and not self.plan.fresh:  # before the Trainer first touches its loggers
                resume_step = checkpoint["global_step"]
                continue_csv_logs(self.trainer.loggers, resume_step)
            elif self.subcommand != "fit":  # ModelCheckpoint's records are the fit's (its dir), not an evaluation's
                checkpoint["callbacks"] = {key: value for key, value in (checkpoint.get("callbacks") or {}).items()
                                           if not key.startswith(ModelCheckpoint.__name__)}
            if self._checkpoint_io is not None:
                self._checkpoint_io.hand_over(self.plan.ckpt_path, checkpoint)
        if self.subcommand == "fit" and self.plan and self.plan.run_dir is not None:
            outlive_outages(self.trainer, self.plan.run_dir, resume_step)  # MLflow (Lightning #12833)

    def fit(self, model, datamodule=None, **kwargs) -> None:
        with stops_reach_spawned_ranks(self.trainer):  # ddp_spawn: this process only waits for the ranks
            self.trainer.fit(model, datamodule=datamodule, **kwargs)
        stored = f" (stored in {self.remote.url_of(self.plan.run_dir)})" if self.remote and self.plan else ""
        rank_zero_info(where_the_run_went(self.trainer, self.plan.run_dir if self.plan else None) + stored)


    def predict(self, model, datamodule=None, **kwargs):
        """A data module without predict_dataloader() predicts the folder --predictions.images (the contract's)."""
        writer = next((c for c in self.trainer.callbacks if isinstance(c, PredictionCsvWriter)), None)
        if datamodule is None or is_overridden("predict_dataloader", datamodule, L.LightningDataModule):
            return self.trainer.predict(model, datamodule=datamodule, **kwargs)
        name = type(datamodule).__qualname__
        if writer is None or writer.images is None:
            raise ConfigError(f"data module {name} offers no predict_dataloader(): pass --predictions.images DIR (a "
                              "folder of images, read with its eval_preprocessing())")
        writer.class_names = contract.display_names(datamodule, model.hparams.get("num_classes"))
        dataset = ImagePathDataset(writer.images, transform=contract.eval_transform(datamodule))
        loader = DataLoader(dataset, batch_size=writer.batch_size)
        return self.trainer.predict(model, dataloaders=loader, **kwargs)


def where_the_run_went(trainer, run_dir: Optional[Path] = None) -> str:
    """The last line of a fit: the run dir (the plan's; else Lightning's), its checkpoints and how to look at it."""
    last = next((c.path for c in trainer.callbacks if isinstance(c, LastCheckpoint) and c.path), None)
    best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    score = trainer.checkpoint_callback.best_model_score if trainer.checkpoint_callback else None
    run_dir = Path(run_dir or trainer.log_dir or trainer.default_root_dir)
    parts = [f"run dir {run_dir}"]
    if best:
        monitored = f" ({trainer.checkpoint_callback.monitor} {float(score):.4f})" if score is not None else ""
        parts.append(f"best checkpoint {best}{monitored}")
    if last:
        parts.append(f"last {last}")
    if looks := how_to_look(trainer.loggers, run_dir):
        parts.append("look at it with: " + ", ".join(looks))
    return "; ".join(parts)


def cli_main(args: Optional[list[str]] = None, *, model: Optional[type] = None, data: Optional[type] = None,
             config_hooks: Sequence[ConfigHook] = (), tidy_hooks: Sequence[TidyHook] = (),
             run: bool = True) -> ProjectCLI:
    """LightningCLI over any LightningModule and LightningDataModule; `model` and `data` are the classes a config that
    names none builds (a template's). Tests call it in-process with a list of arguments."""
    record_rank(None)  # this run's Trainer records its own (a process may build several: notebooks, tests)
    return ProjectCLI(
        L.LightningModule, L.LightningDataModule, args=args, run=run, parser_class=ProjectParser,
        defaults=Defaults(model, data, tuple(config_hooks), tuple(tidy_hooks)),
        subclass_mode_model=True, subclass_mode_data=True,  # any module by class_path; the entry point's are defaults
        trainer_class=Trainer,  # Lightning's, with `limit_*_batches: 1` meaning one batch (classifier_engine/compat)
        seed_everything_default=42,  # fixed, so a resumed or requeued job continues the same data order
        auto_configure_optimizers=False,  # the model's configure_optimizers scales the LR: no --optimizer override
        save_config_callback=KeepingSaveConfigCallback,
        save_config_kwargs={"overwrite": True},  # a resumed run writes its config; the previous one is kept
        # Parse errors raise (main() prints them as one line) instead of printing the whole usage and exiting; every
        # YAML text read (nested config files too) is size- and alias-checked first.
        parser_kwargs={"prog": f"python -m {entry_module(model)}", "exit_on_error": False,
                       "parser_mode": LIMITED_YAML,
                       **{sub: {"exit_on_error": False} for sub in ("fit", "validate", "test", "predict")}},
    )


MORE_SUBCOMMANDS = """
  More subcommands (not LightningCLI's):
    export              A run's checkpoint as torch.export and ONNX files: python -m {prog} export --help
    sweep               Hyperparameter sweeps (Optuna), each trial a fit: python -m {prog} sweep --help"""


def entry_module(model: Optional[type] = None) -> str:
    """What `python -m` runs, for usage lines: the default model's package (a template's), else the library."""
    return model.__module__.partition(".")[0] if model is not None else "classifier_engine"


def main(argv: Optional[list[str]] = None, **defaults) -> None:
    """`python -m <package> {fit,validate,test,predict,export,sweep} ...`: `defaults` as cli_main takes them; user
    errors as one line and exit 2 (CLASSIFIER_ENGINE_DEBUG=1 shows the traceback)."""
    from classifier_engine.errors import check_config_files, exit_on_user_error
    from classifier_engine.run.stored_config import check_stored_configs

    given, argv = argv, sys.argv[1:] if argv is None else list(argv)
    with_defaults = partial(cli_main, **defaults)
    entry_classes = [f"{cls.__module__}.{cls.__qualname__}" for cls in (defaults.get("model"), defaults.get("data"))
                     if cls is not None]
    if argv[:1] == ["export"]:
        from classifier_engine.export import main as export_main

        exit_on_user_error(lambda: export_main(argv[1:], prog=f"python -m {entry_module(defaults.get('model'))}",
                                               trusted=entry_classes))
        return
    if argv[:1] == ["sweep"]:
        from classifier_engine.run.sweep import main as sweep_main

        exit_on_user_error(lambda: sweep_main(argv[1:], with_defaults))
        return

    def run() -> None:
        check_config_files(argv)
        check_stored_configs(argv, entry_classes)
        with_defaults(given)

    try:
        exit_on_user_error(run)
    finally:
        if argv in (["-h"], ["--help"]):  # LightningCLI lists its own subcommands only
            print(MORE_SUBCOMMANDS.format(prog=entry_module(defaults.get("model"))), flush=True)
    close_process_group()


def close_process_group() -> None:
    """Destroy a finished run's process group (torchrun, srun) before the interpreter exits: in its teardown, gloo's
    threads aborted a rank now and then ("terminate called without an active exception", exit -6)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # no rank tears down its sockets while another still talks to it
        dist.destroy_process_group()
