"""Shared fixtures of the library's suite: a real quickstart config, shrunk (tiny data, CPU, tmp dir), and ways to run
the real CLI.

The suite tests the library alone, the same wherever it lies (`pip install ./engine` and the suite copied, or inside a
template's repository): `python -m classifier_engine` on configs/quickstart.yaml here, which trains the contract's
from-scratch model (plain_model.py) on the library's folder data module. `import project` and `import tools` fail in
it, as they would without a template: a template's own parts are tested by the template's tests/."""

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import warm_python
from tiny_runs import SHRINK, callback, read_scalars, tmpfs, write_image_folder  # noqa: F401  (the suite's)

# One intra-op thread per process, in this one (torch is not imported yet) and in every process a test starts: CI runs
# two test workers on two cores, each with its own processes (ranks, runs), and torch's default, a thread a core, then
# oversubscribes them while OpenMP's threads spin-wait on descheduled ones. A quickstart fit under the suite's load
# took 17.6 s with 2 threads and 8.9 s with 1 (mean of 4 each, this machine, 2026-12-06).
os.environ.setdefault("OMP_NUM_THREADS", "1")

TESTS = Path(__file__).resolve().parent
LIBRARY = TESTS.parent  # engine/: where the suite's processes start
for name in ("project", "tools"):  # a template's packages, when one is beside the library: imported, they fail here
    sys.modules[name] = None
APP = "classifier_engine"  # what `python -m` runs
CONFIGS = TESTS / "configs"
QUICKSTART = CONFIGS / "quickstart.yaml"
NETWORK = "net."  # where the quickstart model's network sits in its state_dict


def cli_main(*args, **kwargs):
    """The entry point's cli_main, in-process. Imported on the first call, not with this file: Lightning imported before
    pytest's log handlers exist stops propagating its logger, and caplog then sees none of its lines."""
    return importlib.import_module(APP).cli_main(*args, **kwargs)


def main(*args, **kwargs):
    """The entry point's main (`python -m APP`), in-process."""
    return importlib.import_module(APP).main(*args, **kwargs)


def model_class() -> type:
    """The model class the quickstart config trains: plain_model.Top1Net."""
    return importlib.import_module("plain_model").Top1Net


def new_model(num_classes: int):
    """A model as the quickstart config builds it, for that many classes."""
    return model_class()(num_classes=num_classes)

# The slowest files first (from CI's --durations=0, 2026-12-03; test_sweep.py, moved from the template's tests, 117 s
# alone on 2 busy cores, 2026-12-07); the rest follow in their usual order. Refresh it when a file's time moves far: a
# long file started last keeps one worker busy while the other waits.
SLOWEST_FILES = [
    "test_sweep.py", "test_resume.py", "test_trackers.py", "test_global_batch.py", "test_shards.py",
    "test_distributed.py", "test_remote_runs.py", "test_reliability.py", "test_compat.py", "test_elastic_restart.py",
    "test_run_plan.py", "test_cli.py", "test_bad_input.py", "test_any_data.py",
]


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
    """The environment of a `python -m classifier_engine` subprocess: unbuffered, tests/ importable (plain_model,
    stop_callbacks)."""
    path = os.pathsep.join(p for p in (str(TESTS), str(LIBRARY), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **(env or {})}


def project_in_process(args: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """`python -m classifier_engine ARGS` without a new interpreter: its main, what its __main__.py calls for
    fit, validate, test and predict (config-file check, moved options, a user error's one line and exit 2), on sys.argv
    as the process has it. (exit code, stdout, stderr) as the process would end; a bug's exception propagates (the
    process would print its traceback and exit 1). os.environ is restored after (the CLI sets PL_GLOBAL_SEED)."""
    from unittest import mock

    main = importlib.import_module(APP).main
    monkeypatch.setattr(sys, "argv", [f"python -m {APP}", *args])
    capsys.readouterr()
    code = 0
    with mock.patch.dict(os.environ):
        try:
            main()
        except SystemExit as exit:
            code = 0 if exit.code is None else exit.code
    out, err = capsys.readouterr()
    return code, out, err


def run_project(args: list[str], *, cwd: Path = LIBRARY, env: dict | None = None, timeout: float = 600,
                launcher: list[str] | None = None, fresh: bool | None = None) -> subprocess.CompletedProcess:
    """Run `python -m classifier_engine ARGS` in a new process; output captured. The process starts warm
    (warm_python.py: forked from an interpreter that has the imports) unless a LAUNCHER is given or `fresh`; by default
    (None) a test that sets variables of its own (`env`) gets a new interpreter: some are read at import (Lightning's
    MLFlowLogger has `tracking_uri=os.getenv("MLFLOW_TRACKING_URI")` in its signature); a fresh interpreter reads them
    as a user's."""
    if launcher is None and not (env is not None if fresh is None else fresh):
        return warm_python.run(args, cwd=cwd, env=project_env(env), timeout=timeout, module=APP)
    command = [*(launcher or [sys.executable]), "-m", APP, *args]
    return subprocess.run(command, cwd=cwd, env=project_env(env), capture_output=True, text=True, timeout=timeout)


def start_project(args: list[str], *, env: dict | None = None, new_session: bool = False, merge_stderr: bool = False,
                  fresh: bool | None = None) -> subprocess.Popen | warm_python.WarmProcess:
    """Start `python -m classifier_engine ARGS` without waiting (for signals, kill -9, concurrent runs); output captured
    (in one stream with merge_stderr, as a terminal shows it). Warm or fresh as run_project decides."""
    if not (env is not None if fresh is None else fresh):
        return warm_python.start(args, cwd=LIBRARY, env=project_env(env), new_session=new_session,
                                 merge_stderr=merge_stderr, module=APP)
    return subprocess.Popen([sys.executable, "-m", APP, *args], cwd=LIBRARY, env=project_env(env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                            start_new_session=new_session)


# Lightning's launcher (rank 0 of strategy ddp) polls its child ranks every 5 s; one that exited non-zero makes it log
# this line and kill rank 0, by chance before or after rank 0's own last line.
LAUNCHER_LINE = re.compile(r"\[rank: \d+\] Child process with PID \d+ terminated with code -?\d+\. .*")


def last_line(stderr: str) -> str:
    """The last line a ddp job's own code printed: stderr's last, after any trailing Lightning launcher lines."""
    lines = stderr.strip().splitlines()
    while len(lines) > 1 and LAUNCHER_LINE.fullmatch(lines[-1]):
        lines.pop()
    return lines[-1] if lines else ""


def pytest_collection_modifyitems(items):
    """The slowest files first, each file's own order kept: `-n 2` (the README's test command, --dist loadfile) hands
    whole files to the two workers in this order, so the longest start at once and the short ones even out the end."""
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True)
def plain_argv(monkeypatch):
    """In-process cli_main gets its arguments from the test, not from pytest's own command line."""
    monkeypatch.setattr(sys, "argv", [f"python -m {APP}"])


def make_shards_killed_at(image: int, monkeypatch, argv: list[str]) -> None:
    """make_shards(argv), stopped while it encodes its `image`-th image, as a kill would (KeyboardInterrupt)."""
    from classifier_engine.data import make_shards

    encode, encoded = make_shards.encode, []

    def interrupted(path, options):
        encoded.append(path)
        if len(encoded) == image:
            raise KeyboardInterrupt
        return encode(path, options)

    monkeypatch.setattr(make_shards, "encode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        make_shards.main(argv)
    monkeypatch.undo()
