"""Callbacks that stop a real run the way the world does (tests pass them with --trainer.callbacks+=...).

    --trainer.callbacks+='{"class_path": "stop_callbacks.SignalAtStep", "init_args": {"step": 3, "signum": 9}}'

Importable by `python -m classifier_engine` (or a template's) subprocesses when this folder is on PYTHONPATH
(run_project does that).
"""

import os
import signal
import time
from pathlib import Path

import lightning as L


class SignalAtStep(L.Callback):
    """Sends `signum` to this process (rank `rank` only) when optimizer step `step` is about to start, i.e. right
    after step `step` - 1 ended and any checkpoint due at that batch end was written."""

    def __init__(self, step: int, signum: int = int(signal.SIGKILL), rank: int = 0, group: bool = False):
        self.step, self.signum, self.rank, self.group = step, signum, rank, group

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            if self.group:  # as Slurm, systemd or a terminal do: the whole process group, DataLoader workers included
                os.killpg(os.getpgid(0), self.signum)
            else:
                os.kill(os.getpid(), self.signum)


class HoldUntilSignalled(L.Callback):
    """Holds rank `rank` as optimizer step `step` is about to start, writes `marker`, and waits there until a stop
    signal has reached this process (classifier_engine.run.last_checkpoint's flag): the test then signals a run that is
    provably still training, however long the signal takes to arrive."""

    def __init__(self, step: int, marker: str, rank: int = 0, timeout_s: float = 600):
        self.step, self.marker, self.rank, self.timeout_s = step, marker, rank, timeout_s

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != self.step or trainer.global_rank != self.rank:
            return
        Path(self.marker).write_text(f"{os.getpid()}\n")
        deadline = time.monotonic() + self.timeout_s
        while not any(getattr(getattr(c, "_stops", None), "received", 0) for c in trainer.callbacks):
            if time.monotonic() > deadline:
                raise RuntimeError(f"HoldUntilSignalled: no stop signal within {self.timeout_s} s")
            time.sleep(0.05)


class WaitAtTrainStart(L.Callback):
    """Every rank writes `marker`.<rank> as training starts (after the sanity check, before the first batch is read)
    and waits there for `marker`.go: the test sets the stage (e.g. busy cores) for the first step only."""

    def __init__(self, marker: str, timeout_s: float = 900):
        self.marker, self.timeout_s = marker, timeout_s

    def on_train_start(self, trainer, pl_module):
        Path(f"{self.marker}.{trainer.global_rank}").write_text(f"{os.getpid()}\n")
        deadline = time.monotonic() + self.timeout_s
        while not Path(f"{self.marker}.go").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"WaitAtTrainStart: no {self.marker}.go within {self.timeout_s} s")
            time.sleep(0.05)


class SlowSteps(L.Callback):
    """Each optimizer step takes `seconds` longer (a sleep before it): a tiny model trains as slowly as a real one, so
    a signal a test sends once a checkpoint appears reaches the run before the next epoch ends."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        time.sleep(self.seconds)


class StopAfterEpoch(L.Callback):
    """Stops fit gracefully after `epoch` (what a run with a shorter max_epochs leaves behind)."""

    def __init__(self, epoch: int = 0):
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            trainer.should_stop = True


class SaveAtStep(L.Callback):
    """Saves a checkpoint to `path` once `step` optimizer steps are done (every rank calls it: a collective)."""

    def __init__(self, step: int, path: str):
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and not Path(self.path).exists():
            trainer.save_checkpoint(self.path)


class KillServerAtStep(L.Callback):
    """Kills process group `pgid` (a server the run talks to: a tracker, an object store) with SIGKILL as optimizer
    step `step` is about to start, and waits until 127.0.0.1:`port` refuses connections."""

    def __init__(self, step: int, pgid: int, port: int):
        self.step, self.pgid, self.port = step, pgid, port

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and trainer.global_rank == 0:
            import socket

            os.killpg(self.pgid, signal.SIGKILL)
            for _ in range(600):
                try:
                    socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                except OSError:
                    return
                time.sleep(0.05)


class TakeOverLeaseAtStep(L.Callback):
    """At optimizer step `step`, another node takes the run dir's lease over (`aws s3 cp` of its own lease, as a start
    does after this run's renewals lapsed), then this run stalls `stall` seconds: its next renewal finds the lease
    replaced."""

    def __init__(self, step: int, key: str, stall: float):
        self.step, self.key, self.stall = step, key, stall

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and trainer.global_rank == 0:
            import json

            import boto3

            body = json.dumps({"holder": "pid 4242 on node7", "renewed": time.time()}).encode()
            boto3.session.Session().client("s3").put_object(Bucket="runs", Key=self.key, Body=body)
            time.sleep(self.stall)
