"""Every user-settable value is checked before anything is written: one short line naming the option and what it
expects, exit 2, no traceback, no run dir (issue 21, item 3).

    python -m pytest tests/test_value_checks.py -q

Most cases run in-process (the real CLI parser, or the class called from Python) and read the line
project.errors.user_message prints; a few run `python -m project fit` for the whole contract.
"""

import argparse
import inspect
import io

import pytest
import torch

from conftest import QUICKSTART, run_project, tiny_args
from project import ImageNetDataModule
from project.cli import cli_main
from project.data.progressive_resizing import ProgressiveResizing
from project.errors import ConfigError, UserError, user_message


def entries_under(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def cli_error(tmp_path, *args: str) -> BaseException:
    """The exception the real CLI (quickstart config, no subcommand) stops with for `args`."""
    with pytest.raises(Exception) as caught:
        cli_main(["--config", str(QUICKSTART), f"--trainer.default_root_dir={tmp_path / 'runs'}", *args], run=False)
    return caught.value


def assert_one_short_line(message, expected: str) -> None:
    assert message is not None, "not recognised as the user's mistake: it would print a traceback"
    assert "\n" not in message and len(message) < 300, message
    assert expected in message, message


# ------------------------------------------------------------------------------------------------------------------
# Data options: ImageNetDataModule.__init__ (types in project/data/options.py) and ProgressiveResizing
# ------------------------------------------------------------------------------------------------------------------

RAMP_INVERTED = "--data.progressive_resizing={start_size: 64, end_size: 32, start_epoch: 5, end_epoch: 2}"

# option: (keyword arguments of a Python call that get it wrong, the text of the line). Every __init__ parameter is
# here or in DATA_TYPE_ONLY (test_every_data_option_is_checked).
DATA_BAD_VALUES = {
    "root": ({"root": None}, "data.root is not set: pass --data.root"),
    "batch_size": ({"batch_size": 0}, "data.batch_size: expected an int >= 1, got 0"),
    "num_workers": ({"num_workers": -1}, "data.num_workers: expected an int >= 0, got -1"),
    "prefetch_factor": ({"prefetch_factor": 0, "num_workers": 2}, "data.prefetch_factor: expected an int >= 1, got 0"),
    "train_crop_size": ({"train_crop_size": 0}, "data.train_crop_size: expected an int >= 1, got 0"),
    "train_crop_scale": ({"train_crop_scale": (0.9, 0.5)}, "got [0.9, 0.5]: swap them"),
    "hflip_prob": ({"hflip_prob": 1.5}, "data.hflip_prob: expected a probability in [0, 1], got 1.5"),
    "auto_augment": ({"auto_augment": "randaug"}, "data.auto_augment: expected one of 'trivialaugment_wide', "),
    "randaugment_num_ops": ({"randaugment_num_ops": -1}, "data.randaugment_num_ops: expected an int >= 0, got -1"),
    "randaugment_magnitude": ({"randaugment_magnitude": 31}, "data.randaugment_magnitude: expected an int in [0, 30]"),
    "random_erase_prob": ({"random_erase_prob": -0.1}, "data.random_erase_prob: expected a probability in [0, 1]"),
    "progressive_resizing": ({"progressive_resizing": ProgressiveResizing(32, 32, 0, 1), "decoder": "nvjpeg"},
                             "has one train crop size: drop data.progressive_resizing"),
    "eval_resize_size": ({"eval_resize_size": 0}, "data.eval_resize_size: expected an int >= 1, got 0"),
    "eval_crop_size": ({"eval_crop_size": -32}, "data.eval_crop_size: expected an int >= 1, got -32"),
    "predict_root": ({"predict_root": "/nowhere/photos"}, "predict root /nowhere/photos is not a folder"),
    "decoder": ({"decoder": "nvjpg"}, "data.decoder: expected one of 'auto', 'torchcodec'"),
    "normalize_on_device": ({"normalize_on_device": False, "decoder": "nvjpeg"}, "set data.normalize_on_device=true"),
    "on_corrupt": ({"on_corrupt": "skp"}, "data.on_corrupt: expected one of 'error', 'skip', got 'skp'"),
    "multiprocessing_context": ({"multiprocessing_context": "spawn"}, "data.num_workers=0 loads in the main process"),
    "ra_reps": ({"ra_reps": 0}, "data.ra_reps: expected an int >= 1, got 0"),
}
# Options whose every value of the right type works: the parser refuses another type (--data.pin_memory=maybe).
DATA_TYPE_ONLY = {
    "pin_memory": "bool",
    "persistent_workers": "bool (off by itself with num_workers=0, as the quickstart runs)",
    "seed": "int, linked from seed_everything (every int hashes to a seed)",
}


def test_every_data_option_is_checked():
    options = set(inspect.signature(ImageNetDataModule.__init__).parameters) - {"self"}
    assert options == set(DATA_BAD_VALUES) | set(DATA_TYPE_ONLY)


@pytest.mark.parametrize("option", list(DATA_BAD_VALUES))
def test_a_bad_data_value_from_python_is_one_line_naming_the_option(option, tiny_root):
    overrides, expected = DATA_BAD_VALUES[option]
    with pytest.raises(UserError) as error:
        ImageNetDataModule(**{"root": str(tiny_root), "num_workers": 0, "pin_memory": False, **overrides})
    assert_one_short_line(str(error.value), expected)


def test_a_bad_data_value_is_refused_before_the_embedded_data_set_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("PROJECT_DATA_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match="data.train_crop_size: expected an int >= 1, got 0"):
        ImageNetDataModule(root="embedded:digits", train_crop_size=0)
    assert not (tmp_path / "cache").exists()


def test_python_callers_pass_plain_numbers_and_lists(tiny_root):
    data = ImageNetDataModule(root=str(tiny_root), batch_size=4, num_workers=0, train_crop_size=32,
                              train_crop_scale=[1, 1], hflip_prob=1, random_erase_prob=0, eval_resize_size=32,
                              eval_crop_size=40)
    assert data.hparams.train_crop_size == 32 and data.hparams.hflip_prob == 1
    assert data.eval_transform(torch.zeros(3, 32, 32, dtype=torch.uint8)).shape == (3, 40, 40)  # padded, as torchvision


# --data.X=value on the command line: (arguments, the text of the line, refused while parsing (before any class is
# built) or when the data module is built (a combination, or ProgressiveResizing's own checks)).
DATA_CLI_CASES = {
    "crop size 0": (["--data.train_crop_size=0"], "data.train_crop_size: expected an int >= 1, got 0", "parse"),
    "batch size not a number": (["--data.batch_size=eight"], "data.batch_size: expected an int >= 1, got eight", "parse"),
    "optional int": (["--data.prefetch_factor=0"], "data.prefetch_factor: expected an int >= 1, got 0", "parse"),
    "optional choice": (["--data.multiprocessing_context=fok"],
                        "data.multiprocessing_context: expected one of 'fork', 'forkserver', 'spawn', got fok", "parse"),
    "scale above 1": (["--data.train_crop_scale=[0.5, 1.5]"],
                      "data.train_crop_scale: expected an area fraction in (0, 1], got 1.5", "parse"),
    "one scale": (["--data.train_crop_scale=[0.5]"], "data.train_crop_scale: Expected a tuple with 2 elements", "parse"),
    "probability": (["--data.random_erase_prob=2"], "data.random_erase_prob: expected a probability in [0, 1], got 2",
                    "parse"),
    "magnitude": (["--data.randaugment_magnitude=-1"], "data.randaugment_magnitude: expected an int in [0, 30]", "parse"),
    "bool": (["--data.pin_memory=maybe"], "data.pin_memory: expected bool, got maybe", "parse"),
    "ramp field": (["--data.progressive_resizing={start_size: abc, end_size: 32, start_epoch: 1, end_epoch: 2}"],
                   "data.progressive_resizing.start_size: expected int, got abc", "parse"),
    "scale inverted": (["--data.train_crop_scale=[0.9, 0.5]"], "swap them (--data.train_crop_scale=[0.5, 0.9])", "init"),
    "prefetch without workers": (["--data.prefetch_factor=4"], "set --data.num_workers (>= 1) or drop", "init"),
    "ramp inverted": ([RAMP_INVERTED], "--data.progressive_resizing: expected 0 <= start_epoch <= end_epoch", "init"),
    "ramp off its multiple": (["--data.progressive_resizing={start_size: 24, end_size: 32, start_epoch: 1, end_epoch: 2}"],
                              "start_size=24 is not a positive multiple of multiple=32", "init"),
}


@pytest.mark.parametrize("case", list(DATA_CLI_CASES))
def test_a_bad_data_value_on_the_command_line_is_one_line_naming_the_option(case, tmp_path):
    args, expected, when = DATA_CLI_CASES[case]
    error = cli_error(tmp_path, *args)
    assert isinstance(error, argparse.ArgumentError) == (when == "parse"), repr(error)
    assert_one_short_line(user_message(error), expected)
    assert entries_under(tmp_path) == []


def test_checked_values_reach_the_hyperparameters_as_plain_numbers_that_a_weights_only_load_accepts(tmp_path):
    cli = cli_main(["--config", str(QUICKSTART), f"--trainer.default_root_dir={tmp_path}", "--data.batch_size=16",
                    "--data.hflip_prob=0.25", "--data.train_crop_scale=[0.5, 1]"], run=False)
    data = dict(cli.datamodule.hparams)
    assert [type(data[k]) for k in ("batch_size", "train_crop_size", "hflip_prob")] == [int, int, float]
    assert type(cli.model.hparams.batch_size) is int  # linked from data.batch_size
    buffer = io.BytesIO()
    torch.save({"datamodule_hyper_parameters": data, "batch_size": cli.model.hparams.batch_size}, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)["datamodule_hyper_parameters"]["batch_size"] == 16


# The whole contract, in a real process: one refused while parsing, one by the data module, one by the ramp.
@pytest.mark.parametrize("arg, expected", [
    ("--data.train_crop_size=0", "error: data.train_crop_size: expected an int >= 1, got 0"),
    ("--data.train_crop_scale=[0.9, 0.5]", "error: data.train_crop_scale: expected [min, max] area fractions"),
    (RAMP_INVERTED, "error: --data.progressive_resizing: expected 0 <= start_epoch <= end_epoch"),
], ids=["parse", "data module", "ramp"])
def test_python_m_project_stops_on_a_bad_data_value_with_one_line_exit_2_and_nothing_written(arg, expected, tiny_root,
                                                                                              tmp_path):
    runs = tmp_path / "runs"
    result = run_project(["fit", *tiny_args(tiny_root, runs), arg])
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert errors == [result.stderr.strip().splitlines()[-1]] and errors[0].startswith(expected), result.stderr[-3000:]
    assert entries_under(runs) == []
