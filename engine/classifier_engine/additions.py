"""What a run adds to Lightning, on one screen: the plugins, the strategy, the callbacks, and the registered patches
(classifier_engine/compat: each with its upstream issue) for a config and its run plan.

    python -m classifier_engine fit --config CONFIG --plan      # the plan these are built from
"""

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any, Optional

import lightning as L
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.strategies import DDPStrategy

import classifier_engine.strategies  # noqa: F401  registers strategy="dp" before any Trainer is built
from classifier_engine import contract
from classifier_engine.callbacks.global_batch import GlobalBatch
from classifier_engine.callbacks.monitor_logged import MonitorLogged
from classifier_engine.callbacks.plan_file import PlanFile
from classifier_engine.callbacks.prediction_writer import PredictionCsvWriter
from classifier_engine.callbacks.progress_bar import StepProgressBar
from classifier_engine.callbacks.throughput import ThroughputLogger
from classifier_engine.compat.batch_dispatch import LeanBatchDispatch
from classifier_engine.compat.elastic_store import init_attempt_process_group
from classifier_engine.compat.log_device_move import skip_same_device_moves
from classifier_engine.config_edits import PARSE_LINKS, run_seed
from classifier_engine.errors import record_rank
from classifier_engine.options import PositiveInt
from classifier_engine.plan.settings import DDP_START_METHODS
from classifier_engine.run.checkpoint_checks import CheckpointValues
from classifier_engine.run.checkpoint_io import AtomicCheckpointIO
from classifier_engine.run.last_checkpoint import LastCheckpoint, StopSignals
from classifier_engine.run.launchers import check_process_count
from classifier_engine.run.slurm import cluster_environment
from classifier_engine.run.trackers import redact
from classifier_engine.run_plan import MONITOR, RunPlan
from classifier_engine.samplers import ExactLoaders
from classifier_engine.strategies.fsdp import FSDPStrategy
from classifier_engine.strategies.sync_batchnorm import SyncBatchNormAnyBackend


class EngineParser(LightningArgumentParser):
    def dump(self, cfg: Any, *args, **kwargs) -> str:  # --print_config and the saved config.yaml
        return redact(super().dump(cfg, *args, **kwargs))  # a URI's password (a run's moved to the environment)


def add_run_arguments(parser: LightningArgumentParser, model: Optional[type], data: Optional[type]) -> None:
    """The links (the class count, image sizes, the batch and the seed), the run's own options, and the callback
    groups every run has (`--checkpoint.*`, `--last_checkpoint.*`, `--throughput.*`, `--predictions.*`)."""
    # Links reach a class only when it has the argument (a class switch leaves link targets to the link).
    parser.link_arguments("data.num_classes", "model.init_args.num_classes", apply_on="instantiate")
    parser.link_arguments("data", "model.init_args.image_sizes", compute_fn=contract.image_sizes,
                          apply_on="instantiate")
    for source, target, compute in PARSE_LINKS:  # an edit of the source carries over too (config_edits.py)
        parser.link_arguments(source, target, **({"compute_fn": compute} if compute else {}))
    parser.set_defaults({key: {"class_path": f"{cls.__module__}.{cls.__qualname__}"}
                         for key, cls in (("model", model), ("data", data)) if cls})
    parser.add_argument("--ddp_timeout_minutes", type=float, default=10.0,
                        help="ddp(_spawn, _fork), fsdp2(_sharded): a rank that stops answering ends the job after this "
                             "long (torch's default is 30 minutes)")
    parser.add_argument("--global_batch_size", type=Optional[PositiveInt], default=None,
                        help="fit: images per optimizer step at any world size (data.batch_size: the most per process; "
                             "the accumulation follows): a resume on another number of GPUs is exact")
    # Checkpoint callbacks: the best by the model's Monitor (ModelCheckpoint), then last.ckpt, which saves after.
    parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
    parser.add_lightning_class_args(LastCheckpoint, "last_checkpoint")
    parser.add_lightning_class_args(ThroughputLogger, "throughput")
    # `predict` writes a CSV (--predictions.output); in the other subcommands the callback does nothing.
    parser.add_lightning_class_args(PredictionCsvWriter, "predictions")
    parser.set_defaults({"checkpoint.auto_insert_metric_name": False, **contract.monitor_options(model)})


@dataclass
class Additions:
    trainer: dict[str, Any]  # Trainer arguments replaced: plugins, strategy, callbacks
    groups: dict[str, Callback]  # the CLI's callback groups replaced (checkpointing off: inert ones)
    checkpoint_io: Optional[AtomicCheckpointIO]  # ours, when the config names no CheckpointIO plugin
    patches: tuple[Callable[[L.Trainer], object], ...]  # the registered workarounds and checks, on the built Trainer


def additions(trainer: dict[str, Any], groups: dict[str, Any], config: Any, plan: RunPlan, datamodule: Any,
              remote: Any = None) -> Additions:
    """`trainer`, `groups`: the instantiated Trainer arguments and callback groups; `config`: the parsed one."""
    timeout = timedelta(minutes=config.get("ddp_timeout_minutes") or 10.0)
    plugins = trainer.get("plugins") or []
    plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    checkpoint_io = None
    if not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
        checkpoint_io = AtomicCheckpointIO(remote)
        plugins.append(checkpoint_io)
    if (environment := cluster_environment()) is not None:
        plugins.append(environment)
    if trainer.get("sync_batchnorm"):  # Lightning's own plugin needs CUDA: torch's SyncBatchNorm or a gloo one
        plugins.append(SyncBatchNormAnyBackend())
    strategy = trainer.get("strategy")  # as the config holds it: a template's pass may have set it after the world's
    if isinstance(strategy, str) and strategy in DDP_START_METHODS:
        strategy = DDPStrategy(timeout=timeout, start_method=DDP_START_METHODS[strategy])
    elif strategy in ("fsdp2", "fsdp2_sharded"):
        strategy = FSDPStrategy(timeout=timeout, sharded=strategy == "fsdp2_sharded")
    callbacks = list(trainer.get("callbacks") or [])
    if trainer.get("enable_progress_bar", True) is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
        # Each refresh reads the logged tensors on the host (a GPU sync): only on logging steps.
        callbacks.append(StepProgressBar(refresh_rate=trainer.get("log_every_n_steps") or 50))
    # Any data module's plain loaders: exact evaluation and a resumable training order (classifier_engine.samplers).
    # The seed as the config holds it: a template's pass may set seed_everything after the seed's own decision.
    callbacks += [ExactLoaders(datamodule, run_seed(config.seed_everything)), CheckpointValues(), PlanFile(plan),
                  LeanBatchDispatch()]
    if plan.global_batch is not None:  # (decided for a fit only)
        callbacks.append(GlobalBatch(plan.global_batch, plan.world_size, bool(trainer.get("sync_batchnorm"))))
    monitor = plan.value(MONITOR)
    if monitor and plan.subcommand == "fit" and trainer.get("enable_checkpointing") is not False:
        callbacks.append(MonitorLogged(monitor["metric"]))
    if trainer.get("logger") not in (False, []):  # LearningRateMonitor raises without a logger (Lightning #17159)
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    replaced = {}
    if trainer.get("enable_checkpointing") is False:
        # The checkpoint groups (best, last.ckpt) are callbacks too: without checkpointing, an inert one and the stop
        # signals alone (the Trainer refuses checkpoint callbacks with enable_checkpointing=false).
        every = groups["last_checkpoint"].check_every_n_steps
        replaced = {"checkpoint": Callback(), "last_checkpoint": StopSignals(every)}
    patches = (skip_same_device_moves,  # self.log without Lightning's no-op move (compat/log_device_move.py)
               partial(init_attempt_process_group, timeout=timeout),  # compat/elastic_store.py: torchrun restarts
               _checked)
    return Additions({"plugins": plugins, "strategy": strategy, "callbacks": callbacks}, replaced, checkpoint_io,
                     patches)


def _checked(trainer: L.Trainer) -> None:
    """The built Trainer against its launcher (the process count), and this process's rank for the error line."""
    check_process_count(trainer.world_size, trainer.num_devices, trainer.num_nodes)
    record_rank(trainer.global_rank, trainer.world_size)
