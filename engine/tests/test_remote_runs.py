"""Run dirs on object storage (`--trainer.default_root_dir s3://...`) against moto's S3 server on 127.0.0.1: what a
fit stores, a resume on another node by listing, kill -9 during an upload, SIGTERM to a durable checkpoint, a second
writer, and the store failing mid-upload.

    python -m pytest engine/tests/test_remote_runs.py --durations=0
"""

import contextlib
import io
import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import boto3
import pytest
import torch

from classifier_engine.errors import CheckpointError, ConfigError, RunDirInUse
from conftest import callback, cli_main, start_project, tiny_args
from local_services import FaultyProxy, s3_server

RUN = "lightning_logs/version_0"


@pytest.fixture(scope="module")
def store():
    # Unauthenticated: moto 5.2's signature check refuses keys holding "=" (the template's best-checkpoint names),
    # which AWS and MinIO accept; the credentials path is test_shards.py's.
    with s3_server(bucket="runs", authenticated=False) as env:
        yield env


@pytest.fixture
def s3(store, monkeypatch):
    for name, value in store.items():
        monkeypatch.setenv(name, value)
    return boto3.session.Session().client("s3")


def stored(s3, prefix: str) -> dict[str, int]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket="runs", Prefix=prefix)
    return {item["Key"][len(prefix) + 1:]: item["Size"] for page in pages for item in page.get("Contents", [])}


def stored_checkpoint(s3, key: str, tmp_path) -> dict:
    s3.download_file("runs", key, str(tmp_path / "downloaded.ckpt"))
    return torch.load(tmp_path / "downloaded.ckpt", map_location="cpu", weights_only=True)


def fit_args(tiny_root, url: str, *extra: str) -> list[str]:
    return ["fit", *tiny_args(tiny_root, url, *extra)]


@pytest.fixture
def no_launcher(monkeypatch) -> None:
    """Starts as from a shell: the test itself may run inside a Slurm job or under torchrun."""
    for name in [name for name in os.environ if name.startswith(("SLURM_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(name)


def put_checkpoint(s3, key: str, step: int, saved_at: float, claim: Optional[str] = None, **more) -> None:
    """A checkpoint object at bucket `key`, with the upload metadata `claim` ("saved_at step epoch batches"; None:
    none, as `aws s3 cp` copies one)."""
    body = io.BytesIO()
    torch.save({"state_dict": {"w": torch.full((2,), float(step))}, "epoch": 0, "global_step": step,
                "saved_at": saved_at, **more}, body)
    s3.put_object(Bucket="runs", Key=key, Body=body.getvalue(), **({"Metadata": {"progress": claim}} if claim else {}))


def plan_fit(url: str, ckpt_path: Optional[str] = "last", logger=None):
    """The placement of a fit into `url` (the plan's passes that read the store), as a start makes it."""
    from jsonargparse import Namespace

    from classifier_engine.plan.make import plan_run

    return plan_run("fit", Namespace(trainer=Namespace(default_root_dir=url, logger=logger), ckpt_path=ckpt_path))


@pytest.mark.slow
def test_a_fit_stores_its_run_and_another_node_resumes_it_by_listing(tiny_root, s3, tmp_path, monkeypatch):
    monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path / "node1"))
    cli_main(fit_args(tiny_root, "s3://runs/a"))
    files = stored(s3, "a")
    assert {f"{RUN}/checkpoints/last.ckpt", f"{RUN}/config.yaml", f"{RUN}/hparams.yaml"} <= files.keys()
    assert any(name.startswith(f"{RUN}/events.out.tfevents") for name in files)
    assert sum(name.startswith(f"{RUN}/checkpoints/epoch000") for name in files) == 1  # the best one
    assert stored_checkpoint(s3, f"a/{RUN}/checkpoints/last.ckpt", tmp_path)["global_step"] == 5

    # Another node (an empty mirror): --ckpt_path last lists the store, downloads the furthest checkpoint and the run
    # dir, continues it; the first run's config.yaml is kept as config.1.yaml, as on a filesystem. A key planted in
    # the bucket to land outside the mirror is never downloaded.
    s3.put_object(Bucket="runs", Key=f"a/{RUN}/../../../../escaped.txt", Body=b"x")
    monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path / "node2" / "mirror"))
    with pytest.warns(UserWarning, match=r"ignored 1 object\(s\) whose key leaves the run root"):
        cli_main([*fit_args(tiny_root, "s3://runs/a", "--trainer.max_epochs=2"), "--ckpt_path=last"])
    assert not [p for p in tmp_path.rglob("escaped.txt")]
    files = stored(s3, "a")
    assert {f"{RUN}/config.yaml", f"{RUN}/config.1.yaml"} <= files.keys()
    assert not any(name.startswith("lightning_logs/version_1") for name in files)
    assert stored_checkpoint(s3, f"a/{RUN}/checkpoints/last.ckpt", tmp_path)["global_step"] == 10
    assert not any(name.endswith((".lease", ".lock", ".uploaded.json")) for name in files)

    # The first node, back: its mirror's last.ckpt is the step-5 one it uploaded, the store's the second node's (step
    # 10, the same size): that one is downloaded (another ETag) and continued, never written over by the older one.
    monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path / "node1"))
    cli = cli_main([*fit_args(tiny_root, "s3://runs/a", "--trainer.max_epochs=3"), "--ckpt_path=last"])
    assert cli.started.plan.value("checkpoint")["step"] == 10
    assert stored_checkpoint(s3, f"a/{RUN}/checkpoints/last.ckpt", tmp_path)["global_step"] == 15


def test_a_requeued_job_on_a_new_node_downloads_only_its_own_run_dirs_checkpoints(s3, tmp_path, monkeypatch,
                                                                                   no_launcher):
    # Two Slurm jobs' runs in one root; job 101 requeued onto an empty mirror chooses in its own run dir only, so only
    # that run's checkpoint is downloaded (not every run's last.ckpt and best ones); --ckpt_path last reads them all.
    for job, step, saved_at in (("101", 4, 1.0), ("202", 9, 2.0)):
        put_checkpoint(s3, f"sq/lightning_logs/slurm-{job}/checkpoints/last.ckpt", step, saved_at)
    mirror = tmp_path / "node2"
    monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(mirror))

    def plan(ckpt_path=None):
        return plan_fit("s3://runs/sq", ckpt_path)

    for name, value in {"SLURM_JOB_ID": "101", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train",
                        "SLURM_RESTART_COUNT": "1"}.items():
        monkeypatch.setenv(name, value)
    own = mirror / "runs" / "sq" / "lightning_logs" / "slurm-101" / "checkpoints" / "last.ckpt"
    assert plan().ckpt_path == own
    assert sorted(mirror.rglob("*.ckpt")) == [own]  # job 202's never downloaded
    # Job 303 requeued with nothing of its own yet, given job 202's checkpoint by its mirror path (a new node): fetched.
    monkeypatch.setenv("SLURM_JOB_ID", "303")
    monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path / "node3"))
    given = tmp_path / "node3" / "runs" / "sq" / "lightning_logs" / "slurm-202" / "checkpoints" / "last.ckpt"
    assert plan(str(given)).ckpt_path == given and given.is_file()
    monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(mirror))
    for name in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_JOB_NAME", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name)
    assert plan("last").ckpt_path == mirror / "runs" / "sq" / "lightning_logs" / "slurm-202" / "checkpoints" / \
        "last.ckpt"  # the run that saved last, read from its own records


def test_a_stored_checkpoint_given_by_its_url_or_mirror_path_is_downloaded_alone_with_its_run_dir(
        s3, tmp_path, monkeypatch, no_launcher):
    # Another node (an empty mirror) names one stored checkpoint: that one is downloaded (not the run's last.ckpt, nor
    # another run's), with its run dir's other files for a fit to continue there; the start reads it in the mirror.
    for name, step in (("version_0/checkpoints/epoch=0.ckpt", 3), ("version_0/checkpoints/last.ckpt", 5),
                       ("version_1/checkpoints/last.ckpt", 9)):
        put_checkpoint(s3, f"ex/lightning_logs/{name}", step, float(step), f"{step} {step} 0 {step}")
    s3.put_object(Bucket="runs", Key="ex/lightning_logs/version_0/config.yaml", Body=b"seed_everything: 1\n")
    for node, given in (("node1", "s3://runs/ex/lightning_logs/version_0/checkpoints/epoch=0.ckpt"),
                        ("node2", "{mirror}/lightning_logs/version_0/checkpoints/epoch=0.ckpt")):
        monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path / node))
        mirror = tmp_path / node / "runs" / "ex"
        started = plan_fit("s3://runs/ex", given.format(mirror=mirror))
        run = mirror / "lightning_logs" / "version_0"
        assert started.ckpt_path == run / "checkpoints" / "epoch=0.ckpt"
        assert started.plan.value("checkpoint")["step"] == 3 and started.plan.value("run dir")["path"] == str(run)
        assert sorted(p.relative_to(run) for p in mirror.rglob("*") if p.is_file() and not p.name.startswith(".")) \
            == [Path("checkpoints/epoch=0.ckpt"), Path("config.yaml")]
        started.close()
    # A mirror that holds it reads it as it is: the run dir's rows not uploaded yet stay, and so does the checkpoint
    # once removed from the store (the choice of `--ckpt_path last` drops such copies; one given is the user's).
    (run / "metrics.csv").write_text("step\n1\n")
    s3.delete_object(Bucket="runs", Key="ex/lightning_logs/version_0/checkpoints/epoch=0.ckpt")
    plan_fit("s3://runs/ex", str(run / "checkpoints" / "epoch=0.ckpt")).close()
    assert (run / "metrics.csv").read_text() == "step\n1\n" and (run / "checkpoints" / "epoch=0.ckpt").is_file()
    # One the store lacks, a URL naming no checkpoint, and one under another root: one line each, and what to pass.
    with pytest.raises(CheckpointError, match=r"^checkpoint s3://runs/ex/lightning_logs/version_0/checkpoints/"
                       r"epoch=9.ckpt is not in the store: name a stored one \(aws s3 ls s3://runs/ex/ --recursive\)"):
        plan_fit("s3://runs/ex", "s3://runs/ex/lightning_logs/version_0/checkpoints/epoch=9.ckpt")
    with pytest.raises(ConfigError, match=r"^--ckpt_path s3://runs/ex/lightning_logs/version_1/checkpoints: names no "
                       r"checkpoint file of the run root; pass a stored .ckpt"):
        plan_fit("s3://runs/ex", "s3://runs/ex/lightning_logs/version_1/checkpoints")
    with pytest.raises(ConfigError, match=r"^--ckpt_path s3://runs/other/a.ckpt: a stored checkpoint is read through "
                       r"the run root it is under: pass --trainer.default_root_dir"):
        plan_fit("s3://runs/ex", "s3://runs/other/a.ckpt")
    with pytest.raises(ConfigError, match=r"^--ckpt_path S3://runs/ex/a.ckpt looks like a mistyped object-store URL"):
        plan_fit("s3://runs/ex", "S3://runs/ex/a.ckpt")
    assert not (tmp_path / "node2" / "runs" / "ex" / "lightning_logs" / "version_1" / "checkpoints").exists()


def test_ckpt_path_last_downloads_the_checkpoint_its_metadata_ranks_first_and_those_without_metadata(
        s3, tmp_path, monkeypatch, no_launcher):
    # Three runs in one root, as the library stores them (each checkpoint's records as its metadata), and one copied
    # in without metadata: --ckpt_path last on an empty mirror reads the first by the claims (its own records agree)
    # and the one that claims nothing, not every run's checkpoints. A claim its file does not bear out reads on.
    from jsonargparse import Namespace

    runs = {"version_0": (4, 1.0, "4"), "version_1": (9, 3.0, "9"), "version_2": (7, 2.0, "7"), "copied": (1, 0.5, "")}
    for run, (step, saved_at, claim) in runs.items():
        put_checkpoint(s3, f"cl/lightning_logs/{run}/checkpoints/last.ckpt", step, saved_at,
                       f"{saved_at} {claim} 0 0" if claim else None)
    logs = tmp_path / "node1" / "runs" / "cl" / "lightning_logs"

    def last_on_an_empty_mirror(node: str) -> tuple[Path, list[Path]]:
        monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path / node))
        chosen = plan_fit("s3://runs/cl").ckpt_path
        return chosen.relative_to(tmp_path / node), sorted(p.relative_to(tmp_path / node)
                                                           for p in (tmp_path / node).rglob("*.ckpt"))

    def at(run: str) -> Path:
        return (logs / run / "checkpoints" / "last.ckpt").relative_to(tmp_path / "node1")

    assert last_on_an_empty_mirror("node1") == (at("version_1"), [at("copied"), at("version_1")])
    # version_0's metadata edited to claim it saved last, further along: read, found otherwise, and read on.
    key = "cl/lightning_logs/version_0/checkpoints/last.ckpt"
    s3.copy_object(Bucket="runs", Key=key, CopySource={"Bucket": "runs", "Key": key}, MetadataDirective="REPLACE",
                   Metadata={"progress": "9.0 99 0 0"})
    assert last_on_an_empty_mirror("node2") == (at("version_1"), [at("copied"), at("version_0"), at("version_1")])
    # Runs of several checkpoints: version_0 continued from an early one (its last.ckpt saved last, step 8 furthest);
    # version_3's last.ckpt claims a later save than it made, which would make its run the one that saved last;
    # version_2's claims the latest, and does not load. Each claim the choice rests on is read: not version_1's.
    for name, (step, saved_at, claim) in {"version_0/checkpoints/last.ckpt": (3, 5.0, "5.0 3"),
                                          "version_0/checkpoints/epoch=0-step=8.ckpt": (8, 2.0, "2.0 8"),
                                          "version_1/checkpoints/last.ckpt": (5, 3.0, "3.0 5"),
                                          "version_3/checkpoints/a.ckpt": (20, 1.5, "1.5 20"),
                                          "version_3/checkpoints/last.ckpt": (1, 1.0, "7.0 1")}.items():
        put_checkpoint(s3, f"cm/lightning_logs/{name}", step, saved_at, f"{claim} 0 0")
    s3.put_object(Bucket="runs", Key="cm/lightning_logs/version_2/checkpoints/last.ckpt", Body=b"not a checkpoint",
                  Metadata={"progress": "6.0 9 0 0"})
    monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path / "node3"))
    logs = tmp_path / "node3" / "runs" / "cm" / "lightning_logs"
    with pytest.warns(UserWarning, match="skipped checkpoint .*version_2/checkpoints/last.ckpt"):
        assert plan_fit("s3://runs/cm").ckpt_path == logs / "version_0" / "checkpoints" / "epoch=0-step=8.ckpt"
    assert sorted(str(p.relative_to(logs)) for p in logs.rglob("*.ckpt")) == [
        "version_0/checkpoints/epoch=0-step=8.ckpt", "version_0/checkpoints/last.ckpt",
        "version_2/checkpoints/last.ckpt", "version_3/checkpoints/a.ckpt", "version_3/checkpoints/last.ckpt"]
    # A tie (the same step, one in the mirror already, one saved later only in the store): the first by name, as
    # when all are read; and a logger of another name looks in its own folder only (nothing there: a new run).
    put_checkpoint(s3, "cm/lightning_logs/version_0/checkpoints/epoch=0-step=8-v1.ckpt", 8, 9.0, "9.0 8 0 0")
    assert plan_fit("s3://runs/cm").ckpt_path == logs / "version_0" / "checkpoints" / "epoch=0-step=8-v1.ckpt"
    named = Namespace(class_path="lightning.pytorch.loggers.TensorBoardLogger", init_args=Namespace(name="exp"))
    assert plan_fit("s3://runs/cm", logger=named).ckpt_path is None


@pytest.mark.slow
def test_the_checkpoint_resumed_is_the_furthest_by_its_own_records_whatever_the_metadata_beside_it(
        tiny_root, s3, tmp_path, monkeypatch):
    checkpoints = f"{RUN}/checkpoints"
    monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path / "node1"))
    early = tmp_path / "node1" / "runs" / "m" / checkpoints / "a_step2.ckpt"  # listed first, behind the others
    cli_main([*fit_args(tiny_root, "s3://runs/m"), callback("stop_callbacks.SaveAtStep", step=2, path=str(early))])
    # The run copied into the bucket without its metadata (aws s3 cp, boto3 put_object): nothing says how far each got.
    for name in stored(s3, "m"):
        s3.put_object(Bucket="runs", Key=f"n/{name}", Body=s3.get_object(Bucket="runs", Key=f"m/{name}")["Body"].read())
    # Its metadata edited: the step-2 checkpoint claims to be furthest along, and a planted object further still.
    key = f"m/{checkpoints}/a_step2.ckpt"
    s3.copy_object(Bucket="runs", Key=key, CopySource={"Bucket": "runs", "Key": key}, MetadataDirective="REPLACE",
                   Metadata={"progress": "1e12 999 99 999"})
    s3.put_object(Bucket="runs", Key=f"m/{checkpoints}/b_planted.ckpt", Body=b"not a checkpoint",
                  Metadata={"progress": "2e12 9999 99 9999"})
    for prefix, node in (("n", "node2"), ("m", "node3")):  # each on an empty mirror
        monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path / node))
        last = tmp_path / node / "runs" / prefix / checkpoints / "last.ckpt"
        with pytest.warns(UserWarning, match="skipped checkpoint .*b_planted.ckpt: .* is not a checkpoint") \
                if prefix == "m" else contextlib.nullcontext():
            cli = cli_main([*fit_args(tiny_root, f"s3://runs/{prefix}", "--trainer.max_epochs=2"), "--ckpt_path=last"])
        assert cli.started.plan.value("checkpoint") == {"path": str(last), "step": 5, "epoch": 0}
        assert stored_checkpoint(s3, f"{prefix}/{checkpoints}/last.ckpt", tmp_path)["global_step"] == 10
        assert not any(name.startswith("lightning_logs/version_1") for name in stored(s3, prefix))


def test_a_second_writer_into_a_stored_run_is_refused_in_one_line_and_writes_nothing(tiny_root, s3, tmp_path,
                                                                                     monkeypatch, capsys):
    import json
    import threading

    from conftest import project_in_process

    monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path / "node1"))
    cli_main(fit_args(tiny_root, "s3://runs/b"))
    alive = threading.Event()

    def other_writer() -> None:  # a run on node7 renewing its lease, as a live one does
        while not alive.wait(1.0):
            body = json.dumps({"holder": "pid 4242 on node7", "renewed": time.time()}).encode()
            s3.put_object(Bucket="runs", Key=f"b/{RUN}/.lease", Body=body)

    renewing = threading.Thread(target=other_writer)
    renewing.start()
    try:
        time.sleep(1.5)
        before = stored(s3, "b")
        monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path / "node2"))
        code, _, err = project_in_process([*fit_args(tiny_root, "s3://runs/b", "--trainer.max_epochs=2"),
                                           "--ckpt_path=last"], monkeypatch, capsys)
    finally:
        alive.set()
        renewing.join()
    assert code == 2 and err.strip().splitlines()[-1] == (
        f"error: run dir s3://runs/b/{RUN} is in use by pid 4242 on node7 (its lease is renewed); wait for that run to "
        "end, or write elsewhere with --trainer.default_root_dir")
    assert {k for k in stored(s3, "b") if not k.endswith(".lease")} == {k for k in before if not k.endswith(".lease")}


@pytest.mark.slow
def test_two_new_runs_started_at_once_into_one_root_end_in_two_versions(tiny_root, s3, store, tmp_path):
    # Two nodes start together: each start's first lease request is held until the other's has come, so both read
    # "no lease" before either writes one, as they did on every try with the lease read then written (the two starts
    # seconds apart on a loaded machine: a fixed delay let the second see the first's run, one CI run in several). The
    # store's create-only write (If-None-Match) gives version_0 to one; the other takes version_1.
    with FaultyProxy(store["AWS_ENDPOINT_URL"], fault="together", match="/.lease", times=2) as proxy:
        jobs = [start_project(fit_args(tiny_root, "s3://runs/h"), env={
            **store, "AWS_ENDPOINT_URL": proxy.url, "CLASSIFIER_ENGINE_RUN_MIRROR": str(tmp_path / node)})
            for node in ("node1", "node2")]
        outputs = ["".join(job.communicate(timeout=600)) for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    files = stored(s3, "h")
    assert {name.split("/")[1] for name in files if name.startswith("lightning_logs/")} == {"version_0", "version_1"}
    for version in ("version_0", "version_1"):  # each run's own, whole
        assert stored_checkpoint(s3, f"h/lightning_logs/{version}/checkpoints/last.ckpt", tmp_path)["global_step"] == 5
        assert f"lightning_logs/{version}/config.yaml" in files
    lost = [text for text in outputs if f"run dir s3://runs/h/{RUN} was claimed by pid " in text]
    assert len(lost) == 1 and "at the same moment: taking the next version" in lost[0]


@pytest.mark.slow
def test_two_evaluations_started_at_once_into_one_root_log_into_two_versions(tiny_root, s3, store, tmp_path):
    # As two fits: an evaluation's own version dir is claimed by its lease, else both uploaded into version_0.
    cli_main(fit_args(tiny_root, str(tmp_path / "local")))
    checkpoint = tmp_path / "local" / RUN / "checkpoints" / "last.ckpt"
    with FaultyProxy(store["AWS_ENDPOINT_URL"], fault="together", match="/.lease", times=2) as proxy:
        args = ["validate", *tiny_args(tiny_root, "s3://runs/evaluations"), f"--ckpt_path={checkpoint}"]
        jobs = [start_project(args, env={**store, "AWS_ENDPOINT_URL": proxy.url,
                                         "CLASSIFIER_ENGINE_RUN_MIRROR": str(tmp_path / node)})
                for node in ("node1", "node2")]
        outputs = ["".join(job.communicate(timeout=600)) for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    files = stored(s3, "evaluations")
    for version in ("version_0", "version_1"):  # each evaluation's own logs
        assert sum(name.startswith(f"lightning_logs/{version}/events.out.tfevents") for name in files) == 1, files
    assert not any(name.endswith(".lease") for name in files)  # released
    lost = [text for text in outputs if f"run dir s3://runs/evaluations/{RUN} was claimed by pid " in text]
    assert len(lost) == 1 and "at the same moment: taking the next version" in lost[0]


@pytest.mark.slow
def test_a_run_whose_lease_was_taken_over_writes_nothing_more_and_stops_in_one_line(tiny_root, s3, tmp_path,
                                                                                     monkeypatch, capsys):
    # A node that stalled past the lease's TTL (here: renewals every 0.2 s, the other node's lease planted at step 1
    # and the run held 1 s) finds its lease replaced at its next renewal: it used to renew it unconditionally, writing
    # over the new holder's, then upload its checkpoints over that run's.
    from classifier_engine.run import remote_lease
    from conftest import project_in_process

    monkeypatch.setattr(remote_lease, "LEASE_RENEW_S", 0.2)
    monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path / "node1"))
    take_over = callback("stop_callbacks.TakeOverLeaseAtStep", step=1, key=f"t/{RUN}/.lease", stall=1.0)
    code, _, err = project_in_process([*fit_args(tiny_root, "s3://runs/t"), take_over], monkeypatch, capsys)
    assert code == 2 and err.strip().splitlines()[-1] == (
        "error: trainer.default_root_dir s3://runs/t: pid 4242 on node7 took over this run's lease (its renewals "
        f"missed for 30 s: a stalled node?); stopped, storing nothing more: its files stay in {tmp_path / 'node1'}/"
        "runs/t"), err[-2000:]
    assert s3.get_object(Bucket="runs", Key=f"t/{RUN}/.lease")["Body"].read().startswith(b'{"holder": "pid 4242 on')
    assert not [name for name in stored(s3, "t") if name.endswith(".ckpt")]  # the new holder's to write
    assert list((tmp_path / "node1").rglob("*.ckpt"))  # kept here


def test_a_connection_cut_during_lease_renewals_misses_those_renewals_only(store, s3, tmp_path, monkeypatch):
    # botocore's ConnectionClosedError carries response=None: reading its code raised in the renewal thread, which died
    # with a traceback, so the lease was never renewed again and another start took the run dir over while it trained.
    from classifier_engine.run import remote_lease
    from classifier_engine.run.remote_runs import RemoteRoot

    monkeypatch.setattr(remote_lease, "LEASE_RENEW_S", 0.2)
    monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path))
    errors = []
    monkeypatch.setattr("threading.excepthook", errors.append)
    # Refused: one renewal's 3 tries. Lost: a renewal done in the store whose answer was dropped; its retry's condition
    # fails on the run's own renewal, which is not another run taking the lease over.
    for fault, tries in (("refuse", 3), ("lose", 1)):
        with FaultyProxy(store["AWS_ENDPOINT_URL"], match="/.lease", times=tries) as proxy:
            monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
            remote, lease = RemoteRoot(f"s3://runs/{fault}"), {"Bucket": "runs", "Key": f"{fault}/{RUN}/.lease"}
            remote.claim(remote.mirror / RUN, new=True)
            proxy.fault, deadline = fault, time.monotonic() + 60
            while proxy.faults < tries and time.monotonic() < deadline:
                time.sleep(0.05)
            before = s3.get_object(**lease)["ETag"]
            while s3.get_object(**lease)["ETag"] == before and time.monotonic() < deadline:
                time.sleep(0.1)
            assert s3.get_object(**lease)["ETag"] != before, errors  # renewed again
            assert proxy.faults == tries and not errors and remote.taken_over() is None
            remote.release()


def test_a_resume_is_refused_when_another_run_saved_into_its_run_dir_after_it_listed_the_store(
        s3, tmp_path, monkeypatch, no_launcher):
    # A resume chose the stored step-5 checkpoint, then waited for another node's live run to end: that run saved step
    # 8 and released its lease, and the resume went on from step 5, writing over the further checkpoint (a probe's).
    import threading

    from jsonargparse import Namespace

    from classifier_engine.plan.make import plan_run

    monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path))
    put_checkpoint(s3, f"w/{RUN}/checkpoints/last.ckpt", 5, 5.0, "5 5 0 5")
    lease = {"Bucket": "runs", "Key": f"w/{RUN}/.lease"}
    s3.put_object(**lease, Body=b'{"holder": "pid 4242 on node7", "renewed": 0}')

    def other_run_saves_and_ends():
        time.sleep(1.5)
        put_checkpoint(s3, f"w/{RUN}/checkpoints/last.ckpt", 8, 8.0, "8 8 0 8")
        s3.delete_object(**lease)

    def resume():
        return plan_run("fit", Namespace(trainer=Namespace(default_root_dir="s3://runs/w", logger=None),
                                         ckpt_path="last"), claim_run_dir=True)

    threading.Thread(target=other_run_saves_and_ends).start()
    with pytest.raises(RunDirInUse, match=r"^run dir s3://runs/w/lightning_logs/version_0: another run saved a "
                       r"checkpoint there after this start listed the store \(a run ending while this one started\)"):
        resume()
    assert "Contents" not in s3.list_objects_v2(Bucket="runs", Prefix=lease["Key"])  # its lease taken back
    s3.put_object(**lease, Body=b'{"holder": "pid 4242 on node7", "renewed": 0}')  # one that lapses: nothing saved
    monkeypatch.setattr("classifier_engine.run.remote_lease.LEASE_TTL_S", 2.0)
    started = resume()
    assert started.plan.value("checkpoint")["step"] == 8
    started.close()
    # No lease to wait for: a run that saved and ended while this start listed and chose (before it took the lease).
    from classifier_engine.run import remote_runs

    def saved_meanwhile(*args, take=remote_runs.take_lease):
        put_checkpoint(s3, f"w/{RUN}/checkpoints/last.ckpt", 11, 11.0, "11 11 0 11")
        return take(*args)

    monkeypatch.setattr(remote_runs, "take_lease", saved_meanwhile)
    with pytest.raises(RunDirInUse, match="another run saved a checkpoint there after this start listed the store"):
        resume()


@pytest.mark.parametrize("lease", [b"[1, 2]", b'{"renewed": 0}'])
def test_a_lease_of_another_shape_is_one_line_naming_it_and_how_to_clear_it(lease, tiny_root, s3, tmp_path,
                                                                           monkeypatch, capsys):
    from conftest import project_in_process

    monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path / "node1"))
    prefix = f"i{len(lease)}"
    cli_main(fit_args(tiny_root, f"s3://runs/{prefix}"))
    url = f"s3://runs/{prefix}/{RUN}"
    s3.put_object(Bucket="runs", Key=f"{prefix}/{RUN}/.lease", Body=lease)
    code, _, err = project_in_process([*fit_args(tiny_root, f"s3://runs/{prefix}", "--trainer.max_epochs=2"),
                                       "--ckpt_path=last"], monkeypatch, capsys)
    assert (code, err.strip().splitlines()[-1]) == (2, (
        f"error: run dir {url}: its lease {url}/.lease is not one this library writes (expected "
        f'{{"holder": "pid N on HOST", "renewed": SECONDS}}, found {lease.decode()!r}); if no run writes there now, '
        f"delete it (aws s3 rm {url}/.lease) and rerun"))


def wait_for(condition, timeout: float = 300.0, every: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every)


@pytest.mark.slow
def test_kill_9_during_a_checkpoint_upload_leaves_the_previous_one_whole_and_the_resume_continues_from_it(
        tiny_root, s3, store, tmp_path):
    # Every step saves last.ckpt (~64 MB at width 384, where the quickstart's width 16 saves ~100 kB: a multipart
    # upload that lasts long enough to kill); the job is killed while an upload is in flight, as the OOM killer or a
    # preempted node would.
    env = {**store, "CLASSIFIER_ENGINE_RUN_MIRROR": str(tmp_path / "node1")}
    args = [*fit_args(tiny_root, "s3://runs/c", "--trainer.max_epochs=2", "--model.init_args.width=384"),
            "--last_checkpoint.every_n_steps=1"]
    job = start_project(args, env=env, new_session=True)
    in_flight = lambda: s3.list_multipart_uploads(Bucket="runs", Prefix="c").get("Uploads")  # noqa: E731
    try:
        wait_for(lambda: stored(s3, "c").get(f"{RUN}/checkpoints/last.ckpt") and in_flight() or job.poll() is not None)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate(timeout=60)
    assert job.returncode == -signal.SIGKILL
    whole = stored_checkpoint(s3, f"c/{RUN}/checkpoints/last.ckpt", tmp_path)  # the previous one: it loads
    assert 1 <= whole["global_step"] < 10
    env["CLASSIFIER_ENGINE_RUN_MIRROR"] = str(tmp_path / "node2")  # resumed elsewhere: only the store is left
    resumed = start_project([*args, "--ckpt_path=last"], env=env)
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    assert f"Restoring states from the checkpoint path at {tmp_path / 'node2'}" in out + err
    assert stored_checkpoint(s3, f"c/{RUN}/checkpoints/last.ckpt", tmp_path)["global_step"] == 10


@pytest.mark.slow
def test_sigterm_to_a_ddp_job_uploads_a_mid_epoch_checkpoint_and_says_when_it_was_durable(tiny_root, s3, store,
                                                                                            tmp_path):
    from conftest import CONFIGS

    env = {**store, "CLASSIFIER_ENGINE_RUN_MIRROR": str(tmp_path / "node1")}
    marker = tmp_path / "holding"
    job = start_project([*fit_args(tiny_root, "s3://runs/d", "--trainer.max_epochs=3"), "--config",
                         str(CONFIGS / "cpu_ddp.yaml"),
                         callback("stop_callbacks.HoldUntilSignalled", step=3, marker=str(marker))], env=env)
    wait_for(lambda: marker.exists() or job.poll() is not None, every=0.1)
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=600)
    assert job.returncode == 143, err[-3000:]
    line = next(line for line in (out + err).splitlines() if line.startswith("stopped by SIGTERM"))
    assert f"last checkpoint: s3://runs/d/{RUN}/checkpoints/last.ckpt, durable " in line
    seconds = float(line.split(", durable ")[1].split(" s after")[0])
    print(f"signal to durable: {seconds} s")
    step = int(line.split("global step ")[1].split(";")[0])
    assert stored_checkpoint(s3, f"d/{RUN}/checkpoints/last.ckpt", tmp_path)["global_step"] == step == 4
    assert not any(name.startswith("lightning_logs/version_1") for name in stored(s3, "d"))  # one run dir


@pytest.mark.slow
def test_the_store_failing_mid_upload_is_one_line_the_run_goes_on_and_the_next_start_sends_what_it_kept(
        tiny_root, s3, store, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path / "node1"))
    # From the 2nd request for a checkpoint on, the connection is closed as it arrives (the store, or the network to it,
    # gone in the middle of the run; a multipart upload's later parts meet it mid-upload).
    with FaultyProxy(store["AWS_ENDPOINT_URL"], fault="refuse", match=".ckpt", after=1) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        with pytest.warns(UserWarning, match=r"uploading last.ckpt failed \((cannot reach the object store|the object "
                                             r"store cut the connection).*; kept in .*last.ckpt meanwhile"):
            cli_main([*fit_args(tiny_root, "s3://runs/e", "--trainer.max_epochs=2"),
                      "--last_checkpoint.every_n_steps=3"])
        assert proxy.faults >= 1
    monkeypatch.setenv("AWS_ENDPOINT_URL", store["AWS_ENDPOINT_URL"])
    local = tmp_path / "node1" / "runs" / "e" / RUN / "checkpoints" / "last.ckpt"
    assert torch.load(local, weights_only=True)["global_step"] == 10  # nothing lost: the mirror has it
    assert stored_checkpoint(s3, f"e/{RUN}/checkpoints/last.ckpt", tmp_path)["global_step"] < 10
    # The next start on this node: the mirror's step-10 checkpoint, further than the stored one, is kept (nothing is
    # trained again: no batch recorded; the run is complete, which ends the start at once) and sent.
    with pytest.raises(SystemExit) as finished:
        cli_main([*fit_args(tiny_root, "s3://runs/e", "--trainer.max_epochs=2"), "--ckpt_path=last",
                  callback("recorded_samples.RecordSamples", folder=str(tmp_path / "trained"))])
    assert finished.value.code == 0
    assert not (tmp_path / "trained").exists()
    assert stored_checkpoint(s3, f"e/{RUN}/checkpoints/last.ckpt", tmp_path)["global_step"] == 10
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing answers: one line before anything runs
    from conftest import project_in_process

    code, _, err = project_in_process(fit_args(tiny_root, "s3://runs/f"), monkeypatch, capsys)
    assert code == 2 and err.strip().splitlines()[-1].startswith(
        "error: trainer.default_root_dir s3://runs/f: listing the runs failed (cannot reach the object store")


@pytest.mark.slow
def test_a_config_yaml_replaced_in_the_bucket_names_no_code_that_runs(tiny_root, s3, tmp_path, monkeypatch, capsys):
    import yaml

    from conftest import project_in_process

    monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path / "node1"))
    cli_main(fit_args(tiny_root, "s3://runs/g"))
    # Someone with write access to the bucket replaces the run's config.yaml: its model now names an installed module
    # whose import runs code (here: writes a file).
    marker, planted = tmp_path / "ran.txt", tmp_path / "installed"
    planted.mkdir()
    (planted / "planted_module.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
    monkeypatch.syspath_prepend(str(planted))
    key = f"g/{RUN}/config.yaml"
    settings = yaml.safe_load(s3.get_object(Bucket="runs", Key=key)["Body"].read())
    settings["model"]["class_path"] = "planted_module.Model"
    s3.put_object(Bucket="runs", Key=key, Body=yaml.safe_dump(settings).encode())

    # Another node: validate --ckpt_path last downloads the run dir (config.yaml too) and validates by its own config.
    node2 = tmp_path / "node2"
    monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(node2))
    code, _, err = project_in_process(["validate", *tiny_args(tiny_root, "s3://runs/g"), "--ckpt_path=last"],
                                      monkeypatch, capsys)
    assert code == 0, err[-2000:]
    mirrored = node2 / "runs" / "g" / RUN
    assert yaml.safe_load((mirrored / "config.yaml").read_text())["model"]["class_path"] == "planted_module.Model"
    refusal = (f"error: config file {mirrored / 'config.yaml'} came from s3://runs/{key}, and a file from an object "
               "store is not trusted to name code: it names planted_module.Model, which neither the command line nor "
               "a local config names; read it, then pass a copy of your own (--config my_run.yaml), or name "
               "planted_module.Model in a local config beside it")
    # export reads the config.yaml beside the checkpoint; validate --config reads it as given: both refuse it, and a
    # copy made in the mirror (a file of the run dir in the bucket, whoever wrote it) is refused the same way.
    import shutil

    shutil.copy(mirrored / "config.yaml", mirrored / "copied.yaml")
    for args, name in ((["export", "--ckpt_path", str(mirrored / "checkpoints" / "last.ckpt")], "config.yaml"),
                       (["validate", "--config", str(mirrored / "config.yaml"), "--ckpt_path",
                         str(mirrored / "checkpoints" / "last.ckpt")], "config.yaml"),
                       (["validate", "--config", str(mirrored / "copied.yaml")], "copied.yaml")):
        code, _, err = project_in_process(args, monkeypatch, capsys)
        assert (code, err.strip().splitlines()[-1]) == (2, refusal.replace("config.yaml", name))
    assert not marker.exists() and "planted_module" not in sys.modules
    # Named by the command line, the same class is the user's choice (and then runs, as any config's class does).
    code, _, err = project_in_process(["validate", "--config", str(mirrored / "config.yaml"), "--ckpt_path",
                                       str(mirrored / "checkpoints" / "last.ckpt"),
                                       "--model.class_path=planted_module.Model"], monkeypatch, capsys)
    assert marker.exists() and "came from s3://" not in err


@pytest.mark.parametrize("root, why", [
    *((typo, "looks like a mistyped object-store URL: write s3://bucket/prefix (lowercase s3, a colon, two slashes), "
             "or ./<path> for a local folder") for typo in ("s3:/runs/x", "s3:runs/x", "S3://runs/x", "s3//runs/x")),
    *((bad, f": the prefix {bad[len('s3://runs/'):]!r} has an empty part, '.', '..' or a backslash: expected "
            "s3://bucket/plain/parts") for bad in ("s3://runs/../../x", "s3://runs//x", "s3://runs/a\\b"))])
def test_a_mistyped_or_unplain_root_is_refused_in_one_line_before_anything_is_written(root, why, tiny_root, tmp_path,
                                                                                       monkeypatch, capsys):
    from conftest import project_in_process

    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path / "mirror"))
    code, _, err = project_in_process(fit_args(tiny_root, root), monkeypatch, capsys)
    assert (code, err.strip().splitlines()[-1]) == (2, f"error: trainer.default_root_dir {root}{' ' * (why[0] != ':')}"
                                                       f"{why}")
    assert not any(work.iterdir()) and not (tmp_path / "mirror").exists()


def test_each_root_has_a_mirror_of_its_own_at_its_keys_inside_the_base(tmp_path, monkeypatch):
    from classifier_engine.run.remote_runs import RemoteRoot

    monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path))
    mirrors = {url: RemoteRoot(url).mirror for url in ("s3://data", "s3://data/_", "s3://data/a/b", "s3://data/a/b/")}
    assert mirrors == {"s3://data": tmp_path / "data", "s3://data/_": tmp_path / "data" / "_",
                       "s3://data/a/b": tmp_path / "data" / "a" / "b", "s3://data/a/b/": tmp_path / "data" / "a" / "b"}


def test_the_mirror_follows_the_store_a_removed_checkpoint_leaves_it_one_not_sent_yet_stays(s3, tmp_path, monkeypatch):
    from classifier_engine.run.remote_runs import RemoteRoot

    monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path))
    root = RemoteRoot("s3://runs/r")
    folder = root.mirror / RUN / "checkpoints"
    folder.mkdir(parents=True)
    for name, step in (("last.ckpt", 3), ("pending.ckpt", 7)):
        torch.save({"state_dict": {}, "epoch": 0, "global_step": step}, folder / name)
    assert root.upload(folder / "last.ckpt", (1.0, 3, 0, 3)) is not None  # pending.ckpt: saved here, never sent
    s3.delete_object(Bucket="runs", Key=f"r/{RUN}/checkpoints/last.ckpt")  # removed there (by hand, another node)
    root.prepare("lightning_logs", resume=True)
    assert sorted(path.name for path in folder.glob("*.ckpt")) == ["pending.ckpt"]


def test_a_resume_from_this_nodes_own_checkpoint_keeps_the_run_dirs_files_it_has_not_sent_yet(
        s3, tmp_path, monkeypatch, no_launcher):
    # The store went away mid-run: this node saved a checkpoint and logged rows it could not send. The next start here
    # continues from that checkpoint, and used to replace those rows with the store's older file; a run another node
    # continued since (its checkpoint further along) still brings the store's files.
    monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path))
    put_checkpoint(s3, f"own/{RUN}/checkpoints/last.ckpt", 5, 5.0, "5 5 0 5")
    s3.put_object(Bucket="runs", Key=f"own/{RUN}/metrics.csv", Body=b"step\n5\n")
    plan_fit("s3://runs/own").close()
    run = tmp_path / "runs" / "own" / RUN
    torch.save({"state_dict": {}, "epoch": 0, "global_step": 8, "saved_at": 8.0}, run / "checkpoints" / "last.ckpt")
    (run / "metrics.csv").write_text("step\n5\n8\n")  # neither sent (then sent by its close())
    started = plan_fit("s3://runs/own")
    assert started.plan.value("checkpoint")["step"] == 8 and (run / "metrics.csv").read_text() == "step\n5\n8\n"
    started.close()
    put_checkpoint(s3, f"own/{RUN}/checkpoints/last.ckpt", 9, 9.0, "9 9 0 9")  # another node's, further along
    s3.put_object(Bucket="runs", Key=f"own/{RUN}/metrics.csv", Body=b"step\n5\n6\n9\n")
    started = plan_fit("s3://runs/own")
    assert started.plan.value("checkpoint")["step"] == 9 and (run / "metrics.csv").read_text() == "step\n5\n6\n9\n"
    started.close()


def test_a_sharded_checkpoint_whose_folder_lacks_a_shard_here_is_not_uploaded(s3, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from classifier_engine.run.remote_runs import RemoteRoot

    monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path))
    root = RemoteRoot("s3://runs/u")
    folder = root.mirror / RUN / "checkpoints"
    shards = folder / ".last.ckpt.1.shards"
    dcp.save({"state_dict": {"w": torch.zeros(4)}}, storage_writer=dcp.FileSystemWriter(shards))
    torch.save({"state_dict": {}, "epoch": 0, "global_step": 1, "shards": shards.name}, folder / "last.ckpt")
    (shards / "__0_0.distcp").unlink()  # as a shard of a rank on another node is: in that node's own mirror
    with pytest.warns(UserWarning, match=r"last.ckpt: its shard folder lacks 1 file\(s\) here \(__0_0.distcp: written "
                                         "by ranks of other nodes into their own mirrors\\): not uploaded"):
        assert not root.store_checkpoint(folder / "last.ckpt")
    assert stored(s3, "u") == {}


def test_a_sharded_checkpoint_whose_download_was_cut_short_is_completed_by_the_next_resume(s3, tmp_path, monkeypatch,
                                                                                             no_launcher):
    # A download cut short leaves the checkpoint file (recorded as that object) and part of its shard folder: the next
    # --ckpt_path last fetches the rest and continues from it, not from the one before it.
    import torch.distributed.checkpoint as dcp

    from classifier_engine.run.remote_runs import RemoteRoot

    monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path / "node1"))
    root = RemoteRoot("s3://runs/cut")
    folder = root.mirror / RUN / "checkpoints"
    folder.mkdir(parents=True)
    torch.save({"state_dict": {}, "epoch": 0, "global_step": 3, "saved_at": 1.0}, folder / "epoch=0-step=3.ckpt")
    shards = folder / ".last.ckpt.1.shards"
    dcp.save({"state_dict": {"w": torch.zeros(4)}}, storage_writer=dcp.FileSystemWriter(shards))
    torch.save({"state_dict": {}, "epoch": 0, "global_step": 9, "saved_at": 2.0, "shards": shards.name},
               folder / "last.ckpt")
    assert root.store_checkpoint(folder / "epoch=0-step=3.ckpt") and root.store_checkpoint(folder / "last.ckpt")
    monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path / "node2"))
    last = tmp_path / "node2" / "runs" / "cut" / RUN / "checkpoints" / "last.ckpt"

    assert plan_fit("s3://runs/cut").ckpt_path == last
    (part,) = (last.parent / shards.name).glob("*.distcp")
    part.unlink()  # as the cut download left it
    assert plan_fit("s3://runs/cut").ckpt_path == last and part.is_file()


def test_a_logger_of_another_name_gets_its_stored_runs_resumed_and_a_new_run_a_version_of_its_own(s3, tmp_path,
                                                                                                  monkeypatch,
                                                                                                  no_launcher):
    # TensorBoardLogger(name="exp"): its runs are stored under exp/, not lightning_logs/. A new run on another node took
    # exp/version_0 again (its uploads over the stored run's files), and --ckpt_path last found nothing to resume.
    from jsonargparse import Namespace

    put_checkpoint(s3, "ln/exp/version_0/checkpoints/last.ckpt", 9, 1.0, "1.0 9 0 0")
    s3.put_object(Bucket="runs", Key="ln/exp/version_0/config.yaml", Body=b"seed_everything: 1\n")
    logs = tmp_path / "node2" / "runs" / "ln" / "exp"
    monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path / "node2"))

    def plan(ckpt_path):
        logger = Namespace(class_path="lightning.pytorch.loggers.TensorBoardLogger", init_args=Namespace(name="exp"))
        started = plan_fit("s3://runs/ln", ckpt_path, logger)
        started.close()
        return started

    assert plan(None).plan.value("run dir")["path"] == str(logs / "version_1")
    assert plan("last").ckpt_path == logs / "version_0" / "checkpoints" / "last.ckpt"
    assert stored(s3, "ln")["exp/version_0/config.yaml"] == len(b"seed_everything: 1\n")
    # One writing its run dirs outside the root: refused in one line (it ended in a ValueError when claiming one).
    from classifier_engine.errors import ConfigError

    elsewhere = Namespace(class_path="lightning.pytorch.loggers.CSVLogger", init_args=Namespace(
        save_dir=str(tmp_path / "local")))
    with pytest.raises(ConfigError, match=r"s3://runs/ln: the logger writes its run dirs in .*local/lightning_logs, "
                                          "outside the root \\(its mirror\\), where nothing is stored"):
        plan_fit("s3://runs/ln", None, elsewhere)
    assert not (tmp_path / "local").exists()
