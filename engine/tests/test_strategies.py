"""One YAML line switches the strategy and precision, never what is computed: configs, dp, exact resume (in-process)."""

import contextlib
import io
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from classifier_engine.run.last_checkpoint import LastCheckpoint
from classifier_engine.strategies import DataParallelStrategy
from classifier_engine.strategies.dp import _DataParallel, _LightningForward
from conftest import CONFIGS, NETWORK, callback, cli_main, read_scalars, tiny_args

# Every config here composed onto the quickstart, except the quickstart itself and the sweep file (test_sweep.py's, a
# `sweep:` section the fit refuses): cpu_ddp.yaml; a template tests its own.
STRATEGY_CONFIGS = sorted(p.name for p in CONFIGS.glob("*.yaml") if not p.name.startswith(("quickstart", "sweep")))


def leaves(tree: dict, prefix: tuple = ()) -> dict[tuple, object]:
    """{("trainer", "devices"): 8, ...}: every value of a nested config by its path (a class's init_args as its
    own keys, as a config file may write them)."""
    out = {}
    for key, value in tree.items():
        path = prefix if key == "init_args" else (*prefix, key)
        out.update(leaves(value, path) if isinstance(value, dict) else {path: value})
    return out


def printed_config(*args: str) -> dict:
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", *args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(out.getvalue())


@pytest.mark.parametrize("name", STRATEGY_CONFIGS)
def test_strategy_config_parses_and_sets_only_what_it_switches(name, tiny_root, tmp_path):
    base = leaves(printed_config(*tiny_args(tiny_root, tmp_path)))
    composed = leaves(printed_config(*tiny_args(tiny_root, tmp_path), "--config", str(CONFIGS / name)))
    wanted = leaves(yaml.safe_load((CONFIGS / name).read_text()))
    assert {key: composed[key] for key in wanted} == wanted  # everything it sets arrives
    moved = {key for key in composed if composed[key] != base.get(key)}
    assert moved <= wanted.keys(), f"{name} changes {sorted(moved - wanted.keys())} without saying so"


def test_dp_is_a_registered_strategy_running_one_replica_on_cpu(tiny_root, tmp_path):
    cli = cli_main([*tiny_args(tiny_root, tmp_path), "--trainer.strategy=dp"], run=False)
    assert isinstance(cli.trainer.strategy, DataParallelStrategy)
    assert cli.trainer.world_size == 1 and cli.trainer.strategy.device_ids == []


class AutocastDtype(nn.Module):
    """Records the CPU autocast dtype each call runs under (None: autocast off); replicas share the list."""

    def __init__(self):
        super().__init__()
        self.seen: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return x


def replica_autocast_dtypes(monkeypatch, data_parallel: nn.DataParallel, recorder: AutocastDtype) -> list:
    """The autocast dtypes two replicas ran under, each in its own thread of torch's parallel_apply (as on two GPUs),
    called under float16 CPU autocast: parallel_apply pointed at the CPU, whose autocast default is bfloat16 (CUDA's is
    float16: there bf16-mixed became float16)."""
    stock_enabled = torch.is_autocast_enabled
    for name, value in (("is_available", lambda: True), ("current_accelerator", lambda *a: torch.device("cpu")),
                        ("current_stream", lambda *a: contextlib.nullcontext()),
                        ("device_index", lambda *a: contextlib.nullcontext())):
        monkeypatch.setattr(torch.accelerator, name, value)
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type="cpu": stock_enabled(device_type))
    data_parallel.device_ids, data_parallel.src_device_obj = [0, 1], torch.device("cpu")  # as DataParallel on 2 GPUs
    replicas = [data_parallel.module._replicate_for_data_parallel() for _ in range(2)]  # as replicate() makes them
    with torch.autocast("cpu", dtype=torch.float16):
        data_parallel.parallel_apply(replicas, [(torch.ones(2),), (torch.ones(2),)], [{}, {}])
    return recorder.seen


def test_dp_replicas_autocast_to_the_callers_dtype_in_their_threads(monkeypatch):
    # configs/dp_8gpu.yaml + configs/bf16.yaml: the replicas ran float16 autocast, without a GradScaler.
    recorder = AutocastDtype()
    seen = replica_autocast_dtypes(monkeypatch, _DataParallel(_LightningForward(recorder)), recorder)
    assert seen == [torch.float16, torch.float16]


def fit(tiny_root: Path, run_dir: Path, *extra: str):
    return cli_main(["fit", *tiny_args(tiny_root, run_dir), *extra])


def last_checkpoint(cli) -> Path:
    """The run's last.ckpt (classifier_engine.run.last_checkpoint)."""
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, LastCheckpoint)]
    return callback.path


def network_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith(NETWORK)}


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    keys = [k for k in a if a[k].is_floating_point()]
    diff = sum((a[k] - b[k]).double().pow(2).sum() for k in keys) ** 0.5
    norm = sum(b[k].double().pow(2).sum() for k in keys) ** 0.5
    return float(diff / norm)


# Deterministic inputs: a full-image crop (scale 1) and no flip, so the data order is all that matters.
NO_AUGMENT = ["--data.train_crop_scale=[1.0, 1.0]", "--data.hflip_prob=0"]


def test_dp_trains_like_single_device_and_its_checkpoint_loads_anywhere(tiny_root, tmp_path):
    single = fit(tiny_root, tmp_path / "single", "--trainer.max_steps=4", *NO_AUGMENT)
    dp = fit(tiny_root, tmp_path / "dp", "--trainer.max_steps=4", "--trainer.strategy=dp", *NO_AUGMENT)
    dp_ckpt = last_checkpoint(dp)
    single_ckpt = last_checkpoint(single)
    assert relative_difference(network_state(dp_ckpt), network_state(single_ckpt)) == 0.0
    # plain parameter names (no DataParallel `module.`), and the module still has its own forward afterwards
    assert all(not k.startswith("module.") and ".module." not in k for k in network_state(dp_ckpt))
    assert "forward" not in dp.model.__dict__
    # a dp checkpoint validates the same under a single device, and a single-device one under dp
    from_dp = cli_main(["validate", *tiny_args(tiny_root, tmp_path / "v1"), f"--ckpt_path={dp_ckpt}"])
    under_dp = cli_main(["validate", *tiny_args(tiny_root, tmp_path / "v2"), "--trainer.strategy=dp",
                         f"--ckpt_path={dp_ckpt}"])
    assert from_dp.trainer.callback_metrics["val/acc1"] == under_dp.trainer.callback_metrics["val/acc1"]
    under_dp_loss = float(under_dp.trainer.callback_metrics["val/loss"])
    assert from_dp.trainer.callback_metrics["val/loss"] == pytest.approx(under_dp_loss)


def test_resume_from_last_ends_with_the_weights_of_an_uninterrupted_run(tiny_root, tmp_path):
    three_epochs = ["--trainer.max_epochs=3"]
    uninterrupted = fit(tiny_root, tmp_path / "straight", *three_epochs)
    stop = callback("stop_callbacks.StopAfterEpoch", epoch=0)
    first = fit(tiny_root, tmp_path / "resumed", *three_epochs, stop)
    assert first.trainer.current_epoch == 1 and first.trainer.global_step == 5
    resumed = fit(tiny_root, tmp_path / "resumed", *three_epochs, "--ckpt_path=last")

    assert resumed.trainer.global_step == uninterrupted.trainer.global_step == 15
    assert resumed.trainer.current_epoch == uninterrupted.trainer.current_epoch == 3
    straight_ckpt = last_checkpoint(uninterrupted)
    resumed_ckpt = last_checkpoint(resumed)
    assert relative_difference(network_state(resumed_ckpt), network_state(straight_ckpt)) <= 1e-6
    optimizer_states = [torch.load(p, weights_only=True)["optimizer_states"][0]["state"]
                        for p in (resumed_ckpt, straight_ckpt)]
    for key in optimizer_states[1]:
        torch.testing.assert_close(optimizer_states[0][key]["momentum_buffer"],
                                   optimizer_states[1][key]["momentum_buffer"])
    lr_states = [torch.load(p, weights_only=True)["lr_schedulers"][0]["last_epoch"]
                 for p in (resumed_ckpt, straight_ckpt)]
    assert lr_states[0] == lr_states[1] == 15

    # the resumed run continued in the same version dir: one run, its curves joined
    versions = sorted(p.name for p in (tmp_path / "resumed" / "lightning_logs").iterdir())
    assert versions == ["version_0"]
    # every step's loss, logged once: the first run's steps 0-4 and the resumed run's 5-14, in one event dir
    steps = [step for step, _ in read_scalars(tmp_path / "resumed" / "lightning_logs" / "version_0")["train/loss"]]
    assert sorted(steps) == list(range(15))


def test_resume_from_last_with_nothing_to_resume_starts_from_scratch(tiny_root, tmp_path):
    cli = fit(tiny_root, tmp_path, "--trainer.max_steps=2", "--ckpt_path=last")
    assert cli.trainer.global_step == 2
