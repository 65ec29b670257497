"""last.ckpt, rewritten every few minutes, at epoch ends and on a stop signal (docs/reliability.md#what-a-stop-costs).

    python -m classifier_engine fit --config CONFIG --ckpt_path last      # continues at the next batch
"""

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, Checkpoint, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.multiprocessing import ProcessExitedException

from classifier_engine.compat.gloo_exit import leave_at_exit
from classifier_engine.compat.sigterm_broadcast import take_over_lightning_sigterm
from classifier_engine.compat.spawn import spawns_ranks
from classifier_engine.errors import CheckpointError, ConfigError, DataUnavailable, UserError
from classifier_engine.run.run_dirs import CHECKPOINTS, LAST
from classifier_engine.run.signals import STOP_SIGNALS, StopRequests, as_requested
from classifier_engine.run.slurm import requeue, slurm_job_id
from classifier_engine.run.training_steps import after_optimizer_step, validation_follows


class RunStopped(SystemExit):
    """The run stopped on a signal (after saving last.ckpt, if it saves); exit 143 (SIGTERM, SIGHUP) or 130 (SIGINT)."""


class StopSignals(Callback):
    """Stop signals taken over from Lightning (its flag-only exit 0; under ddp its broadcast and host read at every
    step): the ranks agree every check_every_n_steps and stop there. On its own (enable_checkpointing=false) it saves
    nothing; LastCheckpoint saves last.ckpt there too."""

    every_minutes: Optional[float] = None  # LastCheckpoint's timed and periodic saves
    every_n_steps: Optional[int] = None
    path: Optional[Path] = None  # LastCheckpoint's last.ckpt (None here: StopSignals alone saves nothing)

    def __init__(self, check_every_n_steps: int = 10):
        if check_every_n_steps < 1:
            raise ConfigError(f"last_checkpoint.check_every_n_steps must be >= 1, got {check_every_n_steps}")
        self.check_every_n_steps = check_every_n_steps
        self._stops: Optional[StopRequests] = None
        self._stopping: Optional[RunStopped] = None  # saved and said: raised once this step's metrics are logged
        self._last_save_time = 0.0
        self._cut_at: Optional[int] = None  # the step max_steps ended an epoch at, saved there

    # Lightning installs its handlers in Trainer._run, after every setup hook: ours at the sanity check or train start.
    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "fit":
            self._take_over_signals(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._take_over_signals(trainer)

    def _take_over_signals(self, trainer: L.Trainer) -> None:
        if self._stops is not None:
            return
        signums = STOP_SIGNALS + ((signal.SIGUSR1,) if slurm_job_id() is not None else ())
        # Ranks Lightning started itself may not get a SIGTERM sent to PID 1 (docker stop): rank 0 passes it on.
        kill = getattr(trainer.strategy.launcher, "kill", None) if trainer.is_global_zero else None
        self._stops = StopRequests(signums, forward=kill)
        # Lightning's flag, set if a SIGTERM came before this, is ours from now on (its per-step broadcast can go).
        if take_over_lightning_sigterm(trainer):
            self._stops.received = self._stops.received or signal.SIGTERM

    def _restore_handlers(self, *hook_args: Any, **hook_kwargs: Any) -> None:
        if self._stops is not None:
            self._stops.restore()
            self._stops = None

    # At train end, or on an exception: before Lightning restores the handlers it found (in its teardown, which runs
    # before the callbacks' teardown hooks); the other order would leave Lightning's SIGTERM handler installed.
    on_train_end = teardown = _restore_handlers

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore_handlers()
        # A data source that kept failing between two batches (the loader's position counts the batches trained):
        # the step reached is saved, and said in the error's line. One process only: under ddp the others are not here.
        if isinstance(exception, DataUnavailable) and trainer.world_size == 1 and trainer.training:
            self.keep_the_step(trainer, exception)

    def keep_the_step(self, trainer: L.Trainer, error: UserError, again: bool = False) -> None:
        """Save last.ckpt before `error` ends the fit, and say where in its line (errors.user_message reads `saved`);
        nothing when no step was trained or last.ckpt is off (enable_checkpointing=false). `again`: after a
        validation of a step already saved (its metrics)."""
        if self.path is not None and trainer.global_step > 0:
            error.saved = (f"saved {self._save(trainer, again)} at global step {trainer.global_step}: the same "
                           "command with --ckpt_path last continues there")

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        # Lightning logs a step's metrics after its on_train_batch_end: a stop raised there lost the step's train/loss.
        if self._stopping is not None:
            self._raise(trainer, self._stopping)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._stops is None or not after_optimizer_step(trainer, batch_idx):
            return
        step, distributed = trainer.global_step, trainer.world_size > 1
        if step == trainer.max_steps and batch_idx + 1 < trainer.num_training_batches:
            # max_steps ends the epoch here: saved as the middle of it (Lightning's epoch-end save marks the epoch
            # done, and a run continued with a larger max_steps would skip the rest of its samples)
            self._cut_at = step
            self._save(trainer)
            return
        # Not right before a validation: a run resumed from a checkpoint saved there would skip that validation
        # (Lightning fast-forwards it), so such saves and stops wait for the next batch or the epoch's end.
        if validation_follows(trainer, batch_idx):
            return
        checks = not distributed or step % self.check_every_n_steps == 0
        signum, time_due = self._agree(trainer, distributed) if checks else (0, False)
        if signum:
            self._stopping = self._stop(trainer, signum)
        elif time_due or (self.every_n_steps and step % self.every_n_steps == 0):
            self._save(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After the epoch's validation and ModelCheckpoint's save (Checkpoint callbacks run last, in list order).
        if self._stopping is not None:  # the stop step was the epoch's last
            self._raise(trainer, self._stopping)
        if self._stops is None:
            return
        # The epoch's sync_dist metrics are reduced by their first reader (rank 0's progress bar; the others have
        # none): read on every rank before _agree, or rank 0 waits there while the others wait in that reduce.
        trainer.callback_metrics  # noqa: B018
        self._save(trainer, again=self._cut_at != trainer.global_step)
        signum, _ = self._agree(trainer, trainer.world_size > 1)  # one that came in the last steps or the validation
        if signum:
            self._raise(trainer, self._stop(trainer, signum))

    @staticmethod
    def _raise(trainer: L.Trainer, stop: RunStopped) -> NoReturn:
        # A rank ddp_spawn started (in a training hook): its gloo threads must not abort its exit (compat/gloo_exit.py).
        # Not for a requeue's exit 0: an error after it would exit 0 too, and the parent ignores a rank's error then.
        if spawns_ranks(trainer) and stop.code:
            leave_at_exit(stop.code)
        raise stop

    def _agree(self, trainer: L.Trainer, distributed: bool) -> tuple[int, bool]:
        """(stop signal any rank got, 0 if none; rank 0's clock says a timed save is due), the same on all ranks."""
        signum = self._stops.received or (signal.SIGTERM if trainer.received_sigterm else 0)
        due = self.every_minutes is not None and time.monotonic() - self._last_save_time >= 60 * self.every_minutes
        if not distributed:
            return signum, due
        flags = torch.tensor([signum, float(due and trainer.is_global_zero)], device=trainer.strategy.root_device)
        flags = trainer.strategy.reduce(flags, reduce_op="max")
        signum, due = flags.tolist()  # the one host sync, every check_every_n_steps steps
        return int(signum), bool(due)

    def _save(self, trainer: L.Trainer, again: bool = False) -> Optional[Path]:
        return None  # enable_checkpointing=false

    def _stop(self, trainer: L.Trainer, signum: int) -> RunStopped:
        """Save (unless enable_checkpointing=false), requeue or say so; the exit to raise."""
        path = self._save(trainer)
        saved = f"saved {path}" if path else "saved nothing (enable_checkpointing=false)"
        name = signal.Signals(signum).name
        where = f"epoch {trainer.current_epoch}, global step {trainer.global_step}"
        if signum == signal.SIGUSR1 and (job_id := slurm_job_id()) is not None:
            code = 0
            if trainer.is_global_zero:
                requeued, why = requeue(job_id)
                if requeued:
                    rank_zero_info(f"Slurm job {job_id}: {name} at {where}; {saved}; requeued"
                                   + (", it resumes there" if path else ""))
                else:
                    code = 1
                    rank_zero_warn(f"Slurm job {job_id}: {name} at {where}; {saved}, but scontrol requeue failed "
                                   f"({why}): submit again" + (f" with --ckpt_path {path}" if path else ""))
            return RunStopped(code)
        bar = trainer.progress_bar_callback
        if trainer.is_global_zero and isinstance(bar, TQDMProgressBar) and bar.is_enabled:
            print(flush=True)  # the bar's line has no end while it is drawn: this line gets its own
        as_term = " (as SIGTERM)" if signum != as_requested(signum) else ""
        if path:  # where it is durable (an object store's URL once uploaded), and how long after the signal
            stored = getattr(trainer.strategy.checkpoint_io, "stored_at", str)(path)
            after = f", durable {time.monotonic() - self._stops.received_at:.1f} s after the signal" if (
                self._stops.received_at) else ""
            last = f"last checkpoint: {stored}{after} (continue with the same command and --ckpt_path last)"
        else:
            last = saved
        rank_zero_info(f"stopped by {name}{as_term} at {where}; {last}")
        return RunStopped(128 + as_requested(signum))


class LastCheckpoint(StopSignals, Checkpoint):
    """Keeps <run dir>/checkpoints/last.ckpt current (see the module docstring for when, and what a stop costs)."""

    def __init__(self, every_minutes: Optional[float] = 10.0, every_n_steps: Optional[int] = None,
                 check_every_n_steps: int = 10):
        """
        Args:
            every_minutes: rewrite last.ckpt after this many minutes of training (None: at epoch ends and stops only).
            every_n_steps: also rewrite it every this many optimizer steps (None: off).
            check_every_n_steps: under ddp, the ranks agree on stops and the time every this many optimizer steps
                (one tiny all-reduce); a single process checks every step, at no cost.
        """
        super().__init__(check_every_n_steps)
        self.every_minutes, self.every_n_steps = every_minutes, every_n_steps
        self.saved_at_step: Optional[int] = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # Each rank chose its checkpoint itself (resume.py); different ones would make their collectives disagree.
        chosen = trainer.strategy.broadcast(str(trainer.ckpt_path))
        if chosen != str(trainer.ckpt_path):
            raise CheckpointError(f"rank {trainer.global_rank} chose checkpoint {trainer.ckpt_path} but rank 0 chose "
                                  f"{chosen}: are the ranks seeing the same files (a shared filesystem's caching)?")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Beside ModelCheckpoint's (it resolves its folder in its own setup: known here; the CLI always has one).
        folders = [c.dirpath for c in trainer.callbacks if isinstance(c, ModelCheckpoint) and c.dirpath]
        folder = folders[0] if folders else Path(trainer.log_dir or trainer.default_root_dir, CHECKPOINTS)
        self.path = Path(trainer.strategy.broadcast(str(Path(folder) / LAST)))
        self._last_save_time = time.monotonic()
        super().on_train_start(trainer, pl_module)

    def _save(self, trainer: L.Trainer, again: bool = False) -> Path:
        """Write last.ckpt once a step; `again` (an epoch end) writes it after the validation too."""
        if again or self.saved_at_step != trainer.global_step:
            trainer.save_checkpoint(self.path, weights_only=False)
            self.saved_at_step, self._last_save_time = trainer.global_step, time.monotonic()
        return self.path


@contextmanager
def stops_reach_spawned_ranks(trainer: L.Trainer) -> Iterator[None]:
    """Around trainer.fit: under ddp_spawn this process only waits for the ranks it spawned, so a stop signal sent to
    it (docker stop, kill PID) is passed on to them (they save and stop as above) and it exits with their code."""
    if not spawns_ranks(trainer):
        yield
        return
    stops = StopRequests(STOP_SIGNALS, forward=trainer.strategy.launcher.kill)
    try:
        yield
    except ProcessExitedException as exited:
        if stops.received and exited.exit_code in (128 + signal.SIGTERM, 128 + signal.SIGINT):
            raise RunStopped(exited.exit_code) from None  # the ranks saved and said so
        raise
    finally:
        stops.restore()
