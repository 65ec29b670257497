"""perf/* speed figures in TensorBoard for a shrunk quickstart run, and the FLOP count behind tflops and MFU.

    python -m pytest tests/test_throughput.py
"""

import os
from pathlib import Path
from unittest import mock

import pytest
import torch
import torchvision

from classifier_engine.callbacks.throughput import compute_dtype, peak_flops, train_flops_per_image
from conftest import cli_main, read_scalars, tiny_args

PERF_KEYS = {
    "perf/images_per_sec",
    "perf/device/images_per_sec",
    "perf/step_time",
    "perf/data_wait",
    "perf/device/tflops",
    "perf/device/mfu",
}


def event_dir(run_dir: Path) -> Path:
    (events,) = run_dir.rglob("events.out.tfevents.*")
    return events.parent


def test_quickstart_logs_perf_keys_that_agree_with_the_batches_trained(tiny_root, tmp_path):
    # The CLI's throughput group, given a peak so MFU appears on CPU; in-process, read back from its TensorBoard events.
    with mock.patch.dict(os.environ):  # the CLI sets PL_GLOBAL_SEED: keep it out of the tests that follow
        cli = cli_main(["fit", *tiny_args(tiny_root, tmp_path, "--throughput.peak_flops=1e12")])
    scalars = read_scalars(event_dir(tmp_path))
    assert PERF_KEYS <= scalars.keys(), f"missing: {PERF_KEYS - scalars.keys()}"

    steps = [step for step, _ in scalars["train/loss"]]
    assert [step for step, _ in scalars["perf/images_per_sec"]] == steps  # one value per logged step, same steps
    values = {key: [v for _, v in scalars[key]] for key in PERF_KEYS}
    # 40 images, batch 8, logged every step: each window is one full batch of 8.
    for rate, step_time in zip(values["perf/images_per_sec"], values["perf/step_time"]):
        assert rate * step_time == pytest.approx(8, rel=1e-4)
    assert values["perf/device/images_per_sec"] == values["perf/images_per_sec"]  # one device
    assert all(0 <= w < 1 for w in values["perf/data_wait"])

    flops = train_flops_per_image(cli.model.exportable(), torch.Size((8, 3, 32, 32)))  # the network it trained
    for rate, tflops, mfu in zip(values["perf/images_per_sec"], values["perf/device/tflops"],
                                 values["perf/device/mfu"]):
        assert tflops == pytest.approx(rate * flops / 1e12, rel=1e-4)
        assert mfu == pytest.approx(tflops, rel=1e-4)  # peak_flops=1e12: MFU is TFLOP/s / 1


def test_flop_count_matches_resnet50s_published_cost_and_leaves_the_network_alone():
    network = torchvision.models.resnet50()
    before = {name: p.clone() for name, p in network.state_dict().items()}
    flops = train_flops_per_image(network, torch.Size((2, 3, 224, 224)))
    # torchvision: 4.09 G multiply-adds forward = 8.2 GFLOP; backward about twice that: ~24.3 GFLOP per image.
    assert flops == pytest.approx(24.3e9, rel=0.01)
    assert all(p.grad is None for p in network.parameters())
    assert all(torch.equal(before[name], t) for name, t in network.state_dict().items())  # BN statistics untouched


def test_no_mfu_on_cpu_unless_a_peak_is_given():
    cpu = torch.device("cpu")
    assert compute_dtype("32-true", cpu) == "fp32"
    assert compute_dtype("bf16-mixed", cpu) == "bf16"
    assert compute_dtype("16-mixed", cpu) == "fp16"
    assert peak_flops(cpu, "fp32") is None
