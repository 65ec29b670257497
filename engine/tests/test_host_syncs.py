"""No host-device synchronisation on ordinary training steps: from our code, and (as we configure Lightning) from
Lightning either; only on logging steps and on the steps where ranks agree on stop signals (every k).

    python -m pytest tests/test_host_syncs.py
"""

import json
from pathlib import Path

import pytest

from conftest import CONFIGS, callback, cli_main, run_project, tiny_args

# 40 images in batches of 4: 10 steps on one process. Steps count from 0; a step logs when (step + 1) % 5 == 0.
SMALL = ["--data.batch_size=4", "--trainer.log_every_n_steps=5", "--trainer.enable_progress_bar=true",
         "--trainer.limit_val_batches=0"]


def counts(output: Path, rank: int = 0, validation: bool = False) -> dict:
    """Training steps' counts by step ({0: ...}), or validation batches' ({"val0": ..., "sanity0": ...})."""
    entries = json.loads(Path(f"{output}.rank{rank}.json").read_text())
    if validation:
        return {key: entry for key, entry in entries.items() if key.startswith(("val", "sanity"))}
    return {int(key): entry for key, entry in entries.items() if key.isdigit()}


def test_single_process_ordinary_steps_read_nothing_back_from_the_device(tiny_root, tmp_path):
    output = tmp_path / "syncs"
    cli_main(["fit", *tiny_args(tiny_root, tmp_path / "run", *SMALL,
                                callback("sync_counter.CountHostSyncs", output=str(output)))])
    per_step = counts(output)
    assert sorted(per_step) == list(range(10))
    logging_steps = {4, 9}
    for step, entry in per_step.items():
        if step not in logging_steps:
            assert entry["ours"] == entry["lightning"] == 0, (step, entry["what"])
    # A logging step reads what it logs, once: the loss for the logger and for the progress bar.
    assert 0 < per_step[4]["ours"] + per_step[4]["lightning"] <= 4, per_step[4]["what"]


def test_a_validation_batch_reads_nothing_back_from_the_device(tiny_root, tmp_path):
    # torchmetrics checked its inputs on the host at every batch: MulticlassAccuracy's validate_args (torch.unique, one
    # per accuracy) and MeanMetric's NaN test (bool(isnan(x).any()), twice with a weight).
    output = tmp_path / "syncs"
    cli_main(["fit", *tiny_args(tiny_root, tmp_path / "run", *SMALL, "--trainer.limit_train_batches=1",
                                "--trainer.limit_val_batches=3",
                                callback("sync_counter.CountHostSyncs", output=str(output)))])
    per_batch = counts(output, validation=True)
    assert sorted(per_batch) == ["sanity0", "sanity1", "val0", "val1", "val2"]
    for key, entry in per_batch.items():
        assert entry["ours"] == entry["lightning"] == 0, (key, entry["what"])


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [[], ["--trainer.enable_checkpointing=false"]], ids=["saving", "not_saving"])
def test_ddp_ranks_agree_every_k_steps_and_lightnings_per_step_sigterm_broadcast_is_gone(checkpointing, tiny_root,
                                                                                        tmp_path):
    # 2 ranks x 20 images in batches of 4: 5 steps; logging at step 4, agreement every 2 steps (after steps 1, 3).
    # Without checkpointing the stop signals are still ours (Lightning's broadcast came back there).
    output = tmp_path / "syncs"
    result = run_project(["fit", *tiny_args(tiny_root, tmp_path / "run", *SMALL, *checkpointing,
                                            "--last_checkpoint.check_every_n_steps=2",
                                            callback("sync_counter.CountHostSyncs", output=str(output))),
                          "--config", str(CONFIGS / "cpu_ddp.yaml")])
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        per_step = counts(output, rank)
        assert sorted(per_step) == list(range(5))
        for step in (0, 2):  # ordinary: nothing, not even Lightning's SIGTERM broadcast
            assert per_step[step]["ours"] == per_step[step]["lightning"] == 0, (rank, step, per_step[step]["what"])
        for step in (1, 3):  # the agreement: one reduce of the flags, one read of the result
            assert sorted(per_step[step]["what"]) == ["ours:reduce@last_checkpoint.py:_agree",
                                                     "ours:tolist@last_checkpoint.py:_agree"], per_step[step]["what"]
