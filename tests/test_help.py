"""Help that helps: short `fit --help`, the `backbone` option named by its form, every subcommand listed.

    python -m pytest tests/test_help.py
"""

import runpy
import sys

import pytest
import yaml
from classifier_engine.errors import ConfigError

import project
from conftest import CONFIGS, project_in_process
from project.model import ImageClassifier

MY_NET = """
model:
  backbone:
    class_path: torch.nn.Identity
"""


def test_help_does_not_enumerate_every_nn_module_subclass_for_backbone(monkeypatch, capsys):
    code, out, _ = project_in_process(["fit", "--model.help", "ImageClassifier"], monkeypatch, capsys)
    assert code == 0
    assert "known subclasses" not in out and "torch.nn.Linear" not in out
    assert "`class_path: my_module.MyNet`" in " ".join(out.split())
    assert len(out.splitlines()) < 250, len(out.splitlines())  # 885 with the list of every nn.Module subclass
    code, out, _ = project_in_process(["fit", "--help"], monkeypatch, capsys)
    assert code == 0 and "torch.nn.Linear" not in out


def test_top_level_help_lists_export_and_sweep(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["python -m project", "--help"])
    with pytest.raises(SystemExit) as exit:
        runpy.run_module(project.__name__, run_name="__main__")  # the room, renamed or not
    assert exit.value.code in (0, None)
    out = capsys.readouterr().out
    assert "    fit " in out
    for command in ("export", "sweep"):
        assert f"python -m project {command} --help" in out


def test_sweep_help_is_help_not_an_error(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["python -m project", "sweep", "--help"])
    runpy.run_module(project.__name__, run_name="__main__")  # the room, renamed or not
    out, err = capsys.readouterr()
    assert out.startswith("usage: python -m project sweep") and "n_trials" in out and "space" in out
    assert err == ""


def test_print_config_shows_arch_null_beside_the_backbone_that_replaces_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_net.yaml").write_text(MY_NET)
    args = ["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--config", str(tmp_path / "my_net.yaml"),
            "--print_config"]
    code, out, err = project_in_process(args, monkeypatch, capsys)
    assert code == 0, err
    model = yaml.safe_load(out)["model"]
    model = model.get("init_args", model)
    assert model["arch"] is None and model["backbone"]["class_path"] == "torch.nn.Identity"


def test_an_arch_flag_beside_a_backbone_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    # The backbone was built and the flag's arch dropped without a word ("null in the config", said the plan).
    (tmp_path / "my_net.yaml").write_text(MY_NET)
    args = ["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--config", str(tmp_path / "my_net.yaml"),
            f"--trainer.default_root_dir={tmp_path / 'runs'}", "--model.arch", "resnet50", "--plan"]
    code, _, err = project_in_process(args, monkeypatch, capsys)
    assert code == 2 and err.strip().splitlines()[-1] == (
        "error: --model.arch resnet50 and model.backbone torch.nn.Identity: the backbone replaces the arch; drop "
        "--model.arch, or build it with --model.backbone=null")


def test_arch_null_without_a_backbone_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="model.arch is null and there is no model.backbone"):
        ImageClassifier(num_classes=3, arch=None)
