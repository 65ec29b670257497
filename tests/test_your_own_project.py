"""docs/your-own-project.md: the template renamed in a temporary clone trains one batch as the renamed package, every
template test is still collected (the same count before and after), and the renamed room's quick suite passes after the
user's first moves (a network file as the README's "Add your model" says, a README line, bench/ deleted).

    python -m pytest tests/test_your_own_project.py
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, SHRINK, project_env


def recipe() -> str:
    """The rename commands of docs/your-own-project.md, as written there (the first bash block)."""
    text = (REPO / "docs" / "your-own-project.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return "\n".join(line for line in block.splitlines() if not line.startswith(("pip ", "git grep -nw")))


def room_suite(clone, env: dict, basetemp, *options: str) -> subprocess.CompletedProcess:
    """The room's tests as the README's test command runs its quick part (its own pyproject's options), in the clone.
    What they wrote is deleted after (the quickstart fits' ResNet-18 checkpoints: gigabytes)."""
    try:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={basetemp}",
                               *options, "tests"], cwd=clone, env=env, capture_output=True, text=True, timeout=1800)
    finally:
        shutil.rmtree(basetemp, ignore_errors=True)


def collected(clone, env: dict, basetemp) -> int:
    """How many tests the room's suite holds (slow ones too), without running them."""
    listing = room_suite(clone, env, basetemp, "--collect-only")
    assert listing.returncode == 0, listing.stdout[-3000:] + listing.stderr[-2000:]
    return int(re.search(r"(\d+) tests? collected", listing.stdout).group(1))


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
def test_the_renamed_template_keeps_every_test_and_passes_after_a_network_a_readme_line_and_bench_deleted(
        tmp_path):
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
    env = project_env({"PYTHONPATH": os.pathsep.join([str(clone), str(clone / "engine")])})
    before = collected(clone, project_env({"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "engine")])}),
                       tmp_path / "listed")

    subprocess.run(["bash", "-euo", "pipefail", "-c", recipe()], cwd=clone, check=True)

    assert not (clone / "project").exists() and (clone / "mynet" / "model.py").is_file()
    untouched = subprocess.run(["git", "diff", "--quiet", "--", "engine"], cwd=clone)
    assert untouched.returncode == 0, "the rename changed the engine"
    left = subprocess.run(["git", "grep", "-lE", r"\b(from|import) project\b|project\.(data|model)", "--", ":!engine"],
                          cwd=clone, capture_output=True, text=True).stdout.split()
    assert left == [], f"still importing the old name: {left}"
    assert collected(clone, env, tmp_path / "listed") == before  # every template test, none skipped by the rename
    result = subprocess.run(
        [sys.executable, "-m", "mynet", "fit", "--config", "configs/quickstart.yaml", *SHRINK,
         "--trainer.limit_train_batches=1", "--trainer.limit_val_batches=1", "--trainer.default_root_dir=run"],
        cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    config = (clone / "run" / "lightning_logs" / "version_0" / "config.yaml").read_text()
    assert "class_path: mynet.ImageClassifier" in config and "class_path: mynet.ImageNetDataModule" in config

    add_your_model(clone)
    assert "class_path: mynet.my_net.MyNet" in (clone / "configs" / "model" / "my_net.yaml").read_text()
    assert collected(clone, env, tmp_path / "listed") == before + 1  # the new config: a case of test_model_configs
    shutil.rmtree(clone / "bench")  # the user's numbers now (docs/your-own-project.md, "Delete")
    (clone / "docs" / "benchmarks.md").unlink()
    after = room_suite(clone, env, tmp_path / "after", "-n", "2", "-m", "not slow")
    assert after.returncode == 0 and " passed" in after.stdout, after.stdout[-3000:] + after.stderr[-2000:]
