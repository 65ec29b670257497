"""Shared fixtures of the room's tests: the real quickstart config, shrunk (tiny data, CPU, tmp dir), and ways to run
the real CLI (python -m project) in-process or in a new process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

# One intra-op thread per process, in this one (torch is not imported yet) and in every process a test starts: CI runs
# two test workers on two cores, each with its own processes (ranks, runs), and torch's default, a thread a core, then
# oversubscribes them while OpenMP's threads spin-wait on descheduled ones. A quickstart fit under the suite's load
# took 17.6 s with 2 threads and 8.9 s with 1 (mean of 4 each, this machine, 2026-12-06).
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
CONFIGS = REPO / "configs"
QUICKSTART = CONFIGS / "quickstart.yaml"
# What docs/your-own-project.md says a user may delete: their tests skip once it is gone, and the README's and docs'
# mentions of it stop counting as broken links.
DELETABLE = ("bench", "notebooks", "slurm", "docs/benchmarks.md", "tools/prepare_imagenet.py", "configs/dp_8gpu.yaml")


def pytest_sessionstart(session: pytest.Session) -> None:
    # `import lightning` adds a console handler on the sys.stderr of that moment: imported here, the session's, not
    # the captured stream of the test that imports it first, closed after that test (a later test's log line then
    # fails on it: a file run alone). Not at this file's import either: pytest's log capture is not on the root logger
    # yet, and lightning.pytorch then stops its records from reaching it (caplog).
    import lightning.pytorch  # noqa: F401


def skip_if_deleted(part: str) -> None:
    """Skip the calling test module when `part` (one of DELETABLE) is gone from the checkout."""
    if not (REPO / part).exists():
        pytest.skip(f"{part} is deleted (docs/your-own-project.md): nothing of it to test", allow_module_level=True)


def deleted(path: str) -> bool:
    """Whether a repository path lies in a part the user deleted."""
    return any((path == part or path.startswith(part + "/")) and not (REPO / part).exists() for part in DELETABLE)


# The library's test helpers (tiny data, a Slurm cluster, stop callbacks for its runs), beside the library you keep.
ENGINE_TESTS = REPO / "engine" / "tests"
sys.path.append(str(ENGINE_TESTS))
from tiny_runs import SHRINK, callback, read_scalars, tmpfs, write_image_folder  # noqa: E402, F401  (the suites share them)


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
    """The environment of a `python -m project` subprocess: unbuffered, tests/ and engine/tests importable (the
    library's stop_callbacks)."""
    path = os.pathsep.join(p for p in (str(TESTS), str(ENGINE_TESTS), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **(env or {})}


def cli_main(*args, **kwargs):
    """project.cli_main, in-process. Imported on the first call, not with this file: Lightning imported before pytest's
    log handlers exist stops propagating its logger, and caplog then sees none of its lines."""
    from project import cli_main

    return cli_main(*args, **kwargs)


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


def start_project(args: list[str], *, env: dict | None = None, new_session: bool = False,
                  merge_stderr: bool = False) -> subprocess.Popen:
    """Start `python -m project ARGS` without waiting (for signals, kill -9, concurrent runs); output captured (in one
    stream with merge_stderr, as a terminal shows it)."""
    return subprocess.Popen([sys.executable, "-m", "project", *args], cwd=REPO, env=project_env(env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                            start_new_session=new_session)


# The longest files of the slow part first (.ci/run of 2026-12-06, seconds on 2 cores: bench ~236, the rename ~175,
# slurm ~110 with its cluster, fsdp ~125, the README's DDP example ~95, the stored sharded checkpoint ~86; the sweeps'
# ~230 moved to engine/tests/test_sweep.py): handed out in file order, the rename test last left one worker running it
# alone for its last ~90 s.
SLOWEST_FILES = [
    "test_bench.py", "test_your_own_project.py", "test_slurm.py", "test_fsdp.py",
    "test_readme_snippets.py", "test_remote_sharded_checkpoints.py", "test_notebooks.py", "test_resume.py",
]


def pytest_collection_modifyitems(items):
    """The slowest files first, each file's own order kept: `-n 2` (the README's test command, --dist loadfile) hands
    whole files to the two workers in this order, so the longest start at once and the short ones even out the end."""
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True)
def plain_argv(monkeypatch):
    """In-process cli_main gets its arguments from the test, not from pytest's own command line."""
    monkeypatch.setattr(sys, "argv", ["python -m project"])
