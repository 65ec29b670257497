"""Shared fixtures of the room's tests: the real quickstart config, shrunk (tiny data, CPU, tmp dir), and ways to run
the real CLI (python -m project) in-process or in a new process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

# One intra-op thread per process, in this one (torch is not imported yet) and in every process a test starts: CI runs
# two test workers on two cores, each with its own processes (ranks, runs), and torch's default, a thread a core, then
# oversubscribes them while OpenMP's threads spin-wait on descheduled ones. A quickstart fit under the suite's load
# took 17.6 s with 2 threads and 8.9 s with 1 (mean of 4 each, this machine, 2026-12-06).
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
CONFIGS = REPO / "configs"
QUICKSTART = CONFIGS / "quickstart.yaml"

# Shrinks configs/quickstart.yaml for tests: no progress bars or summaries, one quick epoch.
SHRINK = [
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.max_epochs=1",
    "--trainer.log_every_n_steps=1",
    "--data.batch_size=8",
]


def write_image_folder(root: Path, classes: dict[str, tuple[int, int]], *, size: int = 32, seed: int = 0) -> Path:
    """Write root/{train,val}/<class>/*.jpg: noisy images whose mean colour depends on the class (learnable)."""
    rng = np.random.default_rng(seed)
    palette = [(200, 40, 40), (40, 200, 40), (40, 40, 200), (200, 200, 40), (40, 200, 200)]
    for index, (name, (n_train, n_val)) in enumerate(sorted(classes.items())):
        colour = np.array(palette[index % len(palette)], dtype=np.int16)
        for split, count in (("train", n_train), ("val", n_val)):
            out = root / split / name
            out.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                noise = rng.integers(-40, 40, size=(size, size, 3))
                pixels = np.clip(colour + noise, 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(out / f"{name}_{i:03d}.jpg", quality=90)
    return root


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    """3 classes, 40 train and 17 val images (an odd val size, so shards differ across ranks), 32 px JPEGs."""
    root = tmp_path_factory.mktemp("tiny_imagenet")
    return write_image_folder(root, {"cat": (14, 6), "dog": (13, 6), "fox": (13, 5)})


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory) -> Path:
    """The embedded digits are materialized once per session into a tmp cache, never into ~/.cache."""
    cache = tmp_path_factory.mktemp("data_cache")
    os.environ["CLASSIFIER_ENGINE_CACHE"] = str(cache)
    return cache


def tiny_args(root: Path | None, run_dir: Path, *extra: str) -> list[str]:
    """The real quickstart config, shrunk onto `root` (None: no --data.root, for another data class in `extra`),
    writing into `run_dir`."""
    return ["--config", str(QUICKSTART), *SHRINK, *([f"--data.root={root}"] if root is not None else []),
            f"--trainer.default_root_dir={run_dir}", *extra]


def project_env(env: dict | None = None) -> dict:
    """The environment of a `python -m project` subprocess: unbuffered, tests/ importable (stop_callbacks)."""
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **(env or {})}


def project_in_process(args: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """`python -m project ARGS` without a new interpreter: project.main, what project/__main__.py calls for
    fit, validate, test and predict (config-file check, moved options, a user error's one line and exit 2), on sys.argv
    as the process has it. (exit code, stdout, stderr) as the process would end; a bug's exception propagates (the
    process would print its traceback and exit 1). os.environ is restored after (the CLI sets PL_GLOBAL_SEED)."""
    from unittest import mock

    from project import main

    monkeypatch.setattr(sys, "argv", ["python -m project", *args])
    capsys.readouterr()
    code = 0
    with mock.patch.dict(os.environ):
        try:
            main()
        except SystemExit as exit:
            code = 0 if exit.code is None else exit.code
    out, err = capsys.readouterr()
    return code, out, err


def run_project(args: list[str], *, cwd: Path = REPO, env: dict | None = None, timeout: float = 600,
                launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run `python -m project ARGS` (or `LAUNCHER -m project ARGS`) in a fresh process; output captured."""
    command = [*(launcher or [sys.executable]), "-m", "project", *args]
    return subprocess.run(command, cwd=cwd, env=project_env(env), capture_output=True, text=True, timeout=timeout)


def callback(class_path: str, **init_args) -> str:
    """A `--trainer.callbacks+=` argument adding one callback."""
    return "--trainer.callbacks+=" + json.dumps({"class_path": class_path, "init_args": init_args})


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """All scalars of a TensorBoard run dir, read with tensorboard's own reader: {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


@pytest.fixture(autouse=True)
def plain_argv(monkeypatch):
    """In-process cli_main gets its arguments from the test, not from pytest's own command line."""
    monkeypatch.setattr(sys, "argv", ["python -m project"])
