"""No host-device synchronisation on the room's 16-mixed training steps: its fused optimizer under a GradScaler checks
for inf/NaN on the device (counted by engine/tests/sync_counter.py, the room's package counting as ours).

    python -m pytest tests/test_host_syncs.py
"""

import json
from pathlib import Path

import pytest

import project
from conftest import callback, cli_main, tiny_args

# 40 images in batches of 4: 10 steps on one process. Steps count from 0; a step logs when (step + 1) % 5 == 0.
SMALL = ["--data.batch_size=4", "--trainer.log_every_n_steps=5", "--trainer.enable_progress_bar=true",
         "--trainer.limit_val_batches=0"]


def counts(output: Path, rank: int = 0, validation: bool = False) -> dict:
    """Training steps' counts by step ({0: ...}), or validation batches' ({"val0": ..., "sanity0": ...})."""
    entries = json.loads(Path(f"{output}.rank{rank}.json").read_text())
    if validation:
        return {key: entry for key, entry in entries.items() if key.startswith(("val", "sanity"))}
    return {int(key): entry for key, entry in entries.items() if key.isdigit()}


# 16-mixed as on a GPU: the precision plugin with a GradScaler (on CPU, `precision: 16-mixed` becomes bf16-mixed).
FP16_WITH_SCALER = ["--trainer.precision=null", "--trainer.plugins=" + json.dumps({
    "class_path": "lightning.pytorch.plugins.MixedPrecision", "init_args": {"precision": "16-mixed", "device": "cpu",
    "scaler": {"class_path": "torch.amp.GradScaler", "init_args": {"device": "cpu"}}}})]


@pytest.mark.slow  # ~25 s: float16 is emulated on a CPU
def test_16_mixed_steps_read_nothing_back_the_grad_scaler_checks_on_the_device(tiny_root, tmp_path):
    # An unfused SGD under a GradScaler: GradScaler.step read its inf/NaN check with .item() every step.
    output = tmp_path / "syncs"
    counter = callback("sync_counter.CountHostSyncs", output=str(output), packages=[project.__name__])
    cli = cli_main(["fit", *tiny_args(tiny_root, tmp_path / "run", *SMALL, "--trainer.max_steps=3", *FP16_WITH_SCALER,
                                      counter)])
    per_step = counts(output)
    assert sorted(per_step) == list(range(3))
    for step in (0, 1):  # the last one also holds the end of the fit (last.ckpt: the scaler's state read)
        assert per_step[step]["ours"] == per_step[step]["lightning"] == 0, (step, per_step[step]["what"])
    assert cli.trainer.optimizers[0].defaults["fused"] is True
