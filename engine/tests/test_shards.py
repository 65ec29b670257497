"""Shards (classifier_engine/data/make_shards.py, ShardDataModule): a conversion that resumes and is never
half-valid, a chunk-aware order drawn from the seed, exact resume and exact evaluation, and a real object store
(moto's server).

    python -m pytest tests/test_shards.py --durations=0
"""

import io
import json
import re
import shutil
import signal
import subprocess
import sys
import time

import boto3
import pytest
import torch
from PIL import Image

from classifier_engine import ShardDataModule
from classifier_engine.data.make_shards import encode
from classifier_engine.data.make_shards import main as make_shards
from classifier_engine.errors import ConfigError
from conftest import QUICKSTART, SHRINK, callback, cli_main, make_shards_killed_at, project_in_process, run_project
from local_services import free_port, s3_server
from test_distributed import FORKED_DDP

LAST = "lightning_logs/version_0/checkpoints/last.ckpt"
SMALL = ["--shard-size", "8", "--workers", "1"]  # tiny_root: 40 train images in 5 shards, 17 val in 3


@pytest.fixture(scope="module")
def shards(tiny_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards") / "tiny"
    assert make_shards(["--source", str(tiny_root), "--out", str(out), *SMALL]) == 0
    return out


def fit_args(shards, run_dir, *extra: str) -> list[str]:
    return ["--config", str(QUICKSTART), *SHRINK, "--data.class_path=classifier_engine.data.ShardDataModule",
            f"--data.init_args.shards={shards}", "--trainer.max_epochs=2", f"--trainer.default_root_dir={run_dir}",
            *extra]


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def test_a_rerun_keeps_finished_shards_and_the_index_is_written_last(tiny_root, shards, tmp_path, monkeypatch,
                                                                     capsys):
    out = tmp_path / "out"
    make_shards_killed_at(21, monkeypatch, ["--source", str(tiny_root), "--out", str(out), *SMALL])  # in shard 2
    assert sorted(p.name for p in out.iterdir()) == ["train-00000.shard", "train-00000.shard.json",
                                                     "train-00001.shard", "train-00001.shard.json"]
    with pytest.raises(ConfigError, match=r"no index.json: a conversion not finished.*data\.make_shards"):
        ShardDataModule(shards=str(out))
    kept = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    assert make_shards(["--source", str(tiny_root), "--out", str(out), *SMALL]) == 0
    assert "6 shards written, 2 kept from an earlier run" in capsys.readouterr().out
    assert {name: (out / name).stat().st_mtime_ns for name in kept} == kept
    assert json.loads((out / "index.json").read_text()) == json.loads((shards / "index.json").read_text())
    # Other options: the old index goes first, then every shard is rewritten.
    assert make_shards(["--source", str(tiny_root), "--out", str(out), *SMALL, "--max-short-side", "16"]) == 0
    assert "starting over" in capsys.readouterr().out
    image = ShardDataModule(shards=str(out), decoder="pil")._images("val", None)[0][0]
    assert min(image.size) == 16  # 32 px images, short side at most 16


def test_a_rerun_over_damaged_records_writes_them_again(tiny_root, shards, tmp_path, capsys):
    # A record or index cut short (a full disk, a kill in another tool's copy) is not one: that shard, and the index,
    # are written again, not a traceback.
    out = tmp_path / "out"
    shutil.copytree(shards, out)
    (out / "train-00001.shard.json").write_bytes(b'{"file": "train-00001.sh')
    (out / "train-00002.shard.json").write_text("[1, 2]")
    (out / "index.json").write_bytes(b"\xff\xfe not an index")
    capsys.readouterr()
    assert make_shards(["--source", str(tiny_root), "--out", str(out), *SMALL]) == 0
    said = capsys.readouterr().out
    assert f"{out}/index.json is not an index (cut short or damaged): written again" in said, said
    assert "2 shards written, 6 kept from an earlier run" in said, said
    assert json.loads((out / "index.json").read_text()) == json.loads((shards / "index.json").read_text())


def test_conversion_errors_are_one_line_with_the_fix(tiny_root, tmp_path, tmpfs, capsys):
    train, val = tmp_path / "train.csv", tmp_path / "val.csv"  # a val label the train manifest lacks
    for name in ("cat.jpg", "dog.jpg"):
        (tmp_path / name).write_bytes(next(tiny_root.glob(f"val/{name[:3]}/*.jpg")).read_bytes())
    train.write_text("path,label\ncat.jpg,cat\n")
    val.write_text("path,label\ndog.jpg,dog\n")
    cases = {
        f"--val-source {val}: label(s) ['dog'] are not in the train manifest": [
            "--source", str(train), "--val-source", str(val), "--out", str(tmp_path / "m")],
        "does not exist": ["--source", str(tmp_path / "nowhere"), "--out", str(tmp_path / "a")],
        "cannot write there": ["--source", str(tiny_root), "--out", str(next(tiny_root.rglob("*.jpg")) / "out")],
        "no space left": ["--source", str(tiny_root), "--out", str(tmpfs("48k")), *SMALL, "--keep-original"],
        # Both wrote a set and exited 0: 1x1 px images, and no shard at all.
        "--max-short-side 0: expected an integer >= 1": ["--source", str(tiny_root), "--out", str(tmp_path / "b"),
                                                         "--max-short-side", "0"],
        "--shard-size -5: expected an integer >= 1": ["--source", str(tiny_root), "--out", str(tmp_path / "c"),
                                                      "--shard-size", "-5"],
    }
    for expected, argv in cases.items():
        capsys.readouterr()
        assert make_shards(argv) == 2, expected
        assert expected in one_line(capsys.readouterr().err)
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists() and not (tmp_path / "m").exists()


def test_the_same_seed_gives_the_same_chunk_aware_order(shards):
    def order(seed: int, epoch: int = 0) -> list[int]:
        data = ShardDataModule(shards=str(shards), batch_size=8, num_workers=0, seed=seed, shuffle_window=2)
        data.setup("fit")
        return [index for index, _ in data.train_dataloader().sampler.epoch_order(epoch)]

    first = order(7)
    assert first == order(7) and first != order(8) and first != order(7, epoch=1)
    assert sorted(first) == list(range(40))
    # Windows of 2 shards (16 images): each window's images come from 2 shards only, each shard read once.
    windows = [{index // 8 for index in first[w:w + 16]} for w in range(0, 40, 16)]
    assert [len(w) for w in windows] == [2, 2, 1] and set().union(*windows) == set(range(5))


def test_shards_decode_as_the_folder_images(tiny_root, tmp_path):
    out = tmp_path / "original"
    assert make_shards(["--source", str(tiny_root), "--out", str(out), *SMALL, "--keep-original"]) == 0
    val = ShardDataModule(shards=str(out), decoder="pil")._images("val", None)
    files = sorted(tiny_root.glob("val/*/*.jpg"))
    assert len(val) == len(files) == 17
    for index, path in enumerate(files):
        image, label = val[index]
        assert list(image.getdata()) == list(Image.open(path).convert("RGB").getdata())
        assert label == ["cat", "dog", "fox"].index(path.parent.name)


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory):
    """Two epochs of 5 steps on the local shards, uninterrupted (in-process)."""
    run_dir = tmp_path_factory.mktemp("reference")
    cli_main(["fit", *fit_args(shards, run_dir)])
    return run_dir


def weights(path) -> dict[str, torch.Tensor]:
    state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if v.is_floating_point()}


def metrics(output: str) -> dict[str, float]:
    return {key: float(value) for key, value in re.findall(r"(val/\w+)\s+([0-9.]+)", output)}


@pytest.mark.slow
def test_kill_9_mid_epoch_on_s3_shards_then_resume_gives_the_uninterrupted_weights(tiny_root, reference, object_store,
                                                                                   tmp_path, monkeypatch):
    # The shards in the object store, cached on "node-local" disk; the uninterrupted reference read the same shards
    # from a local directory. last.ckpt after every step; kill -9 as step 7 starts: epoch 1, its 3rd batch.
    url, cache = "s3://datasets/resume", f"--data.init_args.cache_dir={tmp_path / 'cache'}"
    for name, value in object_store.items():
        monkeypatch.setenv(name, value)
    assert make_shards(["--source", str(tiny_root), "--out", url, *SMALL]) == 0
    args = fit_args(url, tmp_path, cache, "--last_checkpoint.every_n_steps=1")
    killed = run_project(["fit", *args, callback("stop_callbacks.SignalAtStep", step=7)])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    cli_main(["fit", *fit_args(url, tmp_path, cache), "--ckpt_path=last"])
    resumed, uninterrupted = weights(tmp_path / LAST), weights(reference / LAST)
    assert resumed.keys() == uninterrupted.keys()
    for key in uninterrupted:
        torch.testing.assert_close(resumed[key], uninterrupted[key], rtol=0, atol=0, msg=key)


@pytest.mark.slow
def test_validate_at_1_2_and_3_ranks_gives_the_same_metrics(shards, reference, monkeypatch, capsys):
    checkpoint = f"--ckpt_path={reference / LAST}"
    code, out, err = project_in_process(["validate", *fit_args(shards, reference), checkpoint], monkeypatch, capsys)
    assert code == 0, err[-3000:]
    one = metrics(out)
    assert set(one) >= {"val/acc1", "val/acc5", "val/loss"}
    for devices in (2, 3):  # 17 images: 9 + 8, 6 + 6 + 5
        result = run_project(["validate", *fit_args(shards, reference), *FORKED_DDP,
                              f"--trainer.devices={devices}", checkpoint])
        assert result.returncode == 0, result.stderr[-3000:]
        many = metrics(result.stdout)
        assert {k: many[k] for k in ("val/acc1", "val/acc5")} == {k: one[k] for k in ("val/acc1", "val/acc5")}
        assert many["val/loss"] == pytest.approx(one["val/loss"], rel=1e-6)  # float32 sums in another order


@pytest.fixture(scope="module")
def object_store():
    """moto's S3 server on 127.0.0.1 with authentication on (an IAM user's keys) and a bucket; stopped after."""
    with s3_server(bucket="datasets") as env:
        yield env


@pytest.mark.slow
def test_shards_on_an_object_store_train_as_local_ones_and_no_secret_reaches_the_run(
        tiny_root, shards, object_store, tmp_path, monkeypatch, capsys):
    for name, value in object_store.items():
        monkeypatch.setenv(name, value)
    url = "s3://datasets/tiny"
    assert make_shards(["--source", str(tiny_root), "--out", url, *SMALL]) == 0
    cache = tmp_path / "cache"
    remote = ShardDataModule(shards=url, cache_dir=str(cache))._images("val", None)
    local = ShardDataModule(shards=str(shards))._images("val", None)
    assert all(torch.equal(remote[i][0], local[i][0]) for i in range(len(local)))
    assert sorted(p.name for p in (cache / "datasets" / "tiny").glob("*.shard")) == [f"val-0000{k}.shard" for k in
                                                                                     range(3)]
    cli_main(["fit", *fit_args(url, tmp_path / "run", f"--data.init_args.cache_dir={cache}",
                                "--trainer.max_epochs=1")])
    written = "".join(p.read_text(errors="replace") for p in (tmp_path / "run").rglob("*") if p.is_file())
    for secret in (object_store["AWS_SECRET_ACCESS_KEY"], object_store["AWS_ACCESS_KEY_ID"],
                   object_store["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]):
        assert secret not in written
    # A shard damaged in the store (same size, other bytes) is refused when downloaded, naming what to do.
    s3 = boto3.session.Session().client("s3")
    good = s3.get_object(Bucket="datasets", Key="tiny/val-00001.shard")["Body"].read()
    s3.put_object(Bucket="datasets", Key="tiny/val-00001.shard", Body=bytes(reversed(good)))
    with pytest.raises(ConfigError, match=r"val-00001.shard is not the shard its index.json lists .*make_shards"):
        ShardDataModule(shards=url, cache_dir=str(tmp_path / "other"))._images("val", None)[8]
    # At start, one line each: a missing bucket, bad credentials, an endpoint nothing answers on.
    capsys.readouterr()
    assert make_shards(["--source", str(tiny_root), "--out", "s3://nobucket/x", *SMALL]) == 2
    assert "bucket 'nobucket' does not exist" in one_line(capsys.readouterr().err)
    with monkeypatch.context() as nothing_there:
        nothing_there.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
        assert make_shards(["--source", str(tiny_root), "--out", url, *SMALL]) == 2
        assert "cannot reach the object store" in one_line(capsys.readouterr().err)
    problems = {"bucket 'nobucket' does not exist": ("s3://nobucket/tiny", {}),
                "refused the credentials": (url, {"AWS_ACCESS_KEY_ID": "AKIAWRONG", "AWS_SECRET_ACCESS_KEY": "wrong"}),
                "cannot reach the object store": (url, {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"})}
    for expected, (location, env) in problems.items():
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(ConfigError, match=expected) as error:
            ShardDataModule(shards=location)
        assert "\n" not in str(error.value) and object_store["AWS_SECRET_ACCESS_KEY"] not in str(error.value)


def test_a_stalled_object_store_is_one_line_that_never_prints_the_endpoint(tmp_path, monkeypatch, capsys):
    import socket
    import threading

    import botocore.config

    stalled = socket.create_server(("127.0.0.1", 0))  # accepts connections (the kernel does), never answers
    endpoint = f"http://127.0.0.1:{stalled.getsockname()[1]}"
    for name, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "key", "AWS_SECRET_ACCESS_KEY": "secret",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    config = botocore.config.Config  # its read timeout and attempts, short: the stall is what is tested
    monkeypatch.setattr(botocore.config, "Config", lambda **kw: config(**{**kw, "read_timeout": 0.5,
                                                                          "retries": {"max_attempts": 1}}))
    held = threading.Thread(target=lambda: [stalled.accept() for _ in range(4)], daemon=True)
    held.start()
    try:
        code, out, err = project_in_process(["fit", *fit_args("s3://datasets/tiny", tmp_path / "run")], monkeypatch,
                                            capsys)
    finally:
        stalled.close()
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert one_line(err).startswith("error: data.shards: s3://datasets/tiny: the object store stopped answering")
    assert endpoint.rsplit(":", 1)[1] not in out + err and not (tmp_path / "run").exists()


def test_s3_shards_without_the_extra_name_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)  # as if not installed
    expected = ('s3:// shards and run dirs need boto3: pip install -e "./engine[shards]" (from a clone), or '
                'pip install "classifier-engine[shards]"')
    with pytest.raises(ConfigError, match=re.escape(expected)):
        ShardDataModule(shards="s3://datasets/tiny")


def crafted_copy(shards, folder, change) -> str:
    """A copy of the shard set whose index.json is `change(index)` applied to it, or the bytes `change`."""
    folder.mkdir()
    for path in shards.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    index = json.loads((shards / "index.json").read_text())
    body = change if isinstance(change, bytes) else json.dumps(change(index) or index).encode()
    (folder / "index.json").write_bytes(body)
    return str(folder)


# (what is wrong with the index, how it is made, the text of the one line)
DAMAGED = {
    "not JSON": (b'{"format": "proj', "index.json is not JSON"),
    "not an object": (b"[1, 2]", "index.json is 'list', expected classifier-engine-shards/1"),
    "no splits": (lambda index: index.pop("splits") and None, "'splits' lacks the train and val lists of shards"),
    "labels and lengths disagree": (lambda index: index["splits"]["val"][1]["labels"].pop() and None,
                                    "splits.val[1] (val-00001.shard): its lengths, labels and bytes do not agree"),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_index_is_one_line_naming_it(case, shards, tmp_path):
    change, expected = DAMAGED[case]
    with pytest.raises(ConfigError, match=re.escape(expected)) as error:
        ShardDataModule(shards=crafted_copy(shards, tmp_path / "set", change))
    assert "\n" not in str(error.value) and "index.json" in str(error.value)


def test_a_local_index_naming_files_outside_its_folder_reads_nothing_there(shards, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "a.shard").write_bytes((shards / "train-00000.shard").read_bytes())
    for k, name in enumerate(["../elsewhere/a.shard", str(elsewhere / "a.shard"), "sub/../../elsewhere/a.shard"]):
        def rename(index, name=name):
            index["splits"]["train"][0]["file"] = name
        with pytest.raises(ConfigError, match=re.escape(f"{name!r} names a file outside")):
            ShardDataModule(shards=crafted_copy(shards, tmp_path / f"set{k}", rename))._images("train", None)[0]


def test_a_missing_shard_is_one_line_before_a_run_dir_is_made(shards, tmp_path, monkeypatch, capsys):
    folder = crafted_copy(shards, tmp_path / "set", lambda index: None)
    (tmp_path / "set" / "val-00001.shard").unlink()
    run = tmp_path / "run"
    code, _, err = project_in_process(["fit", *fit_args(folder, run)], monkeypatch, capsys)
    assert code == 2 and re.search(r"val-00001.shard is missing: copy the whole shard set", one_line(err)), err[-2000:]
    assert not run.exists()


@pytest.mark.slow
def test_an_s3_index_naming_a_path_outside_the_cache_writes_nothing_there(shards, object_store, tmp_path,
                                                                           monkeypatch):
    for name, value in object_store.items():
        monkeypatch.setenv(name, value)
    s3 = boto3.session.Session().client("s3")
    index = json.loads((shards / "index.json").read_text())
    escape = "../../../site-packages/x.pth"  # from the cache's datasets/evil/: three folders up, then down
    index["splits"]["train"][0]["file"] = escape
    shard = (shards / "train-00000.shard").read_bytes()
    for key, body in ((f"evil/{escape}", shard), ("evil/index.json", json.dumps(index).encode())):
        s3.put_object(Bucket="datasets", Key=key, Body=body)
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError, match=re.escape(f"{escape!r} names a file outside")):
        ShardDataModule(shards="s3://datasets/evil", cache_dir=str(cache))._images("train", None)[0]
    assert not (tmp_path / "site-packages").exists() and not cache.exists()



# -- an object store that misbehaves (issue 39, item 9): bounded tries with backoff, then one line; never a hang ------

@pytest.fixture
def faulty_store(tiny_root, object_store, monkeypatch):
    """The tiny shard set on the object store, reached through a FaultyProxy; the tries' bounds shrunk to test size."""
    from classifier_engine.data import shards as shard_module
    from classifier_engine.storage import object_store as store_module
    from local_services import FaultyProxy

    for name, value in object_store.items():
        monkeypatch.setenv(name, value)
    try:  # written once per module
        boto3.session.Session().client("s3").head_object(Bucket="datasets", Key="faulty/index.json")
    except boto3.exceptions.botocore.exceptions.ClientError:
        assert make_shards(["--source", str(tiny_root), "--out", "s3://datasets/faulty", *SMALL]) == 0
    monkeypatch.setattr(store_module, "READ_TIMEOUT_S", 1.0)  # a stall: 1 s without a byte, not 15
    monkeypatch.setattr(shard_module, "BACKOFF_S", 0.05)
    with FaultyProxy(object_store["AWS_ENDPOINT_URL"], match=".shard") as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        yield proxy


@pytest.mark.parametrize("fault", ["500", "cut", "stall"])
def test_a_shard_download_that_fails_is_tried_again_with_backoff_then_stops_in_one_line(faulty_store, fault,
                                                                                         tmp_path):
    faulty_store.fault, faulty_store.times = fault, 2  # two bad answers, then good ones
    data = ShardDataModule(shards="s3://datasets/faulty", cache_dir=str(tmp_path / "a"))
    assert data._images("val", None)[0] is not None and faulty_store.faults == 2
    faulty_store.times, faulty_store.faults = None, 0  # now every answer is bad
    started = time.monotonic()
    with pytest.raises(Exception) as error:
        ShardDataModule(shards="s3://datasets/faulty", cache_dir=str(tmp_path / "b"))._images("val", None)[0]
    assert type(error.value).__name__ == "DataUnavailable", repr(error.value)  # a UserError: one line, exit 2
    why = {"500": "kept failing (500 InternalError)", "cut": "cut the connection mid-transfer",
           "stall": "stopped answering (no byte for 1 s)"}[fault]
    assert str(error.value) == (f"data.shards: s3://datasets/faulty/val-00000.shard: the object store {why}, 4 tries: "
                                "check the server behind AWS_ENDPOINT_URL (or AWS's status when unset) and that "
                                "variable, then rerun (--ckpt_path last continues a run)")
    assert faulty_store.faults == 4 and time.monotonic() - started < 60  # backoff 1+2+4 s; not a retry per minute
    assert not list((tmp_path / "b").rglob("*.shard"))  # nothing half-written in the cache


@pytest.mark.slow
def test_an_object_store_failing_mid_run_stops_in_one_line_with_the_step_saved(faulty_store, tmp_path, monkeypatch,
                                                                                 capsys):
    # The first train shard downloads; every later one gets a 500: one `error:` line, exit 2, no traceback, last.ckpt
    # at the step reached, from which --ckpt_path last continues once the store answers again.
    faulty_store.match, faulty_store.fault, faulty_store.after = "/faulty/train-", "500", 1
    args = ["fit", *fit_args("s3://datasets/faulty", tmp_path, f"--data.init_args.cache_dir={tmp_path / 'cache'}",
                             "--data.init_args.shuffle_window=1", "--data.init_args.num_workers=1",
                             "--trainer.max_epochs=1")]
    code, _, err = project_in_process(args, monkeypatch, capsys)
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err[-3000:]
    saved = tmp_path / LAST
    assert re.fullmatch(r"error: data.shards: s3://datasets/faulty/train-\d{5}\.shard: the object store kept failing "
                        r"\(500 InternalError\), 4 tries: .* then rerun \(--ckpt_path last continues a run\); saved "
                        rf"{re.escape(str(saved))} at global step 1: the same command with --ckpt_path last continues "
                        r"there", lines[0]), lines[0]
    assert torch.load(saved, weights_only=True)["global_step"] == 1
    faulty_store.fault = None
    code, _, err = project_in_process([*args, "--ckpt_path=last"], monkeypatch, capsys)
    assert code == 0, err[-3000:]
    assert torch.load(saved, weights_only=True)["global_step"] == 5


def test_mistyped_s3_urls_and_an_unwritable_cache_dir_are_one_line_naming_the_option(tmp_path, tmpfs):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cases = {"s3://": "data.shards s3://: '' is not a bucket name",
             "s3:///tiny": "data.shards s3:///tiny: '' is not a bucket name",
             "s3://My_Bucket/tiny": "data.shards s3://My_Bucket/tiny: 'My_Bucket' is not a bucket name",
             "s3:/datasets/tiny": "data.shards s3:/datasets/tiny: expected s3://bucket/prefix",
             "S3://datasets/tiny": "data.shards S3://datasets/tiny: expected s3://bucket/prefix"}
    for url, expected in cases.items():
        with pytest.raises(ConfigError) as error:
            ShardDataModule(shards=url)
        assert str(error.value).startswith(expected) and "\n" not in str(error.value), str(error.value)
    with pytest.raises(ConfigError, match=rf"^data.cache_dir {blocker / 'cache'}: cannot write there \(a file is in "
                                          r"the way\): pass a writable node-local folder"):
        ShardDataModule(shards="s3://datasets/tiny", cache_dir=str(blocker / "cache"))
    read_only = tmpfs("1m")
    subprocess.run(["mount", "-o", "remount,ro", str(read_only)], check=True)
    with pytest.raises(ConfigError, match=rf"^data.cache_dir {read_only}: cannot write there \({read_only} is not "
                                          r"writable\)"):
        ShardDataModule(shards="s3://datasets/tiny", cache_dir=str(read_only))


def test_the_writer_says_what_it_re_encodes_and_names_a_kept_file_that_is_not_an_image(tmp_path, capsys):
    # Issue 47: small PNGs became JPEG q90 and gray images RGB without a word; --keep-original packed a broken .jpg
    # without a word, and the fit on that set then stopped on a line that did not name it.
    from conftest import write_image_folder

    root = write_image_folder(tmp_path / "images", {"a": (4, 2), "b": (4, 2)})
    Image.new("RGB", (16, 16), (9, 9, 9)).save(root / "train" / "a" / "small.png")
    Image.new("L", (600, 400), 128).save(root / "train" / "b" / "gray.jpg")
    assert make_shards(["--source", str(root), "--out", str(tmp_path / "s"), *SMALL]) == 0
    assert ("make_shards: 2 images re-encoded as JPEG quality 90 beyond resizing (1: PNG as JPEG, 1: L as RGB); "
            "--keep-original stores them as they are") in capsys.readouterr().out.splitlines()
    (root / "train" / "a" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a JPEG after all")
    assert make_shards(["--source", str(root), "--out", str(tmp_path / "kept"), *SMALL, "--keep-original"]) == 2
    broken = root / "train" / "a" / "broken.jpg"
    assert capsys.readouterr().err.strip().startswith(f"make_shards: cannot decode {broken}")
    # A JPEG cut short after its scan began: its headers verify, its pixels do not decode (kept or small enough to
    # keep its bytes, it was packed, and the fit stopped on the shard).
    data = (root / "train" / "a" / "a_000.jpg").read_bytes()
    broken.write_bytes(data[:data.index(b"\xff\xda") + 200])
    for flags in ((), ("--keep-original",)):
        assert make_shards(["--source", str(root), "--out", str(tmp_path / "cut"), *SMALL, *flags]) == 2
        assert capsys.readouterr().err.strip().startswith(f"make_shards: cannot decode {broken}")


def test_a_rerun_rewrites_the_shards_of_changed_images_and_shards_gone_missing(tiny_root, tmp_path, capsys):
    # A rerun said "complete already: nothing to do" over a replaced image (the fix its own error line asks for) and
    # over a deleted shard, whose error line says to rewrite it.
    source, out = tmp_path / "source", tmp_path / "out"
    shutil.copytree(tiny_root, source)
    assert make_shards(["--source", str(source), "--out", str(out), *SMALL]) == 0
    first = sorted(source.glob("val/*/*.jpg"))[0]
    Image.new("RGB", (32, 32), (250, 0, 0)).save(first)  # the same name, other pixels
    (out / "train-00001.shard").unlink()
    capsys.readouterr()
    assert make_shards(["--source", str(source), "--out", str(out), *SMALL]) == 0
    assert "2 shards written, 6 kept from an earlier run" in capsys.readouterr().out
    module = ShardDataModule(shards=str(out), decoder="pil")
    assert module._images("val", None)[0][0].getpixel((16, 16))[0] > 200
    assert len(module._images("train", None)) == 40
    (out / "val-00002.shard").unlink()  # the index says complete; its shard is not there
    assert make_shards(["--source", str(source), "--out", str(out), *SMALL]) == 0
    assert "1 shards written, 7 kept from an earlier run" in capsys.readouterr().out
    (out / "train-00003.shard").write_bytes(b"cut")  # the index says complete; its shard is cut short
    assert make_shards(["--source", str(source), "--out", str(out), *SMALL]) == 0
    assert "1 shards written, 7 kept from an earlier run" in capsys.readouterr().out


def test_re_encoded_images_keep_16_bit_gray_and_the_exif_orientation_as_the_folder_decoders_read_them(tmp_path):
    import numpy as np

    from classifier_engine.data.decoders import decode_pil
    from classifier_engine.data.make_shards import Options

    gray = tmp_path / "gray16.png"  # Pillow's convert("RGB") clips 16-bit values at 255: all but white
    Image.fromarray(np.full((32, 32), 32768, dtype=np.uint16)).save(gray)
    stored = Image.open(io.BytesIO(encode(str(gray), Options(max_short_side=16))[0]))
    assert abs(np.asarray(stored).mean() - np.asarray(decode_pil(str(gray))).mean()) < 3
    rotated, exif = tmp_path / "rotated.jpg", Image.Exif()
    exif[0x0112] = 6  # 90 degrees: the pixels' rows are the image's columns
    pixels = np.zeros((40, 60, 3), np.uint8)
    pixels[:, :30] = 255  # white on the left, so white on top once turned
    Image.fromarray(pixels).save(rotated, exif=exif)
    stored = np.asarray(Image.open(io.BytesIO(encode(str(rotated), Options(max_short_side=20))[0])))
    assert stored.shape[:2] == (30, 20) and stored[:10].mean() > 200 and stored[-10:].mean() < 50
