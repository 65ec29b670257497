"""EMA under 2-process gloo DDP through the real CLI: the same raw and averaged weights as one process (the
one-process reference runs in the pytest process, the 2 ranks in their own).

    python -m pytest tests/test_ema_distributed.py
"""

import os
from unittest import mock

import pytest
import torch

from conftest import CONFIGS, run_project, tiny_args
from project.cli import cli_main
from test_strategies import NO_AUGMENT, relative_difference

pytestmark = pytest.mark.slow

EMA = ["--trainer.callbacks+=project.callbacks.ema.EMA", "--trainer.callbacks.decay=0.5"]


def weights(run_dir) -> tuple[dict, dict]:
    checkpoint = torch.load(run_dir / "lightning_logs/version_0/checkpoints/last.ckpt", map_location="cpu",
                            weights_only=True)
    return checkpoint["state_dict"], checkpoint["current_model_state"]


def test_ddp_2x_batch_b_with_ema_averages_what_one_process_with_batch_2b_averages(tiny_root, tmp_path):
    # As tests/test_distributed.py: float64 and sync BatchNorm make the two computations comparable to ~1e-14.
    steps = ["--trainer.limit_train_batches=3", "--trainer.precision=64-true", *NO_AUGMENT, *EMA]
    single = ["fit", *tiny_args(tiny_root, tmp_path / "single"), "--data.batch_size=12", *steps]
    ddp = ["fit", *tiny_args(tiny_root, tmp_path / "ddp"), "--config", str(CONFIGS / "cpu_ddp.yaml"),
           "--data.batch_size=6", "--trainer.sync_batchnorm=true", *steps]
    with mock.patch.dict(os.environ):  # the one-process reference runs here; PL_GLOBAL_SEED stays out of what follows
        cli_main(single)
    # 64-true makes float64 torch's default dtype only inside Lightning's contexts: the tests that follow get float32
    leaked = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    assert leaked == torch.float32, leaked
    result = run_project(ddp)  # the 2 ranks: real processes
    assert result.returncode == 0, result.stderr[-6000:]
    (single_averaged, single_raw), (ddp_averaged, ddp_raw) = weights(tmp_path / "single"), weights(tmp_path / "ddp")
    assert relative_difference(ddp_raw, single_raw) <= 1e-9
    assert relative_difference(ddp_averaged, single_averaged) <= 1e-9
    assert relative_difference(single_averaged, single_raw) > 1e-3
