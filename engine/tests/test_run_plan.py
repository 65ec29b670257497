"""The run plan: computed once, printed by --plan without building, writing, claiming or downloading anything, saved as
plan.yaml by the run itself; the one writer of the parsed config.

    python -m pytest engine/tests/test_run_plan.py --durations=0
"""

import sys
import weakref

import boto3
import pytest
import yaml
from jsonargparse import Namespace

from conftest import cli_main, project_in_process, tiny_args
from local_services import s3_server

RUN = "lightning_logs/version_0"


def files_under(*roots) -> dict:
    """Every file and folder under the roots, with its size and modification time: what a dry run must not change."""
    return {str(path): (path.stat().st_size, path.stat().st_mtime_ns) for root in roots if root.exists()
            for path in [root, *sorted(root.rglob("*"))]}


def stored_objects(s3, bucket: str = "runs") -> dict:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {item["Key"]: (item["Size"], item["ETag"]) for page in pages for item in page.get("Contents", [])}


def dry(args, monkeypatch, capsys) -> list[str]:
    code, out, err = project_in_process([*args, "--plan"], monkeypatch, capsys)
    assert code == 0, err[-3000:]
    lines = out.strip().splitlines()
    assert lines[0].startswith("plan of ") and lines[0].endswith("(dry: nothing was built, written or downloaded):")
    return [line.strip() for line in lines[1:]]


def decision(lines: list[str], topic: str) -> str:
    return next(line for line in lines if line.startswith(f"{topic}: "))


def test_fit_plan_of_the_quickstart_and_of_a_global_batch_on_3_ddp_ranks_changes_nothing(
        tiny_root, tmp_path, data_cache, monkeypatch, capsys):
    before = files_under(tmp_path, tiny_root, data_cache)
    lines = dry(["fit", *tiny_args(tiny_root, tmp_path / "runs")], monkeypatch, capsys)
    assert decision(lines, "world size") == "world size: 1 (trainer.devices 1 x trainer.num_nodes 1)"
    assert decision(lines, "global batch").startswith("global batch: 8 = 8 per process x 1 process x 1 accumulated")
    assert decision(lines, "checkpoint") == "checkpoint: none (no --ckpt_path: a new run)"
    assert decision(lines, "run dir") == (f"run dir: {tmp_path / 'runs' / RUN}, new (the next free version under "
                                          f"{tmp_path / 'runs' / 'lightning_logs'})")
    lines = dry(["fit", *tiny_args(tiny_root, tmp_path / "runs"), "--global_batch_size", "48", "--trainer.devices", "3",
                 "--trainer.strategy", "ddp"], monkeypatch, capsys)
    assert decision(lines, "world size") == "world size: 3 (trainer.devices 3 x trainer.num_nodes 1)"
    assert decision(lines, "strategy").startswith("strategy: ddp (torch DDP, ranks started by popen")
    assert decision(lines, "global batch") == ("global batch: 48 = 8 per process x 3 processes x 2 accumulated "
                                               "(--global_batch_size 48, data.batch_size 8 at most)")
    assert "    sets trainer.accumulate_grad_batches = 2" in [f"    {line}" for line in lines]
    assert files_under(tmp_path, tiny_root, data_cache) == before  # no run dir, no lock, no data written


@pytest.mark.slow
def test_a_resumes_plan_names_its_checkpoint_and_run_dir_and_changes_nothing(tiny_root, tmp_path, monkeypatch,
                                                                              capsys):
    runs = tmp_path / "runs"
    cli_main(["fit", *tiny_args(tiny_root, runs)])
    before = files_under(runs)
    lines = dry(["fit", *tiny_args(tiny_root, runs, "--trainer.max_epochs=2"), "--ckpt_path=last"], monkeypatch,
                capsys)
    last = runs / RUN / "checkpoints" / "last.ckpt"
    assert decision(lines, "checkpoint") == (f"checkpoint: {last} (epoch 0, step 5) (--ckpt_path last: resuming from "
                                             f"{last})")
    assert decision(lines, "run dir") == f"run dir: {runs / RUN}, resumed (the resumed checkpoint's run dir)"
    assert files_under(runs) == before  # the lock, config.yaml, plan.yaml, the checkpoints: as they were


@pytest.mark.slow
def test_the_plan_of_an_s3_root_lists_the_store_and_writes_neither_there_nor_in_the_mirror(
        tiny_root, tmp_path, monkeypatch, capsys):
    with s3_server(bucket="runs", authenticated=False) as env:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path / "node1"))
        cli_main(["fit", *tiny_args(tiny_root, "s3://runs/p")])
        s3 = boto3.session.Session().client("s3")
        stored = stored_objects(s3)
        monkeypatch.setenv("CLASSIFIER_ENGINE_RUN_MIRROR", str(tmp_path / "node2"))  # another node: an empty mirror
        lines = dry(["fit", *tiny_args(tiny_root, "s3://runs/p", "--trainer.max_epochs=2"), "--ckpt_path=last"],
                    monkeypatch, capsys)
        mirror = tmp_path / "node2" / "runs" / "p"
        assert decision(lines, "run root").startswith(f"run root: url s3://runs/p, mirror {mirror} (an object store")
        assert decision(lines, "checkpoint").startswith(
            f"checkpoint: s3://runs/p/{RUN}/checkpoints/last.ckpt (step 5) (--ckpt_path last: the stored "
            "checkpoint furthest along by its upload record")
        assert decision(lines, "run dir").startswith(f"run dir: {mirror / RUN}, resumed")
        assert stored_objects(s3) == stored and not (tmp_path / "node2").exists()
        lines = dry(["fit", *tiny_args(tiny_root, "s3://runs/p")], monkeypatch, capsys)  # a new run: the next version
        assert decision(lines, "run dir").startswith(f"run dir: {mirror / 'lightning_logs' / 'version_1'}, new")
        assert stored_objects(s3) == stored and not (tmp_path / "node2").exists()
        # A stored checkpoint named by its URL: the plan names it; the start downloads it alone and validates it.
        given = f"s3://runs/p/{RUN}/checkpoints/last.ckpt"
        lines = dry(["validate", *tiny_args(tiny_root, "s3://runs/p"), f"--ckpt_path={given}"], monkeypatch, capsys)
        assert decision(lines, "checkpoint") == (f"checkpoint: {given} (--ckpt_path: a stored checkpoint, which a "
                                                 "start downloads into the mirror)")
        assert stored_objects(s3) == stored and not (tmp_path / "node2").exists()
        cli = cli_main(["validate", *tiny_args(tiny_root, "s3://runs/p"), f"--ckpt_path={given}"])
        assert cli.started.ckpt_path == mirror / RUN / "checkpoints" / "last.ckpt"
        assert [p.name for p in mirror.rglob("*.ckpt")] == ["last.ckpt"] and "val/acc1" in cli.trainer.callback_metrics


@pytest.mark.slow
def test_a_runs_plan_yaml_holds_what_plan_printed_and_a_resume_says_what_changed(tiny_root, tmp_path, monkeypatch,
                                                                                 capsys):
    args = ["fit", *tiny_args(tiny_root, tmp_path, "--global_batch_size=16")]
    printed = dry(args, monkeypatch, capsys)
    cli_main(args)
    stored = yaml.safe_load((tmp_path / RUN / "plan.yaml").read_text())
    saved = [line for entry in stored["decisions"].values() if not entry["line"].startswith("steps per epoch")
             for line in [entry["line"], *(f"sets {key} = {value!r}" for key, value in entry.get("sets", {}).items())]]
    assert [line for line in printed if not line.startswith("sets trainer.logger =")] == [
        line for line in saved if not line.startswith("sets trainer.logger =")]  # (a Namespace printed as a dict)
    assert stored["decisions"]["steps per epoch"]["value"] == 2  # 40 images, 16 a step: counted at train start
    first = (tmp_path / RUN / "plan.yaml").read_text()
    cli = cli_main(["fit", *tiny_args(tiny_root, tmp_path, "--global_batch_size=8", "--trainer.max_epochs=2"),
                    "--ckpt_path=last"])
    assert cli.started.plan.value("changed since the last start") == [
        "global batch global 16, per_process 8, processes 1, accumulation 2, fixed True -> global 8, per_process 8, "
        "processes 1, accumulation 1, fixed True"]
    assert (tmp_path / RUN / "plan.1.yaml").read_text() == first  # the first start's, kept


@pytest.mark.slow
def test_validate_test_predict_export_and_sweep_take_plan_too_and_write_nothing(tiny_root, tmp_path, monkeypatch,
                                                                                capsys):
    runs = tmp_path / "runs"
    cli_main(["fit", *tiny_args(tiny_root, runs)])
    last = runs / RUN / "checkpoints" / "last.ckpt"
    before = files_under(runs)
    for subcommand in ("validate", "test", "predict"):
        lines = dry([subcommand, *tiny_args(tiny_root, runs), f"--ckpt_path={last}"], monkeypatch, capsys)
        assert decision(lines, "checkpoint").startswith(f"checkpoint: {last} (epoch 0, step 5)")
        assert decision(lines, "run dir").startswith(f"run dir: {runs / 'lightning_logs' / 'version_1'}, new")
    lines = dry(["export", "--ckpt_path", str(last)], monkeypatch, capsys)
    assert decision(lines, "out dir").startswith(f"out dir: {runs / RUN / 'export'}")
    assert files_under(runs) == before


def test_only_the_plan_writes_the_parsed_config(tiny_root, tmp_path, monkeypatch):
    # Every assignment into a jsonargparse Namespace is recorded with the first caller outside Namespace's own
    # methods; after a start, none of the parsed config's namespaces may have been written by the engine's or the
    # template's code other than config_edits.py's apply_edits.
    writes = []
    original = Namespace.__setattr__

    def recording(self, name, value):
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__") == "jsonargparse._namespace":
            frame = frame.f_back
        module = frame.f_globals.get("__name__", "") if frame is not None else ""
        if module.startswith(("classifier_engine", "project")):
            writes.append((weakref.ref(self), f"{module}.{frame.f_code.co_name}"))
        original(self, name, value)

    monkeypatch.setattr(Namespace, "__setattr__", recording)
    runs = tmp_path / "runs"
    starts = [["fit", *tiny_args(tiny_root, runs, "--global_batch_size=16", "--seed_everything=true")],
              ["fit", *tiny_args(tiny_root, runs, "--trainer.max_epochs=2"), "--ckpt_path=last"],
              ["validate", *tiny_args(tiny_root, runs), "--ckpt_path=last"]]
    for args in starts:
        writes.clear()
        config = cli_main(args).config
        nodes = [node for node in [config, *(v for _, v in config.items(branches=True))] if isinstance(node, Namespace)]
        writers = {writer for ref, writer in writes if any(ref() is node for node in nodes)}
        assert writers <= {"classifier_engine.config_edits.apply_edits", "classifier_engine.config_edits._set"}, writers
        assert writers, "the recording saw no write at all: it would not see another writer either"


def test_a_pass_that_assigns_into_the_config_is_told_to_return_an_edit(tiny_root, tmp_path):
    def assigning(given):
        given.config.trainer.max_epochs = 3
        return []

    with pytest.raises(TypeError, match="read-only outside config_edits.py: return the change as an edit"):
        cli_main(["fit", *tiny_args(tiny_root, tmp_path), "--plan"], passes=[assigning])


@pytest.mark.parametrize("args, line", [
    (["validate", "--global_batch_size=8"], "--global_batch_size is fit's: validate does not use it; drop it"),
    (["fit", "--predictions.output=x.csv"], "--predictions.output is predict's: fit does not use it; drop it"),
    (["test", "--last_checkpoint.every_n_steps=2"], "--last_checkpoint.every_n_steps is fit's: test does not use it; "
                                                    "drop it"),
    (["validate", "--global_batch", "8"], "--global_batch is fit's: validate does not use it; drop it"),  # a prefix
])
def test_an_option_the_subcommand_does_not_use_is_refused_in_one_line(args, line, tiny_root, tmp_path, monkeypatch,
                                                                      capsys):
    code, _, err = project_in_process([args[0], *tiny_args(tiny_root, tmp_path), *args[1:]], monkeypatch, capsys)
    assert (code, err.strip().splitlines()[-1]) == (2, f"error: {line}")
    assert not tmp_path.joinpath("lightning_logs").exists()


@pytest.mark.slow
def test_last_on_a_finished_run_says_it_is_complete_and_which_option_continues_it(tiny_root, tmp_path, monkeypatch,
                                                                                   capsys):
    # Issue 47: it trained nothing for 27 s and said only Lightning's "max_epochs reached".
    runs = tmp_path / "runs"
    cli_main(["fit", *tiny_args(tiny_root, runs)])
    before = files_under(runs)
    code, out, err = project_in_process(["fit", *tiny_args(tiny_root, runs), "--ckpt_path=last"], monkeypatch, capsys)
    assert code == 0, err[-3000:]
    assert ("  finished: the run is complete, nothing to train (its 1 epochs are trainer.max_epochs 1: continue it "
            "with a larger --trainer.max_epochs)") in (out + err).splitlines()
    assert files_under(runs) == before  # nothing built, nothing written
