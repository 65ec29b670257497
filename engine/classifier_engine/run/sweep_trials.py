"""A sweep's workers: each takes a trial of the shared study, runs it as a fit and tells the result (docs/sweeps.md).

    python -m classifier_engine sweep --config SWEEP.yaml  # one worker; start more, anywhere, to share
"""

import contextlib
import ctypes
import errno
import fcntl
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import lightning as L
import optuna
import yaml
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info
from optuna.exceptions import ExperimentalWarning, UpdateFinishedTrialError
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.storages.journal import JournalFileSymlinkLock
from optuna.trial import TrialState

from classifier_engine.errors import DiskFullError, RunDirInUse
from classifier_engine.run.lock import claim
from classifier_engine.run.slurm import slurm_job_id
from classifier_engine.run.trackers import kind_of

# Trial attributes in the storage: the run dir, who runs it, and what the fit said about itself.
RUN_DIR, WORKER, HEARTBEAT = "run_dir", "worker", "heartbeat"
PRUNED_AT, FINISHED, CHECKPOINT, BEST, DIVERGED = "pruned_at_step", "finished_at_step", "checkpoint", "best", "diverged"
LOGGED = "metrics_logged"  # what a trial's fit logged at validation when the sweep's metric was not among them


def open_storage(storage: str):
    """An RDB URL (`sqlite:///x.db`, `postgresql://...`) or a journal file (shared filesystem for many hosts)."""
    if "://" in storage:
        return optuna.storages.RDBStorage(storage)
    return optuna.storages.JournalStorage(JournalFile(storage))


class JournalFile(optuna.storages.journal.JournalFileBackend):
    """Optuna's journal file, readable after a write cut short (kill -9, full disk): Optuna skips a partial last
    record but appends after it, and the joined line never parses again. Here a partial last record is moved to
    `<journal>.cut` before the next append, and a failed append is undone."""

    def __init__(self, path: str):
        self.path, self.lock = path, JournalFileSymlinkLock(path)
        super().__init__(path, lock_obj=self.lock)

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        data = "".join(json.dumps(log, separators=(",", ":")) + "\n" for log in logs).encode()
        try:
            self.lock.acquire()
            try:
                with open(self.path, "ab+", buffering=0) as file:  # O_APPEND: after a cut record is truncated, too
                    fd = file.fileno()
                    end = os.lseek(fd, 0, os.SEEK_END)
                    if end and os.pread(fd, 1, end - 1) != b"\n":  # a worker killed while writing its last record
                        journal = os.pread(fd, end, 0)  # rare enough to read it whole
                        end = journal.rfind(b"\n") + 1
                        with open(f"{self.path}.cut", "ab") as cut:
                            cut.write(journal[end:] + b"\n")
                        os.ftruncate(fd, end)
                        print(f"sweep: {self.path} ended in a record cut short (a worker killed while writing): "
                              f"moved to {self.path}.cut", flush=True)
                    try:
                        while data:
                            data = data[file.write(data):]
                        os.fsync(fd)
                    except OSError:
                        os.ftruncate(fd, end)  # no half record left for the next append to join
                        raise
            finally:
                self.lock.release()
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(f"no space left for the study's journal {self.path}: nothing of it was lost; "
                                    "free some space and start the worker again") from None
            raise


def tell(study: optuna.Study, trial, *args, **kwargs) -> None:
    """study.tell; GridSampler calls study.stop() once its grid is used up, which raises outside study.optimize
    (optuna 5.0), after the trial was stored (optuna/study/_tell.py): the sweep counts trials itself."""
    try:
        study.tell(trial, *args, **kwargs)
    except RuntimeError as error:
        if "Study.stop" not in str(error):
            raise


# -- inside the trial's fit ------------------------------------------------------------------------------------------
class SweepReporter(Callback):
    """Reports `metric` to the trial at each validation and stops the fit when the study's pruner prunes it; the sweep
    adds it to each trial's fit (`--trainer.callbacks+=`): rank zero reports and decides, every rank stops."""

    def __init__(self, storage: str, study: str, trial: int, metric: str,
                 pruner: Optional[optuna.pruners.BasePruner] = None):
        """`pruner`: the sweep's, None for Optuna's default."""
        self.storage, self.study, self.trial, self.metric, self.pruner = storage, study, trial, metric, pruner
        self._trial: Optional[optuna.trial.Trial] = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or not trainer.is_global_zero:
            return
        storage = open_storage(self.storage)
        study = optuna.load_study(study_name=self.study, storage=storage, pruner=self.pruner,
                                  sampler=optuna.samplers.RandomSampler())  # samples nothing here
        study_id = storage.get_study_id_from_name(self.study)
        self._trial = optuna.trial.Trial(study, storage.get_trial_id_from_study_id_trial_number(study_id, self.trial))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        stop = False
        if self._trial is not None:
            try:
                stop = self._report(trainer)
            except UpdateFinishedTrialError:  # the study gave the trial up: its worker stops this fit
                self._trial = None
        if trainer.world_size > 1:
            stop = trainer.strategy.broadcast(stop, src=0)  # once per validation, not per step
        if stop:
            trainer.should_stop = True

    def _report(self, trainer: L.Trainer) -> bool:
        """Report the metric; True when the trial should stop (pruned, diverged, or the metric is not logged)."""
        metrics = trainer.callback_metrics
        if self.metric not in metrics:  # a metric the model does not log: no trial can be scored
            self._trial.set_user_attr(LOGGED, sorted(k for k in metrics if not k.startswith("train/")))
            return True
        # One validation per epoch (the usual case): the step is the epoch, so a pruner's warm-up counts epochs.
        per_epoch = isinstance(trainer.val_check_interval, float) and trainer.val_check_interval == 1.0
        step, value = trainer.current_epoch if per_epoch else trainer.global_step, float(metrics[self.metric])
        losses = {k: float(v) for k, v in metrics.items() if k.endswith("loss") and v.numel() == 1}
        bad = next((f"{k} {v}" for k, v in ((self.metric, value), *losses.items()) if not math.isfinite(v)), None)
        if bad is not None:  # a diverged trial fails; its accuracy (argmax of NaN logits) must not rank it
            self._trial.set_user_attr(DIVERGED, f"{bad} at step {step}")
            rank_zero_info(f"sweep: trial {self.trial} diverged: {bad} at step {step}")
            return True
        self._trial.report(value, step)  # a validation re-run after a resume: its step is ignored
        if self._trial.should_prune():
            self._trial.set_user_attr(PRUNED_AT, step)
            rank_zero_info(f"sweep: trial {self.trial} pruned at step {step} ({self.metric} {value:.4f})")
            return True
        return False

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Not reached when the fit stops on a signal (run/last_checkpoint.py raises): the worker retries it then.
        if self._trial is None:
            return
        best = [c.best_model_path for c in trainer.callbacks
                if isinstance(c, ModelCheckpoint) and c.monitor == self.metric]
        last = Path(trainer.default_root_dir, "checkpoints", "last.ckpt")
        with contextlib.suppress(UpdateFinishedTrialError):
            self._trial.set_user_attr(CHECKPOINT, (best[0] if best else "") or (str(last) if last.is_file() else ""))
            self._trial.set_user_attr(FINISHED, trainer.global_step)


# -- the worker ------------------------------------------------------------------------------------------------------
@dataclass
class Worker:
    """One worker of a study: its settings, and the fit options every trial starts from."""

    study: optuna.Study
    storage: str
    study_dir: Path
    fit_options: str  # YAML: the sweep's fit config, as the fit's parser resolved it
    sweep: Any  # the checked `sweep:` settings (classifier_engine.run.sweep.Sweep)
    entry: str  # what each trial runs: python -m ENTRY fit (the sweep's own entry point)

    def __post_init__(self):
        self.name, self.signal, self.child = f"{os.uname().nodename}:{os.getpid()}", 0, None
        self.loggers = yaml.safe_load(self.fit_options)["trainer"]["logger"]  # pointed at each trial's run dir
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExperimentalWarning)  # unchanged since optuna 2.8
            self.retry = RetryHeartbeatStaleTrialCallback(max_retry=self.sweep.max_retry,
                                                          inherit_intermediate_values=True)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signal = self.signal or signum
        # Not SIGINT: a terminal sent it to the fit already, and a second one would mean "stop without saving".
        if self.child is not None and self.child.poll() is None and signum != signal.SIGINT:
            # A fit outside Slurm has no SIGUSR1 handler (it would die of it): it gets a SIGTERM instead.
            self.child.send_signal(signum if signum == signal.SIGTERM or slurm_job_id() else signal.SIGTERM)

    def run(self) -> int:
        """Take and run trials until the study has n_trials; the exit code (128 + signal when stopped by one)."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
        try:
            while not self.signal and (trial := self._take_next()) is not None:
                if trial is False:  # the other workers' trials fill the study: wait, in case one of them dies
                    time.sleep(min(self.sweep.heartbeat_interval, 5.0))
                elif (code := self._run(trial)) is not None:
                    return code
            return 0 if self.signal in (0, signal.SIGUSR1) else 128 + self.signal
        finally:
            for signum, handler in previous.items():  # (None: one installed from C, which Python cannot put back)
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def _take_next(self):
        """Under the study's lock: the next trial (a retry first), False while running ones fill it, None once done."""
        with open(self.study_dir / ".sweep.lock", "a") as lock:
            with contextlib.suppress(OSError):  # no POSIX locks: the count may overshoot by a trial per worker
                fcntl.lockf(lock, fcntl.LOCK_EX)
            now = time.time()
            for frozen in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                beat = frozen.user_attrs.get(HEARTBEAT) or frozen.datetime_start.timestamp()
                if now - beat > self.sweep.grace_period:
                    print(f"sweep: trial {frozen.number} has had no heartbeat for {now - beat:.0f} s (its worker "
                          f"{frozen.user_attrs.get(WORKER, '?')} died?): retried from its last.ckpt", flush=True)
                    self._fail_and_retry(frozen)
            trials = self.study.get_trials(deepcopy=False)
            # Done: complete, pruned, and failed trials that are not being retried.
            retried = {n for t in trials for n in t.system_attrs.get("retry_history", [])}
            done = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED)
                       or (t.state == TrialState.FAIL and t.number not in retried) for t in trials)
            if done + sum(t.state == TrialState.RUNNING for t in trials) >= self.sweep.n_trials:
                return None if done >= self.sweep.n_trials else False
            trial = self.study.ask()
            trial.set_user_attr(HEARTBEAT, time.time())
            trial.set_user_attr(WORKER, self.name)
            if RUN_DIR not in trial.user_attrs:  # a retry keeps its original's run dir
                trial.set_user_attr(RUN_DIR, str(self.study_dir / f"trial_{trial.number}"))
            return trial

    def _fail_and_retry(self, frozen) -> None:
        try:
            tell(self.study, frozen.number, state=TrialState.FAIL)
        except (ValueError, RuntimeError, UpdateFinishedTrialError):
            return  # finished meanwhile, by its worker or by another one
        self.retry(self.study, frozen)  # (only its __init__ is experimental)

    def _run(self, trial: optuna.trial.Trial) -> Optional[int]:
        """Run one trial and tell its result; an exit code when this worker must stop (bad input), else None."""
        frozen = self.study.get_trials(deepcopy=False)[trial.number]
        said, retried = frozen.user_attrs, frozen.system_attrs.get("failed_trial")
        run_dir, metric = Path(said[RUN_DIR]), self.sweep.metric
        params = {name: suggest(trial, name, spec) for name, spec in self.sweep.space.items()}
        code = None if self.signal else 0
        if not self.signal and FINISHED not in said and PRUNED_AT not in said:  # (else its worker died after the fit)
            print(f"sweep: trial {trial.number} ({' '.join(param_flags(params))}) in {run_dir}"
                  + (f", retrying trial {retried} from its last.ckpt" if retried is not None else ""), flush=True)
            code = self._fit(trial, run_dir, params, resume=retried is not None)
        frozen, log = self.study.get_trials(deepcopy=False)[trial.number], run_dir / "fit.log"
        finite = [v for v in frozen.intermediate_values.values() if v == v]  # NaN is never best
        best = (max if self.study.direction.name == "MAXIMIZE" else min)(finite, default=None)
        if best is not None:
            trial.set_user_attr(BEST, best)
        said, state = frozen.user_attrs, TrialState.FAIL
        if DIVERGED in said:
            line = f"failed: it diverged ({said[DIVERGED]}; a smaller learning rate?); log {log}"
        elif PRUNED_AT in said:
            line, state = f"pruned ({metric} {best:.4f} at best)", TrialState.PRUNED
        elif FINISHED in said and best is not None:
            line, state = f"complete: {metric} {best:.4f}", TrialState.COMPLETE
        elif FINISHED in said:
            line = f"failed: its fit never logged {metric} (validation off? trainer.check_val_every_n_epoch); log {log}"
        elif self.signal or code is None or code in (0, 130, 143) or code < 0:
            # Stopped from outside (preempted, killed, a Slurm requeue): whichever worker takes it next continues it.
            self._fail_and_retry(frozen)
            print(f"sweep: trial {trial.number} stopped (fit exit {code}): the next worker continues it from "
                  f"{run_dir / 'checkpoints' / 'last.ckpt'}", flush=True)
            if code == 0 and not self.signal:  # its fit requeued this Slurm job: this worker ends with the job
                self.signal = signal.SIGUSR1
            return None
        else:
            line = f"failed (fit exit {code}): {last_line(log)} (log {log})"
        tell(self.study, trial, best if state == TrialState.COMPLETE else None, state=state)
        if LOGGED in said and best is None:  # a metric the model never logs: every trial would end so
            print(f"error: sweep.metric {metric!r} is never logged: trial {trial.number}'s fit logs "
                  f"{', '.join(said[LOGGED]) or 'nothing'} at its validation; pass one of them with --sweep.metric",
                  file=sys.stderr, flush=True)
            return 2
        if code == 2 and FINISHED not in said:  # bad input, which every trial would stop on
            print(f"error: trial {trial.number} stopped on bad input: {last_line(log)} (log {log})", file=sys.stderr,
                  flush=True)
            return 2
        print(f"sweep: trial {trial.number} {line}", flush=True)
        return None

    def _fit(self, trial: optuna.trial.Trial, run_dir: Path, params: dict, *, resume: bool) -> Optional[int]:
        """The fit's exit code; None when it could not start (its run dir still in use)."""
        if not wait_for_run_dir(run_dir, self.sweep.grace_period):
            print(f"sweep: {run_dir} is still in use by another fit after {self.sweep.grace_period:.0f} s", flush=True)
            return None
        options = run_dir / "fit_options.yaml"
        options.write_text(self.fit_options)
        reporter = {"class_path": f"{__name__}.SweepReporter",
                    "init_args": {"storage": self.storage, "study": self.study.study_name, "trial": trial.number,
                                  "metric": self.sweep.metric, "pruner": self.sweep.pruner}}
        pinned = pin_loggers(self.loggers, run_dir)
        args = [f"--config={options}", *param_flags(params), f"--trainer.default_root_dir={run_dir}",
                f"--checkpoint.dirpath={run_dir / 'checkpoints'}", "--trainer.callbacks+=" + json.dumps(reporter),
                *([f"--trainer.logger={json.dumps(pinned)}"] if pinned else []),
                *(["--ckpt_path=last"] if resume else [])]
        with open(run_dir / "fit.log", "ab") as log:
            self.child = subprocess.Popen([*shlex.split(self.sweep.launcher or ""), sys.executable, "-m", self.entry,
                                           "fit", *args], stdout=log, stderr=subprocess.STDOUT,
                                          preexec_fn=_stop_with_parent, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            if self.signal and self.signal != signal.SIGINT:  # it came while the fit was starting
                self._on_signal(self.signal, None)
            while True:  # the trial's heartbeat while its fit runs
                with contextlib.suppress(subprocess.TimeoutExpired):
                    return self.child.wait(timeout=self.sweep.heartbeat_interval)
                try:
                    trial.set_user_attr(HEARTBEAT, time.time())
                except UpdateFinishedTrialError:  # this worker was silent past the grace period: a retry continues it
                    self.child.terminate()
                    return self.child.wait()
                except Exception as error:  # noqa: BLE001  a storage hiccup: the next beat may get through
                    print(f"sweep: heartbeat of trial {trial.number} not recorded ({error})", flush=True)
        finally:
            self.child = None


def int_range(spec: dict) -> bool:
    """A range written in ints (`{low: 0, high: 3}`) is one of ints; `{low: 0.0, high: 3.0}` is of floats."""
    return all(isinstance(spec.get(k, 1), int) and not isinstance(spec.get(k), bool) for k in ("low", "high", "step"))


def suggest(trial: optuna.trial.Trial, name: str, spec: dict) -> Any:
    """The trial's value for one search-space entry (a retried trial gets its original's)."""
    if "choices" in spec:
        return trial.suggest_categorical(name, spec["choices"])
    options = {k: spec[k] for k in ("step", "log") if spec.get(k) is not None}
    return (trial.suggest_int if int_range(spec) else trial.suggest_float)(name, spec["low"], spec["high"], **options)


def param_flags(params: dict[str, Any]) -> list[str]:
    """`--model.lr=0.1` for each parameter: what the fit gets, and what the summary prints."""
    return [f"--{name}={value if isinstance(value, str) else json.dumps(value)}" for name, value in params.items()]


def pin_loggers(loggers: Any, run_dir: Path) -> Any:
    """trainer.logger with its TensorBoard/CSV loggers writing into the run dir itself (the default logger: a
    TensorBoardLogger there); None to keep it as configured (W&B, MLflow: one tracked run per trial by themselves).
    Their version is "" so that `--ckpt_path last` looks into this run dir only, never into the other trials'."""
    here = {"save_dir": str(run_dir), "name": "", "version": ""}
    if loggers in (None, True):
        return {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": here}
    items = loggers if isinstance(loggers, list) else [loggers]
    ours = [isinstance(i, dict) and kind_of(i) in ("tensorboard", "csv") for i in items]
    if not any(ours):
        return None
    pinned = [{**i, "init_args": {**(i.get("init_args") or {}), **here}} if o else i for i, o in zip(items, ours)]
    return pinned if isinstance(loggers, list) else pinned[0]


def wait_for_run_dir(run_dir: Path, timeout: float) -> bool:
    """Wait until no live process holds the run dir (a dead worker's fit saves and stops first); False at `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            claim(run_dir).release()
            return True
        except RunDirInUse:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)


def last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][:300] if lines else "(empty log)"


def _stop_with_parent() -> None:
    """In the fit's process, before it starts: a SIGTERM when the worker dies (kill -9 too), so it saves and stops."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
