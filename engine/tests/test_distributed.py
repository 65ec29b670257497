"""Multi-process training on CPU with gloo: ddp trains one job (ddp_spawn: tests/test_resume.py, torchrun:
tests/test_elastic_restart.py), evaluation is exact at any world size, and rank zero alone writes. (That data
parallelism with sync-BN and an EMA computes what one process computes: a template's tests/test_distributed.py.)

    python -m pytest tests/test_distributed.py
"""

import os
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from classifier_engine.entry import close_process_group
from conftest import CONFIGS, cli_main, read_scalars, run_project, tiny_args

pytestmark = pytest.mark.slow

CPU_DDP = ["--config", str(CONFIGS / "cpu_ddp.yaml")]
# The same DDPStrategy and gloo group with ranks forked from the run's process (strategy ddp_fork), not started as new
# interpreters (~10 s of imports each here, several times that on CI): for the tests of what ranks compute together
# (exact evaluation, sync BatchNorm, gathering); those of how ranks start and stop (signals, kill -9, launchers,
# writing one run) run cpu_ddp.yaml's ddp as a user does.
FORKED_DDP = [*CPU_DDP, "--trainer.strategy=ddp_fork"]


def assert_ok(result):
    assert result.returncode == 0, (f"exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n"
                                    f"{result.stderr[-6000:]}")


def in_process(args: list[str]) -> None:
    """`python -m classifier_engine ARGS` for one process, without a new interpreter: PL_GLOBAL_SEED and the MASTER_*
    variables it sets stay out of the tests that follow, and so does the (1-process) gloo group that strategy ddp
    starts."""
    with mock.patch.dict(os.environ):
        try:
            cli_main(args)
        finally:
            close_process_group()  # what classifier_engine.entry.main does after the run


def run_files(run_dir: Path) -> dict[str, list[Path]]:
    logs = run_dir / "lightning_logs"
    return {
        "versions": sorted(logs.glob("version_*")),
        "checkpoints": sorted(logs.glob("*/checkpoints/*.ckpt")),
        "configs": sorted(run_dir.rglob("config.yaml")),
        "event_files": sorted(run_dir.rglob("events.out.tfevents.*")),
    }


@pytest.fixture(scope="module")
def ddp_run(tiny_root, tmp_path_factory) -> Path:
    """One 2-process gloo DDP fit of the shrunk quickstart, 2 epochs validated after the second only, progress bar on;
    shared by the tests that inspect its outputs."""
    run_dir = tmp_path_factory.mktemp("ddp_run")
    # The plain model learns the 3 colours in 4 steps at its own LR (val/acc1 1.0): the exactness test needs one below
    slower = ["--model.init_args.lr=0.0003"]
    args = ["fit", *tiny_args(tiny_root, run_dir, "--trainer.max_epochs=2", "--trainer.check_val_every_n_epoch=2",
                              "--trainer.enable_progress_bar=true", *slower), *CPU_DDP, "--ddp_timeout_minutes=1"]
    assert_ok(run_project(args, timeout=900))
    return run_dir


def test_ddp_two_processes_write_one_run_from_rank_zero(ddp_run):
    files = run_files(ddp_run)
    assert [p.name for p in files["versions"]] == ["version_0"]
    names = sorted(p.name for p in files["checkpoints"])
    assert len(names) == 2 and names[0].startswith("epoch001-val_acc1=") and names[1] == "last.ckpt"
    assert len(files["configs"]) == 1 and len(files["event_files"]) == 1
    scalars = read_scalars(files["versions"][0])
    assert len(scalars["val/acc1"]) == 1  # logged once, by rank 0, after the cross-rank reduction
    # 40 train images over 2 ranks in batches of 8: 20 per rank, 2 steps per epoch (the incomplete last batch dropped:
    # data.drop_last; the run counts each step once)
    checkpoint = torch.load(ddp_run / "lightning_logs/version_0/checkpoints/last.ckpt", map_location="cpu",
                            weights_only=True)
    assert checkpoint["global_step"] == 4


def test_ddp_with_the_progress_bar_gets_past_an_epoch_end_without_validation(ddp_run):
    # Only rank 0 draws the bar, and reading the epoch's metrics for it reduces the sync_dist ones (train/effective_lr)
    # there first; rank 1 went on into last.ckpt's agreement: both waited on each other (seen: a hang to the timeout,
    # 1 minute here). ddp_run's epoch 0 ends without validation, with the bar on; it ran both epochs, 2 steps each:
    last = ddp_run / "lightning_logs/version_0/checkpoints/last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 4


def validate_metrics(checkpoint: Path, tiny_root: Path, run_dir: Path, devices: int) -> dict[str, float]:
    """The reduced val metrics of `validate` with strategy ddp on `devices` processes: 2 or 3 real processes (forked);
    1 is the pytest process itself (a 1-rank gloo group), as a process would run it."""
    args = ["validate", *tiny_args(tiny_root, run_dir), *(FORKED_DDP if devices > 1 else CPU_DDP),
            f"--trainer.devices={devices}",
            "--data.batch_size=4", f"--ckpt_path={checkpoint}"]
    if devices == 1:
        in_process(args)
    else:
        assert_ok(run_project(args))
    scalars = read_scalars(run_dir / "lightning_logs" / "version_0")
    return {key: scalars[key][-1][1] for key in ("val/acc1", "val/acc5", "val/loss")}


def test_validate_is_exact_with_1_2_and_3_processes_on_an_odd_val_set(ddp_run, tiny_root, tmp_path):
    checkpoint = ddp_run / "lightning_logs/version_0/checkpoints/last.ckpt"
    # 17 val images in batches of 4: shards of 17, 9+8 and 6+6+5 images; padding would count some twice. 2 processes:
    # the fit's own validation of the weights it saved last (at its last epoch's end), in batches of 8 (8+1 and 8).
    one, three = (validate_metrics(checkpoint, tiny_root, tmp_path / f"w{n}", n) for n in (1, 3))
    scalars = read_scalars(ddp_run / "lightning_logs" / "version_0")
    two = {key: scalars[key][-1][1] for key in ("val/acc1", "val/acc5", "val/loss")}
    # Neither 0 nor 1: there, padding and means of per-rank means would give the same number (acc5 is 1: 3 classes).
    assert 0 < one["val/acc1"] < 1
    assert one["val/acc1"] == two["val/acc1"] == three["val/acc1"]
    assert two["val/loss"] == pytest.approx(one["val/loss"], rel=1e-5)  # float32 forwards of other batch sizes
    assert three["val/loss"] == pytest.approx(one["val/loss"], rel=1e-6)
    # and each reduced accuracy is a count over all 17 images, not a mean of per-rank means (9+8, 6+6+5 shards)
    for metrics in (two, three):
        assert metrics["val/acc1"] * 17 == pytest.approx(round(metrics["val/acc1"] * 17), abs=1e-4)


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533"]


def test_torchrun_with_a_process_count_that_does_not_match_devices_stops_with_a_clear_error(tiny_root, tmp_path):
    result = run_project(["fit", *tiny_args(tiny_root, tmp_path)], launcher=TORCHRUN)
    assert result.returncode != 0
    assert "torchrun started 2 processes but the Trainer expects 1" in result.stderr
    assert "--trainer.devices=2" in result.stderr
    assert not (tmp_path / "lightning_logs").exists()  # stopped before anything was written
