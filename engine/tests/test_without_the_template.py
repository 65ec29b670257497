"""The suite without the template, kept honest from inside it: collected with `import project` failing, and a few of
its files run that way (CLASSIFIER_ENGINE_TESTS_ALONE=1, conftest.py). The whole suite alone: README "Tests".

    python -m pytest engine/tests/test_without_the_template.py
"""

import os
import subprocess
import sys

import pytest

from conftest import TESTS

ALONE = {**os.environ, "CLASSIFIER_ENGINE_TESTS_ALONE": "1"}
pytestmark = pytest.mark.skipif(os.environ.get("CLASSIFIER_ENGINE_TESTS_ALONE") == "1", reason="already alone")


def pytest_alone(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args], cwd=TESTS.parent,
                          env=ALONE, capture_output=True, text=True, timeout=900)


def test_every_file_collects_without_the_template():
    result = pytest_alone("--collect-only", "tests")
    assert result.returncode == 0 and " error" not in result.stdout.splitlines()[-1], result.stdout[-3000:]


@pytest.mark.slow  # ~40 s: fits, validates, predicts and resumes with the plain model
def test_the_cli_and_contract_files_pass_without_the_template():
    result = pytest_alone("tests/test_cli.py", "tests/test_class_names.py", "tests/test_contract.py")
    summary = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 0 and " passed" in summary and "skipped" in summary, result.stdout[-3000:]
