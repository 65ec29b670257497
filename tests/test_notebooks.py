"""The notebooks run top to bottom with nbclient, in their fast mode (a few training steps on the embedded digits).

    python -m pytest tests/test_notebooks.py --durations=0
"""

import ast
import csv
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import REPO, skip_if_deleted

skip_if_deleted("notebooks")

NOTEBOOKS = REPO / "notebooks"

pytestmark = pytest.mark.slow  # a kernel start and ~10 s of imports per notebook


class Payload:
    """Unpickling it runs code (creates a file): what a crafted checkpoint does to torch.load(weights_only=False)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def execute(name: str, **env: str) -> nbformat.NotebookNode:
    """Run notebooks/NAME in a fresh kernel (cwd notebooks/, as in Jupyter) with these extra environment variables."""
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = NotebookClient(notebook, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    # CLASSIFIER_ENGINE_CACHE comes from the session fixture in conftest: the kernel reuses the materialized digits.
    client.execute(env={**os.environ, "PROJECT_NOTEBOOK_FAST": "1", **env})
    return notebook


def printed(notebook: nbformat.NotebookNode) -> list[str]:
    return [line for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs
            if out.output_type == "stream" and out.name == "stdout" for line in out.text.splitlines()]


def images(notebook: nbformat.NotebookNode) -> int:
    return sum("image/png" in out.get("data", {}) for cell in notebook.cells if cell.cell_type == "code"
               for out in cell.outputs)


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> tuple[nbformat.NotebookNode, Path]:
    """01_quickstart run once; its run dir is what 02_inspect_run inspects."""
    runs = tmp_path_factory.mktemp("notebook_runs")
    return execute("01_quickstart.ipynb", PROJECT_NOTEBOOK_RUNS=str(runs)), runs / "lightning_logs" / "version_0"


@pytest.mark.parametrize("name", ["01_quickstart.ipynb", "02_inspect_run.ipynb"])
def test_notebook_is_committed_without_outputs(name):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code), (
        f"{name} holds outputs; clear them before committing (jupyter nbconvert --clear-output --inplace {name})"
    )


def test_quickstart_trains_from_the_config_files_and_plots_predictions(quickstart):
    notebook, run_dir = quickstart
    lines = printed(notebook)
    assert any("configs/quickstart.yaml" in line for line in lines if line.startswith("the same as:"))
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    # The training images, the labelled predictions and the confusion matrix.
    assert images(notebook) == 3
    with open(run_dir / "predictions.csv", newline="") as f:
        rows = list(csv.reader(f))
    val_images = sorted((Path(os.environ["CLASSIFIER_ENGINE_CACHE"]).glob("digits-*/val/*/*.jpg")))
    assert [Path(row[0]).name for row in rows[1:]] == [path.name for path in val_images]
    accuracy = next(line for line in lines if line.startswith("top-1 accuracy"))
    assert f"on {len(val_images)} validation images" in accuracy
    # the printed accuracy is the CSV's: its top-1 class against each image's folder
    correct = sum(Path(row[0]).parent.name == row[1] for row in rows[1:]) / (len(rows) - 1)
    assert float(accuracy.split()[2]) == pytest.approx(correct, abs=1e-3)


def test_inspect_run_plots_curves_and_reproduces_the_best_checkpoints_score(quickstart):
    _, run_dir = quickstart
    notebook = execute("02_inspect_run.ipynb", PROJECT_RUN_DIR=str(run_dir))
    lines = printed(notebook)
    logged = ast.literal_eval(next(line for line in lines if line.startswith("{'")))
    assert {"train/loss", "train/lr", "val/loss", "val/acc1"} <= set(logged)
    assert images(notebook) == 1
    assert any(line.startswith("last.ckpt") for line in lines)
    best_line = next(line for line in lines if line.startswith("best by val/acc1:"))
    best_score = float(best_line.rsplit("(", 1)[1].rstrip(")"))
    results = ast.literal_eval(lines[-1])
    # validate reads the run's own config.yaml (same val batches), so the best checkpoint scores what it saved.
    assert results["val/acc1"] == pytest.approx(best_score, abs=1e-4)


def test_inspect_run_refuses_a_crafted_checkpoint_even_where_torch_would_load_it(quickstart, tmp_path):
    import shutil

    import torch
    from nbclient.exceptions import CellExecutionError

    _, run_dir = quickstart
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    marker = tmp_path / "pwned"
    checkpoint = torch.load(copy / "checkpoints" / "last.ckpt", weights_only=True)
    checkpoint["hyper_parameters"]["payload"] = Payload(marker)
    torch.save(checkpoint, copy / "checkpoints" / "last.ckpt")
    # torch < 2.6 loads with weights_only=False by default; this forces that default on today's torch.
    with pytest.raises(CellExecutionError, match="Weights only load failed"):
        execute("02_inspect_run.ipynb", PROJECT_RUN_DIR=str(copy), TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
    assert not marker.exists()
