"""A sharded checkpoint of the room's ResNet (strategy fsdp2_sharded) in an object store: stored whole, resumed on an
empty mirror at its step, and refused in one line when the store lacks a file of its shard folder. (The store's own
rules, on any model: engine/tests/test_remote_runs.py, whose store fixtures this file uses.)

    python -m pytest tests/test_remote_sharded_checkpoints.py
"""

import pytest
from test_remote_runs import RUN, fit_args, s3, store, stored, stored_checkpoint  # noqa: F401  (s3, store: fixtures)

from conftest import CONFIGS, run_project


@pytest.mark.slow
def test_a_sharded_checkpoint_is_stored_whole_and_resumed_on_an_empty_mirror_at_its_step(tiny_root, s3, store,  # noqa: F811
                                                                                         tmp_path):
    fsdp = ["--config", str(CONFIGS / "fsdp.yaml"), "--trainer.devices=2", "--trainer.strategy=fsdp2_sharded"]
    env = {**store, "CLASSIFIER_ENGINE_RUN_MIRROR": str(tmp_path / "node1")}
    first = run_project([*fit_args(tiny_root, "s3://runs/s"), *fsdp], env=env, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    files, last = stored(s3, "s"), f"{RUN}/checkpoints/last.ckpt"
    folder = f"{RUN}/checkpoints/{stored_checkpoint(s3, f's/{last}', tmp_path)['shards']}"
    assert {f"{folder}/.metadata", f"{folder}/__0_0.distcp", f"{folder}/__1_0.distcp"} <= files.keys()
    assert len({name.rpartition("/")[0] for name in files if ".last.ckpt." in name}) == 1  # the earlier ones deleted
    step = stored_checkpoint(s3, f"s/{last}", tmp_path)["global_step"]

    env["CLASSIFIER_ENGINE_RUN_MIRROR"] = str(tmp_path / "node2")  # another node: only the store is left
    resumed = run_project([*fit_args(tiny_root, "s3://runs/s", "--trainer.max_epochs=2"), *fsdp, "--ckpt_path=last"],
                          env=env, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Restoring states from the checkpoint path at {tmp_path / 'node2' / 'runs' / 's' / last}" in (
        resumed.stdout + resumed.stderr)
    assert stored_checkpoint(s3, f"s/{last}", tmp_path)["global_step"] == 2 * step
    assert not any(name.startswith("lightning_logs/version_1") for name in stored(s3, "s"))

    # A stored sharded checkpoint the store lacks a file of (saved by a version that never uploaded .metadata):
    # refused in one line, not skipped for a run from step 0.
    folder = f"{RUN}/checkpoints/{stored_checkpoint(s3, f's/{last}', tmp_path)['shards']}"
    s3.delete_object(Bucket="runs", Key=f"s/{folder}/.metadata")
    env["CLASSIFIER_ENGINE_RUN_MIRROR"] = str(tmp_path / "node3")
    refused = run_project([*fit_args(tiny_root, "s3://runs/s", "--trainer.max_epochs=3"), *fsdp, "--ckpt_path=last"],
                          env=env, timeout=900)
    assert (refused.returncode, refused.stderr.strip().splitlines()[-1]) == (2, (
        f"error: the stored checkpoint s3://runs/s/{last} is incomplete: the store lacks 1 file(s) of its shard folder "
        f"{folder.rpartition('/')[2]} (.metadata), never uploaded or deleted since; delete the checkpoint (aws s3 rm "
        f"s3://runs/s/{last}) and rerun: --ckpt_path last then continues from the one before it"))
