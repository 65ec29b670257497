"""README's Python snippets run as written: "Add your model"'s network and "Bring your own data"'s data module, each
saved as the file the README names (in a temporary folder) and trained with the README's own command, shrunk.

    python -m pytest tests/test_readme_snippets.py
"""

import re
import shlex
import sys

import pytest

from conftest import REPO, tiny_args
from project import cli_main

README = (REPO / "README.md").read_text()


def section(title: str) -> str:
    return re.search(rf"^## {re.escape(title)}.*?$(.*?)(?=^## )", README, flags=re.S | re.M).group(1)


def python_block(title: str) -> str:
    block = re.search(r"```python\n(.*?)```", section(title), flags=re.S).group(1)
    return "\n".join(line[3:] if line.startswith("   ") else line for line in block.splitlines())  # list indent


@pytest.fixture
def code(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("my_net", "my_data"):  # another test's module of the same name must not answer the import
        sys.modules.pop(name, None)
    yield tmp_path
    for name in ("my_net", "my_data"):
        sys.modules.pop(name, None)


def test_add_your_models_network_trains_by_config(code, tiny_root, tmp_path):
    (code / "my_net.py").write_text(python_block("Add your model"))
    cli = cli_main(["fit", *tiny_args(tiny_root, tmp_path / "run"), "--model.backbone.class_path=my_net.MyNet",
                    "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1"])
    assert type(cli.model.network).__name__ == "MyNet" and cli.trainer.global_step == 2


def test_bring_your_own_datas_module_trains_with_the_readmes_command(code, tmp_path):
    (code / "my_data.py").write_text(python_block("Bring your own data"))
    command = re.search(r"^`(python -m project fit [^`]*--data.class_path my_data.MyData[^`]*)`$",
                        section("Bring your own data"), flags=re.M).group(1)
    words = shlex.split(command)[4:]  # after `python -m project fit`
    cli = cli_main(["fit", *words, "--trainer.accelerator=cpu", "--trainer.limit_train_batches=2",
                    "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
                    f"--trainer.default_root_dir={tmp_path / 'run'}"])
    assert cli.datamodule.batch_size == 32 and cli.datamodule.class_names == ["cat", "dog"]  # its own defaults
    assert cli.trainer.global_step == 2 and cli.model.hparams.num_classes == 2


@pytest.mark.slow  # 2 gloo ranks, the quickstart's 8 epochs
def test_the_readmes_first_ddp_example_trains_as_the_quickstart_does(tmp_path):
    # Issue 47: `--trainer.max_epochs=2` at global batch 128 ended at chance (val/acc1 0.1014). At the quickstart's
    # global batch the two ranks take its samples step for step, at its learning rate.
    import yaml

    from conftest import run_project

    command = re.search(r"^(python -m project fit --config configs/quickstart\.yaml --config configs/cpu_ddp\.yaml.*)$",
                        section("Configs compose"), flags=re.M).group(1)
    words = shlex.split(command.split("#")[0])[3:]
    result = run_project([*words, f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false"],
                         timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "lightning_logs" / "version_0"
    best = float(re.search(r"val_acc1=([0-9.]+)\.ckpt", " ".join(p.name for p in (run_dir / "checkpoints").iterdir()))
                 .group(1))
    epochs = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())["trainer"]["max_epochs"]
    print(f"val/acc1 {best} after {epochs} epochs on 2 ranks")
    assert best >= 0.95, best
