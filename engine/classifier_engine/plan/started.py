"""A run plan carried out: what a start holds from its plan to its end (the checkpoint it read, the run dir's lock,
an object store's lease), handed over to the built classes, released at the end.

    python -m classifier_engine fit --config CONFIG --ckpt_path last
"""

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from classifier_engine import contract
from classifier_engine.compat.spawn import spawns_ranks
from classifier_engine.errors import env_global_rank, is_peer_failure, user_message
from classifier_engine.run.checkpoint_checks import check_checkpoint_fits
from classifier_engine.run.lock import RunLock
from classifier_engine.run.remote_runs import RemoteRoot
from classifier_engine.run.resume import Choice
from classifier_engine.run.slurm import slurm_job_id, task_line
from classifier_engine.run.tracker_outage import outlive_outages
from classifier_engine.run.trackers import continue_csv_logs
from classifier_engine.run_plan import RunPlan


@dataclass
class Started:
    """The plan, the checkpoint it read (handed to Lightning once), and what the start holds until close()."""

    plan: RunPlan
    checkpoint: Optional[dict[str, Any]] = None
    lock: Optional[RunLock] = None
    remote: Optional[RemoteRoot] = None
    reads: dict = field(default_factory=dict)

    @property
    def ckpt_path(self) -> Optional[Path]:
        return Path(self.plan.ckpt_path) if self.plan.ckpt_path else None

    @property
    def run_dir(self) -> Optional[Path]:
        return Path(self.plan.run_dir) if self.plan.run_dir else None

    @property
    def fresh(self) -> bool:
        return self.plan.fresh

    @property
    def reason(self) -> str:
        """Why this checkpoint (or none)."""
        return (self.reads.get("choice") or Choice()).reason

    @property
    def skipped(self) -> tuple[tuple[Path, str], ...]:
        return (self.reads.get("choice") or Choice()).skipped

    def take_over(self, trainer: L.Trainer, model: L.LightningModule, datamodule: Any, checkpoint_io: Any) -> None:
        """Once the classes are built: they checked against the contract, the plan's checkpoint against them, then
        handed to Lightning's restore (the file is not read again; the start keeps no reference to it, so its memory
        map goes with its last user)."""
        if (job_id := slurm_job_id()) is not None and self.run_dir is not None:  # which task writes where, in its log
            print(task_line(job_id, self.run_dir), flush=True)
        contract.check_data(datamodule)
        contract.check_model(model, getattr(datamodule, "num_classes", None))
        checkpoint, self.checkpoint, subcommand = self.checkpoint, None, self.plan.subcommand
        self.reads.pop("checkpoint", None)  # the plan's passes read it: the map of a replaced last.ckpt would hold
        if (choice := self.reads.get("choice")) is not None:  # its disk space until the run ends
            self.reads["choice"] = replace(choice, checkpoint=None)
        if checkpoint is not None and self.ckpt_path is not None:  # a template's pass may have dropped the path
            check_checkpoint_fits(self.ckpt_path, checkpoint, model, datamodule)
            if subcommand == "fit" and not self.plan.fresh:  # before the Trainer first touches its loggers
                continue_csv_logs(trainer.loggers, checkpoint["global_step"])
            elif subcommand != "fit":  # ModelCheckpoint's records are the fit's (its dir), not an evaluation's
                checkpoint["callbacks"] = {key: value for key, value in (checkpoint.get("callbacks") or {}).items()
                                           if not key.startswith(ModelCheckpoint.__name__)}
            if checkpoint_io is not None:
                checkpoint_io.hand_over(self.ckpt_path, checkpoint)
        if subcommand == "fit" and self.run_dir is not None:
            resumed = checkpoint["global_step"] if checkpoint is not None and not self.plan.fresh else None
            outlive_outages(trainer, self.run_dir, resumed)  # MLflow (Lightning #12833)

    def close(self, error: Optional[BaseException] = None, trainer: Optional[L.Trainer] = None,
              failed: bool = False) -> None:
        """Release what the start holds; after a start that `failed` or whose `error` left nothing worth keeping
        (before the Trainer existed, or bad input here or on another rank before the first step; a crash or Ctrl+C
        keeps its logs; ddp_spawn's parent never trains), remove what it created."""
        if error is not None and not failed and not (isinstance(error, SystemExit) and not error.code):
            bad_input = user_message(error) is not None or is_peer_failure(error)
            failed = trainer is None or (trainer.global_step == 0 and bad_input and not isinstance(
                error, KeyboardInterrupt) and not spawns_ranks(trainer))
        if self.lock is not None:
            if failed:
                self.lock.remove_failed_start()
            self.lock.release()
        if self.remote is not None:  # what the run wrote since its last save (logs), then the lease
            if self.run_dir is not None and env_global_rank() == 0:
                self.remote.sync(self.run_dir)
            self.remote.release()
