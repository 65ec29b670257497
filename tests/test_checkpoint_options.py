"""The room's model and options against a checkpoint: an explicit flag over the checkpoint's value, another arch, the
optimizer check on resume, the model's weights-only load, and the README's export line naming a real checkpoint.

    python -m pytest tests/test_checkpoint_options.py
"""

import re
import shutil
from pathlib import Path

import pytest
import torch
from classifier_engine.errors import CheckpointError

from conftest import REPO, cli_main, project_in_process, tiny_args
from project import ImageClassifier

LAST = "lightning_logs/version_0/checkpoints/last.ckpt"


def tree(root: Path) -> dict[str, int]:
    """Every file under root with its mtime: what a failed command must leave untouched."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def trained(tiny_root, tmp_path_factory) -> Path:
    """A finished 2-epoch run (in-process): its root holds version_0 with last.ckpt and the best checkpoint."""
    root = tmp_path_factory.mktemp("trained")
    cli_main(["fit", *tiny_args(tiny_root, root, "--trainer.max_epochs=2")])
    return root


class Payload:
    """Unpickling it runs code (creates a file): what a crafted checkpoint does to torch.load(weights_only=False)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture
def crafted(trained, tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A real checkpoint with a code-running object added; torch.load's default was weights_only=False (torch < 2.6)."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    marker = tmp_path / "pwned"
    checkpoint = torch.load(trained / LAST, weights_only=True)
    checkpoint["hyper_parameters"]["payload"] = Payload(marker)
    path = tmp_path / "crafted.ckpt"
    torch.save(checkpoint, path)
    return path, marker


def test_a_crafted_checkpoint_is_refused_by_the_models_load_from_checkpoint(crafted):
    path, marker = crafted
    with pytest.raises(Exception, match="Weights only load failed"):  # weights-only, as the library's data modules
        ImageClassifier.load_from_checkpoint(path)
    assert not marker.exists()


def test_an_explicit_flag_wins_over_the_checkpoints_value_and_is_said(trained, tiny_root, tmp_path, caplog):
    root = tmp_path / "run"
    shutil.copytree(trained, root)
    cli = cli_main(["fit", *tiny_args(tiny_root, root, "--trainer.max_epochs=3", "--model.optim.lr_per_256=0.8"),
                    f"--ckpt_path={root / LAST}"])
    assert cli.model.optim.lr_per_256 == 0.8
    assert cli.trainer.optimizers[0].param_groups[0]["initial_lr"] == pytest.approx(0.8 * 8 / 256)
    assert "given instead: model.optim.lr_per_256 0.8 (the checkpoint's: 0.2)" in caplog.text


def test_validate_with_another_arch_than_the_checkpoint_stops_naming_both(trained, tiny_root, tmp_path):
    with pytest.raises(CheckpointError, match=r"holds another network \(its model.arch is 'resnet18', this model's is "
                                              r"'resnet50'\): network.conv1.weight|holds another network \(its model"):
        cli_main(["validate", *tiny_args(tiny_root, tmp_path / "run"), "--model.arch=resnet50",
                  f"--ckpt_path={trained / LAST}"])
    assert not (tmp_path / "run").exists()


def _copy_of(trained: Path, root: Path) -> Path:
    """A copy of the trained run; its config.yaml names the copy (the logger's save_dir, the root), not the original."""
    shutil.copytree(trained, root)
    config = root / "lightning_logs" / "version_0" / "config.yaml"
    config.write_text(config.read_text().replace(str(trained), str(root)))
    return root


def test_predict_with_the_runs_config_leaves_its_config_yaml_for_export_and_the_readme_names_a_real_checkpoint(
        trained, tmp_path, monkeypatch, capsys):
    run = _copy_of(trained, tmp_path / "run") / "lightning_logs" / "version_0"
    before = (run / "config.yaml").read_bytes()
    args = ["predict", f"--config={run / 'config.yaml'}", f"--ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
            f"--predictions.output={tmp_path / 'predictions.csv'}"]
    code, _, err = project_in_process(args, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    # only fit writes the run's config.yaml: export rebuilds the network from it (it refused predict's keys)
    assert (run / "config.yaml").read_bytes() == before and not list(run.glob("config.*.yaml"))
    readme = (REPO / "README.md").read_text()
    (name,) = re.findall(r"python -m project export --ckpt_path RUN/checkpoints/(\S+)", readme)
    assert (run / "checkpoints" / name).is_file(), sorted(p.name for p in (run / "checkpoints").iterdir())


def test_a_resume_refused_by_the_optimizer_check_leaves_the_run_dir_as_it_was(trained, tiny_root, tmp_path,
                                                                               monkeypatch, capsys):
    root = _copy_of(trained, tmp_path / "run")
    run = root / "lightning_logs" / "version_0"
    before = {name: mtime for name, mtime in tree(run).items() if name != ".lock"}
    args = ["fit", *tiny_args(tiny_root, root, "--trainer.max_epochs=3", "--model.optim.optimizer=adamw"),
            "--ckpt_path=last"]
    code, _, err = project_in_process(args, monkeypatch, capsys)
    assert code == 2 and "model.optim.optimizer=sgd, this run asks for adamw" in err, err[-3000:]
    assert {name: mtime for name, mtime in tree(run).items() if name != ".lock"} == before  # no empty event file
