"""The recipe-ingredient cost benchmark runs end to end in quick mode, every ingredient beside the baseline.

    python -m pytest tests/test_augment_cost_bench.py
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import skip_if_deleted

skip_if_deleted("bench")

REPO = Path(__file__).resolve().parents[1]  # the template


@pytest.mark.slow  # another process
def test_quick_benchmark_reports_each_ingredient_against_the_baseline(tmp_path):
    out = tmp_path / "bench.json"
    command = [sys.executable, "bench/augment_cost.py", "--quick", "--data", str(tmp_path / "jpegs"), "--json",
               str(out)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    rows = report["results"]
    assert report["images"] == 24 and len(rows) == 7
    baseline = rows["baseline: crop + flip"]
    assert baseline["ratio_vs_baseline"] == 1.0 and baseline["extra_ms_per_image"] == 0
    assert all(row["img_per_cpu_s"] > 0 for row in rows.values())
    # Auto-augment is real per-image work; a loaded CI machine blurs 2 rounds, so only "not free" is checked.
    assert rows["+ randaugment (2 ops, magnitude 9)"]["ratio_vs_baseline"] < 1.0, rows
    assert "| + autoaugment (imagenet) |" in result.stdout
