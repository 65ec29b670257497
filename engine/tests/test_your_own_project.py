"""docs/your-own-project.md: the template renamed in a temporary clone trains one batch as the renamed package.

    python -m pytest engine/tests/test_your_own_project.py
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


@pytest.mark.slow
def test_the_renamed_template_trains_one_batch(tmp_path):
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
