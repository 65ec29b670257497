"""Resume exact to the batch with the room's recipe ingredients on: a run killed (-9) mid-epoch and resumed with
`--ckpt_path last` ends with the weights, the EMA's averaged weights, optimizer state and step of an uninterrupted run,
its model's MixUp/CutMix draws and its EMA callback's updates included. (The library's own resume, its data
ingredients, ddp and signals: engine/tests/test_resume.py.)

    python -m pytest tests/test_resume.py --durations=0
"""

import signal
import warnings
from pathlib import Path

import pytest
import torch

from conftest import callback, cli_main, run_project, tiny_args

# 40 images in batches of 8: 5 steps per epoch. The room's ingredients (its model's mixing, its EMA callback) beside
# the library's data ones: their random draws too must come out the same after a resume.
RECIPE = ["--model.loss.mixup_alpha=0.2", "--model.loss.cutmix_alpha=1.0",
          callback("project.callbacks.ema.EMA", decay=0.9, every_n_steps=2, warmup_epochs=0.5)]
EPOCHS = ["--trainer.max_epochs=3", "--trainer.check_val_every_n_epoch=3", *RECIPE,
          "--data.auto_augment=trivialaugment_wide", "--data.random_erase_prob=0.5", "--data.ra_reps=2",
          # 24 px in epochs 0-1, 32 px in epoch 2: the kill below lands in epoch 1
          "--data.progressive_resizing={start_size: 24, end_size: 32, start_epoch: 1, end_epoch: 2, multiple: 8}"]
WORKERS = ["--data.num_workers=2", "--data.persistent_workers=true"]
EVERY_STEP = ["--last_checkpoint.every_n_steps=1"]
LAST = "lightning_logs/version_0/checkpoints/last.ckpt"


def final_state(path: Path) -> dict:
    """Step, epoch, network weights and momentum of a checkpoint file, or of <root>'s version_0/last.ckpt."""
    checkpoint = torch.load(path if path.is_file() else path / LAST, map_location="cpu", weights_only=True)
    momentum = checkpoint["optimizer_states"][0]["state"]
    network = lambda state: {k: v for k, v in state.items() if k.startswith("network.")}  # noqa: E731
    return {"step": checkpoint["global_step"], "epoch": checkpoint["epoch"],
            "weights": network(checkpoint.get("current_model_state", checkpoint["state_dict"])),  # the trained ones
            "averaged": network(checkpoint["state_dict"]),  # the EMA's, when the run keeps one
            "momentum": {k: v["momentum_buffer"] for k, v in momentum.items()}}


def assert_same_training(resumed: dict, reference: dict, tolerance: float = 1e-6) -> None:
    assert resumed["step"] == reference["step"] and resumed["epoch"] == reference["epoch"]
    for part in ("weights", "averaged", "momentum"):
        a, b = resumed[part], reference[part]
        assert a.keys() == b.keys()
        floats = [k for k in b if b[k].is_floating_point()]
        diff = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in floats) ** 0.5
        norm = sum(float(b[k].double().pow(2).sum()) for k in floats) ** 0.5
        assert diff <= tolerance * norm, f"{part}: relative difference {diff / norm:.3e}"


@pytest.mark.slow
def test_kill_9_in_epoch_1_of_3_with_mixing_and_ema_then_resume_ends_as_the_uninterrupted_run(tiny_root, tmp_path):
    reference = tmp_path / "reference"
    cli_main(["fit", *tiny_args(tiny_root, reference, *EPOCHS, *WORKERS)])
    run = tmp_path / "run"
    args = tiny_args(tiny_root, run, *EPOCHS, *WORKERS)
    # last.ckpt after every step; kill -9 when step 8 starts: epoch 1, its 3rd batch, checkpoint at step 7.
    killed = run_project(["fit", *args, *EVERY_STEP, callback("stop_callbacks.SignalAtStep", step=7)])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    stopped = torch.load(run / LAST, map_location="cpu", weights_only=True)
    assert (stopped["global_step"], stopped["epoch"]) == (7, 1)
    with warnings.catch_warnings(record=True) as caught:  # the resume in this process: the kill needed a process
        warnings.simplefilter("always")
        cli_main(["fit", *args, "--ckpt_path=last"])
    assert not [w for w in caught if "resuming from a checkpoint that ended before the epoch ended" in str(w.message)]
    uninterrupted = final_state(reference)
    assert any(not torch.equal(uninterrupted["averaged"][k], v) for k, v in uninterrupted["weights"].items())  # EMA's
    assert_same_training(final_state(run), uninterrupted)
