"""README "Bad input": each mistake ends `python -m classifier_engine` with one line naming the culprit and the fix,
exit 2, no traceback, and nothing written. Run through the real entry point (classifier_engine's main)
in-process, and once under ddp x2 in real processes, where the failing rank's message must be the last line.

    python -m pytest tests/test_bad_input.py
"""

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import APP, CONFIGS, callback, last_line, main, new_model, start_project, tiny_args, write_image_folder


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


@pytest.fixture(scope="module")
def broken(tiny_root, tmp_path_factory) -> dict[str, Path]:
    """The inputs of the table: damaged copies of the tiny data, bad files."""
    base = tmp_path_factory.mktemp("bad_inputs")
    made = {}
    made["no_val"] = base / "no_val"
    shutil.copytree(tiny_root, made["no_val"])
    shutil.rmtree(made["no_val"] / "val")
    made["empty_class"] = base / "empty_class"
    shutil.copytree(tiny_root, made["empty_class"])
    (made["empty_class"] / "train" / "emu").mkdir()
    (made["empty_class"] / "val" / "emu").mkdir()
    made["truncated_jpeg"] = write_image_folder(base / "truncated", {"cat": (8, 2), "dog": (8, 2)})
    victim = made["truncated_jpeg"] / "train" / "cat" / "cat_003.jpg"
    victim.write_bytes(victim.read_bytes()[:200])
    made["victim"] = victim
    made["bad_class_index"] = base / "bad_class_index"
    shutil.copytree(tiny_root, made["bad_class_index"])
    (made["bad_class_index"] / "class_index.json").write_text('[{"wnid": "cat"}]')  # no "name"
    made["yaml"] = base / "bad.yaml"
    made["yaml"].write_text("model:\n  arch: [resnet18\ndata:\n  batch_size: 8\n")
    made["jpeg_ckpt"] = next((tiny_root / "val" / "cat").iterdir())
    made["other_data_ckpt"] = base / "digits.ckpt"
    ten = new_model(10)
    torch.save({"state_dict": ten.state_dict(), "epoch": 0, "global_step": 1, "hyper_parameters": dict(ten.hparams)},
               made["other_data_ckpt"])
    return made


CASES = {
    # name: (subcommand, extra args (with {placeholders} from `broken`), the data root, expected text of the line)
    "data root missing": ("fit", [], "/nonexistent/imagenet", "data root /nonexistent/imagenet does not exist"),
    "data root unset": ("fit", ["--data.root=null"], None, "data.root is not set: pass --data.root"),
    "no val/ folder": ("fit", [], "{no_val}", "has no 'val/' folder; expected layout"),
    "empty class folder": ("fit", [], "{empty_class}", "1 class folder(s) without images (emu)"),
    "class_index.json not one": ("fit", [], "{bad_class_index}", "class_index.json: not a class index (entry 0 has "
                                 "no 'name'): expected a JSON list of "),
    "unknown option": ("fit", ["--model.lrr=0.1"], "tiny", "unrecognized arguments: --model.lrr=0.1"),
    "config with a YAML error": ("fit", ["--config", "{yaml}"], "tiny", "bad.yaml: YAML syntax error at line 3"),
    "run without an end": ("fit", ["--trainer.max_epochs=-1"], "tiny", "the run has no end"),
    "devices not a number": ("fit", ["--trainer.devices=abc"], "tiny",
                             "trainer.devices='abc': expected a number of processes (--trainer.devices=2)"),
    "dp over two CPUs": ("fit", ["--trainer.strategy=dp", "--trainer.devices=2"], "tiny",
                         "dp splits each batch over GPUs: on CPU it would run one process on one device"),
    "checkpoint missing": ("validate", ["--ckpt_path=/nowhere/last.ckpt"], "tiny", "/nowhere/last.ckpt does not exist"),
    "a JPEG as checkpoint": ("validate", ["--ckpt_path={jpeg_ckpt}"], "tiny",
                             "is not a checkpoint: a .ckpt file is a torch.save archive"),
    "checkpoint of other data": ("validate", ["--ckpt_path={other_data_ckpt}"], "tiny",
                                 "has 10 classes, the data has 3"),
    "predict folder missing": ("predict", ["--data.predict_root=/nowhere/photos"], "tiny",
                               "predict root /nowhere/photos is not a folder"),
    "predictions.images missing": ("predict", ["--predictions.images=/nowhere/photos"], "tiny",
                                   "--predictions.images /nowhere/photos is not a folder: pass a folder of images"),
    "truncated JPEG": ("fit", [], "{truncated_jpeg}", "cannot decode {victim}"),
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_a_gpu_config_on_a_machine_without_one_names_the_fix(tiny_root, tmp_path, monkeypatch, capsys):
    # Lightning's "No supported gpu backend found!" said what, not the fix.
    monkeypatch.setattr(sys, "argv", [f"python -m {APP}", "fit", *tiny_args(tiny_root, tmp_path / "runs"),
                                      "--trainer.accelerator=gpu"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: No supported gpu backend found!; this machine has no GPU torch can use: run on the CPU with "
        "--trainer.accelerator=cpu (or auto)")


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_exit_2_no_traceback_nothing_written(case, broken, tiny_root, tmp_path, monkeypatch,
                                                                   capsys):
    subcommand, extra, root, expected = CASES[case]
    fill = {key: str(value) for key, value in broken.items()}
    run_root = tmp_path / "runs"
    args = tiny_args(tiny_root if root in ("tiny", None) else Path(root.format(**fill)), run_root)
    monkeypatch.setattr(sys, "argv", [f"python -m {APP}", subcommand, *args, *(a.format(**fill) for a in extra)])
    with pytest.raises(SystemExit) as exited:
        main()
    err = capsys.readouterr().err
    assert exited.value.code == 2, err[-2000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and expected.format(**fill) in last, last
    assert files_under(run_root) == []


@pytest.mark.slow
def test_under_ddp_on_a_busy_machine_the_failing_rank_prints_last_naming_itself_and_the_file(broken, tmp_path):
    # Two processes spinning on the 2 cores: the timing under which the culprit's line was lost (Lightning's launcher
    # killed that rank while it waited to print last). 16 images, batch 8, 2 ranks: the bad one is in the first step.
    # The ranks wait at the train start until the spinners run: busy cores for the failure, not for ~40 s of imports
    # (which slowed the other CI worker's tests as much).
    marker = tmp_path / "ready"
    job = start_project(["fit", *tiny_args(broken["truncated_jpeg"], tmp_path / "runs"),
                         "--config", str(CONFIGS / "cpu_ddp.yaml"),
                         callback("stop_callbacks.WaitAtTrainStart", marker=str(marker))])
    deadline = time.monotonic() + 900
    while not all(Path(f"{marker}.{rank}").exists() for rank in (0, 1)) and job.poll() is None:
        assert time.monotonic() < deadline, "the ranks never reached the train start"
        time.sleep(0.1)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.5)  # spinning before the first batch is read
        Path(f"{marker}.go").touch()
        _, stderr = job.communicate(timeout=900)
    finally:
        for burner in burners:
            burner.kill()
    assert job.returncode != 0 and "Traceback" not in stderr, stderr[-3000:]
    culprit = [line for line in stderr.splitlines() if f"cannot decode {broken['victim']}" in line]
    assert culprit and culprit[0].startswith("error (rank "), stderr[-3000:]
    last = last_line(stderr)  # the culprit is rank 1 (the seed's shuffle): Lightning's launcher may add a line
    assert last.startswith("error (rank ") and f"cannot decode {broken['victim']}" in last, stderr[-3000:]
    assert files_under(tmp_path / "runs") == []


def test_a_default_root_dir_under_a_file_or_on_a_read_only_filesystem_is_one_line_and_leaves_nothing(tiny_root,
                                                                                                     tmp_path, tmpfs):
    from classifier_engine.errors import ConfigError
    from conftest import cli_main

    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"a_file is a file, not a folder\): trainer.default_root_dir must be a "):
        cli_main(["fit", *tiny_args(tiny_root, blocker / "runs")])
    assert blocker.read_text() == "not a folder"

    read_only = tmpfs("1m")
    import subprocess

    subprocess.run(["mount", "-o", "remount,ro", str(read_only)], check=True)
    with pytest.raises(ConfigError, match=r"Read-only file system\): trainer.default_root_dir must be a writable"):
        cli_main(["fit", *tiny_args(tiny_root, read_only / "runs")])
    assert not list(read_only.iterdir())


def test_validate_on_a_read_only_root_is_one_line(tiny_root, tmp_path, tmpfs, monkeypatch, capsys):
    from conftest import project_in_process

    model = new_model(3)
    checkpoint = tmp_path / "model.ckpt"
    torch.save({"state_dict": model.state_dict(), "epoch": 0, "global_step": 1,
                "hyper_parameters": dict(model.hparams)}, checkpoint)
    read_only = tmpfs("1m")
    subprocess.run(["mount", "-o", "remount,ro", str(read_only)], check=True)
    code, _, err = project_in_process(["validate", *tiny_args(tiny_root, read_only / "runs"),
                                       f"--ckpt_path={checkpoint}"], monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith(f"error: cannot create the run dir {read_only / 'runs'}")
    assert "Read-only file system" in err


def write_bomb_and_huge(folder: Path) -> tuple[Path, Path]:
    """A 1 KB YAML alias bomb and a 50 MB (sparse) config file."""
    bomb = folder / "bomb.yaml"  # 400 bytes: nine levels of nine aliases, 387 million strings once expanded
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{k}: &a{k} [{', '.join([f'*a{k - 1}'] * 9)}]" for k in range(1, 9)]
    bomb.write_text("\n".join([*lines, "model:", "  init_args:", "    x: *a8", ""]))
    huge = folder / "huge.yaml"
    with open(huge, "wb") as file:
        file.truncate(50 * 2**20)  # sparse: the size is what is checked, before a byte is read
    return bomb, huge


def test_a_yaml_alias_bomb_and_a_50_mb_config_are_refused_before_they_are_parsed(tmp_path):
    from classifier_engine.errors import ConfigError, check_config_files

    bomb, huge = write_bomb_and_huge(tmp_path)
    for config, expected in ((bomb, r"bomb.yaml: its YAML aliases \(\*name\) expand to over 100,000 values"),
                             (huge, r"huge.yaml is 52.4 MB: a config is a few KB of YAML")):
        with pytest.raises(ConfigError, match=expected):
            check_config_files(["fit", "--config", str(config)])


def test_config_files_a_config_or_the_command_line_names_are_refused_as_the_top_level_one_is(tmp_path, monkeypatch,
                                                                                              capsys):
    # jsonargparse reads every file a config names (`config: x.yaml`, `trainer: x.yaml`) and a `--data x.yaml`.
    from conftest import project_in_process

    bomb, huge = write_bomb_and_huge(tmp_path)
    (tmp_path / "includes.yaml").write_text("config: bomb.yaml\n")
    (tmp_path / "trainer.yaml").write_text("trainer: huge.yaml\n")
    aliases = "its YAML aliases (*name) expand to over 100,000 values (an alias bomb?); write the values out"
    for args, expected in ((["--config", str(tmp_path / "includes.yaml")],
                            f"config file bomb.yaml (named in {tmp_path / 'includes.yaml'}): {aliases}"),
                           (["--config", str(tmp_path / "trainer.yaml")],
                            f"config file huge.yaml (named in {tmp_path / 'trainer.yaml'}) is 52.4 MB"),
                           (["--data", str(bomb)], f"config file {bomb}: {aliases}")):
        code, _, err = project_in_process(["fit", *args], monkeypatch, capsys)
        assert code == 2 and "Traceback" not in err and expected in err.strip().splitlines()[-1], err[-2000:]


def test_a_data_error_in_a_loader_worker_is_the_same_one_line_as_in_the_main_process(broken, tmp_path, monkeypatch,
                                                                                      capsys):
    # torch raises a worker's error again as "Caught X in DataLoader worker process 0" with the worker's traceback:
    # the line must be the one the main process prints for the same image (issue 39, item 10).
    from conftest import project_in_process

    lines = {}
    for workers in (0, 1):
        args = ["fit", *tiny_args(broken["truncated_jpeg"], tmp_path / f"w{workers}"), f"--data.num_workers={workers}"]
        code, _, err = project_in_process(args, monkeypatch, capsys)
        assert code == 2 and "Traceback" not in err and "DataLoader worker" not in err, err[-3000:]
        lines[workers] = [line for line in err.splitlines() if line.startswith("error")]
    assert len(lines[0]) == 1 and f"cannot decode {broken['victim']}" in lines[0][0], lines
    assert lines[1] == lines[0]


@pytest.mark.parametrize("extra, hidden, args", [
    ("sweep", "optuna", ["sweep", "--config", str(CONFIGS / "quickstart.yaml")]),
    ("shards", "boto3", ["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--trainer.default_root_dir=s3://runs/x",
                         "--plan"]),
])
def test_a_missing_extra_is_one_line_naming_the_install_that_works(extra, hidden, args, monkeypatch, capsys):
    from conftest import project_in_process

    monkeypatch.setitem(sys.modules, hidden, None)  # as if not installed: its import raises ImportError
    # A library module importing it at its top may be loaded already (by another test in this worker): load it again.
    for name in [name for name, module in sys.modules.items()
                 if name.startswith("classifier_engine.") and module is not None and hidden in vars(module)]:
        monkeypatch.delitem(sys.modules, name)
    code, _, err = project_in_process(args, monkeypatch, capsys)
    assert code == 2 and err.strip().splitlines()[-1].endswith(
        f'pip install -e "./engine[{extra}]" (from a clone), or pip install "classifier-engine[{extra}]"'), err[-2000:]
    assert "Traceback" not in err
