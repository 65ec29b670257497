"""The input pipeline benchmark runs end to end in quick mode and reports the stock pipeline, ours with each decoder
and the other JPEG libraries, at both train crops and for evaluation, each against the plain decode and today's.

    python -m pytest tests/test_input_pipeline_bench.py
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from classifier_engine.data.decoders import LOADERS, unavailable

from conftest import skip_if_deleted

skip_if_deleted("bench")

REPO = Path(__file__).resolve().parents[1]  # the template


@pytest.mark.slow  # another process
def test_quick_benchmark_reports_stock_and_ours_with_each_decoder_per_core(tmp_path):
    out = tmp_path / "bench.json"
    command = [sys.executable, "bench/input_pipeline.py", "--quick", "--data", str(tmp_path / "jpegs"), "--json",
               str(out),
               "--device-decode", "cpu"]  # the device decoders' code path; on the CPU it only has to run
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["images"] == 24 and len(list((tmp_path / "jpegs").glob("*.JPEG"))) == 24
    width, height = map(int, report["mean_size"].split("x"))
    assert 400 <= width <= 560 and 350 <= height <= 500  # "around 500x375", portrait ones included
    decoders = [name for name in LOADERS if unavailable(name) is None]  # auto's order
    assert list(report["results"]) == ["decode", "train", "train_small", "eval"]
    decode = list(report["results"]["decode"])
    assert decode[: len(decoders)] == [f"decode: {name}" for name in ["pil", *decoders[:-1]]]
    whole = "torchcodec" if "torchcodec" in decoders else "torchvision"  # today's: decoded whole
    for preset in ("train", "train_small", "eval"):
        rows = report["results"][preset]
        device_rows = [f"{name}: decode + augment on cpu" for name in ("nvjpeg", "torchcodec-cuda")
                       if preset != "train_small" and (name == "nvjpeg" or "torchcodec" in decoders)]
        assert list(rows)[: len(decoders) + 3] == ["stock PIL + v1", "torchvision.io + v2, float per image",
                                                  *[f"ours, decoder={name}" for name in decoders],
                                                  f"ours + batch normalize on the CPU, decoder={decoders[0]}"]
        assert set(device_rows) <= set(rows) and "PIL draft(): DCT-scaled whole" in " ".join(rows)
        assert rows["stock PIL + v1"]["ratio_vs_stock"] == 1.0 and rows[f"ours, decoder={whole}"]["ratio_vs_today"] == 1
        assert all(row["img_per_cpu_s"] > 0 and row["ratio_vs_decode"] > 0 for row in rows.values())
    for label in ("train 224", "train 160", "eval 256/224"):
        assert f"| {label} | ours, decoder=torchvision |" in result.stdout
