"""docs/your-own-project.md: the template renamed in a temporary clone trains one batch as the renamed package, and
the renamed room's own suite passes, before and after the user's first moves (a network file as the README's "Add your
model" says, and a README line).

    python -m pytest engine/tests/test_your_own_project.py
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, SHRINK, project_env

pytestmark = pytest.mark.template  # renaming the template's room


def recipe() -> str:
    """The rename commands of docs/your-own-project.md, as written there (the first bash block)."""
    text = (REPO / "docs" / "your-own-project.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return "\n".join(line for line in block.splitlines() if not line.startswith(("pip ", "git grep -nw")))


def room_suite(clone, env: dict, basetemp) -> subprocess.CompletedProcess:
    """The renamed room's tests as the README's test command runs them (its own pyproject's options), in the clone.
    What they wrote is deleted after: a room suite writes ~4.6 GB (its quickstart fits' ResNet-18 checkpoints)."""
    try:
        return subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider",
                               f"--basetemp={basetemp}", "tests"], cwd=clone, env=env, capture_output=True, text=True,
                              timeout=1800)
    finally:
        shutil.rmtree(basetemp, ignore_errors=True)


def add_your_model(clone) -> None:
    """The README's "Add your model", as the renamed clone's README says it: the network file, its config, and a line
    of the user's own in the README."""
    readme = (clone / "README.md").read_text()
    section = readme.split("## Add your model", 1)[1]
    network = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    config = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    (clone / "mynet" / "my_net.py").write_text("\n".join(line[3:] for line in network.splitlines()) + "\n")
    (clone / "configs" / "model" / "my_net.yaml").write_text("\n".join(line[3:] for line in config.splitlines()) + "\n")
    (clone / "README.md").write_text(readme + "\nMyNet: our first network (configs/model/my_net.yaml).\n")


@pytest.mark.slow
def test_the_renamed_template_trains_and_its_suite_passes_before_and_after_a_network_and_a_readme_line(tmp_path):
    clone = tmp_path / "mynet-repo"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in files:  # the working tree as it is (committed or not), without outputs
        if (REPO / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, clone / name)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=clone, check=True)
    subprocess.run([*git, "add", "-A"], cwd=clone, check=True)
    subprocess.run([*git, "commit", "-qm", "template"], cwd=clone, check=True)

    subprocess.run(["bash", "-euo", "pipefail", "-c", recipe()], cwd=clone, check=True)

    assert not (clone / "project").exists() and (clone / "mynet" / "model.py").is_file()
    untouched = subprocess.run(["git", "diff", "--quiet", "--", "engine"], cwd=clone)
    assert untouched.returncode == 0, "the rename changed the engine"
    left = subprocess.run(["git", "grep", "-lE", r"\b(from|import) project\b|project\.(data|model)", "--", ":!engine"],
                          cwd=clone, capture_output=True, text=True).stdout.split()
    assert left == [], f"still importing the old name: {left}"
    env = project_env({"PYTHONPATH": os.pathsep.join([str(clone), str(clone / "engine")])})
    result = subprocess.run(
        [sys.executable, "-m", "mynet", "fit", "--config", "configs/quickstart.yaml", *SHRINK,
         "--trainer.limit_train_batches=1", "--trainer.limit_val_batches=1", "--trainer.default_root_dir=run"],
        cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    config = (clone / "run" / "lightning_logs" / "version_0" / "config.yaml").read_text()
    assert "class_path: mynet.ImageClassifier" in config and "class_path: mynet.ImageNetDataModule" in config

    before = room_suite(clone, env, tmp_path / "before")
    assert before.returncode == 0 and " passed" in before.stdout, before.stdout[-3000:] + before.stderr[-2000:]
    add_your_model(clone)
    assert "class_path: mynet.my_net.MyNet" in (clone / "configs" / "model" / "my_net.yaml").read_text()
    after = room_suite(clone, env, tmp_path / "after")
    assert after.returncode == 0, after.stdout[-3000:] + after.stderr[-2000:]
    count = [int(re.search(r"(\d+) passed", run.stdout).group(1)) for run in (before, after)]
    assert count[1] > count[0], count  # the new config is one more case of tests/test_model_configs.py
