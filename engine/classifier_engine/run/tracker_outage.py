"""Training outlives its tracker: what an MLflow server that stopped answering could not take is kept in the run dir and
sent when it answers again, or at the next start (docs/reliability.md#trackers).

    python -m classifier_engine fit --config CONFIG --config MLFLOW.yaml --ckpt_path last
"""

import json
import os
import re
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

from classifier_engine.run.trackers import PENDING, bare, health_request
from classifier_engine.storage.files import atomic_write

RETRY_S = 60.0  # between tries of a server that stopped answering (a /health probe of PROBE_S at most)
PROBE_S = 5.0
# MLflow's client retries a failed request 7 times over ~4 minutes (and waits 120 s for an answer): each log call of an
# outage would stop the training that long. Bounded here, unless set: ~10 s of retries, 15 s per answer.
BOUNDED_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                   "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}


class OutlivingClient:
    """MLFlowLogger's MlflowClient, whose writes outlive the server: kept in <run dir>/mlflow-pending.jsonl (said once)
    and sent, in order, once the server answers its /health again (tried every RETRY_S). Reads pass through."""

    def __init__(self, client: Any, run_dir: Path, uri: str):
        self.client, self.pending, self.uri = client, run_dir / PENDING, uri
        self.lost_at: Optional[float] = None  # time.monotonic() of the last failed try; None while it answers

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def log_batch(self, run_id: str, metrics=(), params=(), tags=(), **_) -> None:
        self.write({"call": "log_batch", "run_id": run_id, "metrics": [[m.key, m.value, m.timestamp, m.step]
                                                                        for m in metrics],
                    "params": [[p.key, p.value] for p in params], "tags": [[t.key, t.value] for t in tags]})

    def log_artifact(self, run_id: str, local_path: str, artifact_path: Optional[str] = None) -> None:
        self.write({"call": "log_artifact", "run_id": run_id, "local_path": str(local_path),
                    "artifact_path": artifact_path})

    def set_terminated(self, run_id: str, status: Optional[str] = None, end_time: Optional[int] = None) -> None:
        self.write({"call": "set_terminated", "run_id": run_id, "status": status,
                    "end_time": end_time or int(time.time() * 1000)})

    def get_run(self, run_id: str) -> Any:
        """The run; during an outage a stand-in (MLFlowLogger.finalize asks for the run before it ends it)."""
        if self.lost_at is None:
            try:
                return self.client.get_run(run_id)
            except Exception as error:  # noqa: BLE001  whatever the client raises for a server that is gone
                self.lose(error)
        return SimpleNamespace(info=SimpleNamespace(run_id=run_id), data=SimpleNamespace(params={}, tags={}))

    def write(self, call: dict[str, Any]) -> None:
        try:
            if self.lost_at is None or self.answers_again():
                if self.pending.is_file():
                    self.send_pending()
                send(self.client, call)
                return
        except Exception as error:  # noqa: BLE001  whatever the client raises for a server that is gone
            if refused(error):
                raise  # the server answered, and refused the write: no outage (it ends the fit, as ever)
            self.lose(error)
        with open(self.pending, "a") as file:
            file.write(json.dumps(call) + "\n")

    def lose(self, error: BaseException) -> None:
        if self.lost_at is None:  # said once per outage
            found = re.search(r"\[Errno -?\d+\] [^'\")]+|Read timed out|timed out|\d{3} [A-Z][\w ]+", str(error))
            reason = found.group(0) if found else f"{type(error).__name__}: {' '.join(str(error).split())[:160]}"
            print(f"MLflow tracking server {self.uri} stopped answering ({reason}): training "
                  f"goes on; what it could not take is kept in {self.pending} (and the run dir's other logs) and sent "
                  "when it answers again, or at the next start (--ckpt_path last)", file=sys.stderr, flush=True)
        self.lost_at = time.monotonic()

    def answers_again(self) -> bool:
        """Every RETRY_S: whether the server answers its /health (a database is simply tried)."""
        if time.monotonic() - self.lost_at < RETRY_S:
            return False
        self.lost_at = time.monotonic()
        if not self.uri.startswith(("http://", "https://")):
            return True
        try:
            with urllib.request.urlopen(health_request(self.uri), timeout=PROBE_S) as answer:
                return answer.status == 200
        except OSError:
            return False

    def send_pending(self, before_step: Optional[int] = None) -> int:
        """Send the kept writes in order (metrics below `before_step`: a resume logs the rest); a failure keeps them."""
        calls = [json.loads(line) for line in self.pending.read_text().splitlines() if line.strip()]
        for sent, call in enumerate(calls):
            if before_step is not None and call["call"] == "log_batch":
                call["metrics"] = [m for m in call["metrics"] if m[3] < before_step]
            try:
                send(self.client, call)
            except BaseException as error:
                if refused(error):  # (a parameter it holds already, say): it would be refused again
                    continue
                text = "".join(json.dumps(c) + "\n" for c in calls[sent:])
                atomic_write(self.pending, lambda file, text=text: file.write(text), mode="w", fsync=False)
                raise
        os.remove(self.pending)
        if self.lost_at is not None:
            print(f"MLflow tracking server {self.uri} answers again: {len(calls)} kept writes sent", file=sys.stderr,
                  flush=True)
        self.lost_at = None
        return len(calls)


def refused(error: BaseException) -> bool:
    """The server answered the request and refused it (a 4xx): not an outage."""
    from mlflow.exceptions import RestException

    return isinstance(error, RestException) and error.get_http_status_code() < 500


def send(client: Any, call: dict[str, Any]) -> None:
    """One kept write, made on the real client."""
    from mlflow.entities import Metric, Param, RunTag

    if call["call"] == "log_batch" and (call["metrics"] or call["params"] or call["tags"]):
        client.log_batch(call["run_id"], metrics=[Metric(*m) for m in call["metrics"]],
                         params=[Param(*p) for p in call["params"]], tags=[RunTag(*t) for t in call["tags"]])
    elif call["call"] == "log_artifact" and Path(call["local_path"]).exists():
        client.log_artifact(call["run_id"], call["local_path"], call["artifact_path"])
    elif call["call"] == "set_terminated":
        client.set_terminated(call["run_id"], call["status"], call["end_time"])


def outlive_outages(trainer: Any, run_dir: Path, resume_step: Optional[int]) -> None:
    """Give each MLFlowLogger (before the Trainer uses it) a client that outlives its server; send what a previous
    start of this run dir kept (`resume_step`: the checkpoint's step, when resuming)."""
    for key, value in BOUNDED_RETRIES.items():
        os.environ.setdefault(key, value)
    for logger in (logger for logger in trainer.loggers if type(logger).__name__ == "MLFlowLogger"):
        if not isinstance(logger._mlflow_client, OutlivingClient):  # the one attribute MLFlowLogger keeps it in
            logger._mlflow_client = OutlivingClient(logger._mlflow_client, run_dir, bare(logger._tracking_uri or ""))
        client = logger._mlflow_client
        if trainer.global_rank == 0 and client.pending.is_file():
            try:
                logger.experiment  # noqa: B018  the run is continued (or started) before its writes are sent
                print(f"MLflow: {client.send_pending(resume_step)} writes an earlier start of this run dir kept are "
                      f"sent to {client.uri}", file=sys.stderr, flush=True)
            except Exception as error:  # noqa: BLE001
                client.lose(error)
