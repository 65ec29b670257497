"""strategy fsdp2 (configs/fsdp.yaml) on the room's ResNet, on CPU with gloo: the weights ddp trains, a ddp checkpoint
continued, a checkpoint any process count evaluates exactly, a sharded one resumed after a kill -9 as the uninterrupted
run, exported by one process and fine-tuned from, channels_last, BatchNorm's units under bf16, and one-line refusals of
what it does not do. The library's own reading of sharded files: engine/tests/test_sharded_checkpoints.py.

    python -m pytest tests/test_fsdp.py --durations=0
"""

import os
from pathlib import Path
from unittest import mock

import pytest
import torch
from classifier_engine.entry import close_process_group
from classifier_engine.export import main as export_main
from classifier_engine.run.checkpoint_io import load_checkpoint
from test_sharded_checkpoints import sharded_checkpoint
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from conftest import CONFIGS, callback, cli_main, project_in_process, read_scalars, run_project, tiny_args
from project.weights import load_pretrained
from test_distributed import FORKED_DDP, assert_ok, in_process
from test_resume import EVERY_STEP, LAST, assert_same_training, final_state

FSDP = ["--config", str(CONFIGS / "fsdp.yaml"), "--trainer.devices=2"]
SHARDED = ["--trainer.strategy=fsdp2_sharded"]
FSDP_STRATEGY = "--trainer.strategy=classifier_engine.strategies.fsdp.FSDPStrategy"
# 40 images, batches of 8 over 2 ranks: 2 steps an epoch; 3 epochs, validated once at the end.
EPOCHS = ["--trainer.max_epochs=3", "--trainer.check_val_every_n_epoch=3"]


def after_step(run_dir: Path, step: int = 1) -> str:
    """A checkpoint after optimizer step `step`, into <run_dir>/step<step>.ckpt."""
    return callback("stop_callbacks.SaveAtStep", step=step, path=str(run_dir / f"step{step}.ckpt"))


def trained(path: Path, tmp_path: Path) -> dict:
    """final_state of a checkpoint as the project reads it (a sharded one: its file, and the shards it names)."""
    one_file = tmp_path / f"{os.urandom(4).hex()}.ckpt"
    torch.save(load_checkpoint(path if path.is_file() else path / LAST), one_file)
    return final_state(one_file)


@pytest.fixture(scope="module")
def fsdp_run(tiny_root, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("fsdp_run")
    assert_ok(run_project(["fit", *tiny_args(tiny_root, run_dir, *EPOCHS), *FSDP, after_step(run_dir)], timeout=900))
    return run_dir


def validate(checkpoint: Path, tiny_root: Path, run_dir: Path) -> dict[str, float]:
    """Val metrics of `validate` in one plain process (this one)."""
    in_process(["validate", *tiny_args(tiny_root, run_dir), "--data.batch_size=4", f"--ckpt_path={checkpoint}"])
    scalars = read_scalars(run_dir / "lightning_logs" / "version_0")
    return {key: scalars[key][-1][1] for key in ("val/acc1", "val/loss")}


@pytest.mark.slow
def test_fsdp_steps_as_ddp_does_and_its_checkpoint_evaluates_exactly_at_1_and_2_processes(fsdp_run, tiny_root,
                                                                                       tmp_path):
    # One step: gradients averaged over the ranks, the LR, weight decay and momentum as ddp has them (measured 7e-7).
    # Later steps drift apart in float32 as ddp drifts from itself: this tiny network turns 1e-7 in the weights into
    # 4e-2 in the next gradient (docs/how-it-works.md#fsdp); ModelParallelStrategy refuses 64-true.
    ddp_run = tmp_path / "ddp"  # the fixture's run under ddp
    ddp_args = [*FORKED_DDP, after_step(ddp_run), after_step(ddp_run, 2)]
    assert_ok(run_project(["fit", *tiny_args(tiny_root, ddp_run, *EPOCHS), *ddp_args]))
    fsdp, reference = final_state(fsdp_run / "step1.ckpt"), final_state(ddp_run / "step1.ckpt")
    assert fsdp["step"] == reference["step"] == 1
    assert_same_training(fsdp, reference, tolerance=1e-5)
    # ddp's step-1 checkpoint continued under fsdp (mid-epoch, sharded) for one step: ddp's step 2 (measured: weights
    # 9.7e-9 and momentum 4.0e-7 apart, relative; the step moves the weights 5.7e-2).
    continued = tmp_path / "continued"
    assert_ok(run_project(["fit", *tiny_args(tiny_root, continued, *EPOCHS), *FSDP, *SHARDED,
                           "--trainer.max_steps=2", f"--ckpt_path={ddp_run / 'step1.ckpt'}"], timeout=900))
    assert_same_training(trained(continued, tmp_path), final_state(ddp_run / "step2.ckpt"), tolerance=1e-5)
    # The checkpoint is a ddp one, key for key: what validates and exports in one process (python -m project export).
    assert {k: v.shape for k, v in fsdp["weights"].items()} == {k: v.shape for k, v in reference["weights"].items()}
    # 17 val images: 17 in one process, 9+8 on the fit's 2 ranks (its own validation of the weights it saved last, at
    # the end of its last epoch), in batches of 8: 2 batches on one rank and 1 on the other, the uneven case the
    # sharded forward must survive; padding would count some twice. (At 3 and more ranks the same sampler shards
    # ddp's and the shards' evaluations: test_distributed.py, test_shards.py.)
    one = validate(fsdp_run / LAST, tiny_root, tmp_path / "w1")
    scalars = read_scalars(fsdp_run / "lightning_logs" / "version_0")
    two = {key: scalars[key][-1][1] for key in ("val/acc1", "val/loss")}
    assert "perf/device/tflops" in scalars  # FLOPs counted on the network before it was sharded
    assert one["val/acc1"] == two["val/acc1"]
    # float32 forwards of other batch compositions (1.1e-6 measured; the counts above are exact)
    assert two["val/loss"] == pytest.approx(one["val/loss"], rel=1e-5)


@pytest.mark.slow
def test_fsdp_kill_9_mid_epoch_then_resume_ends_as_the_uninterrupted_run(fsdp_run, tiny_root, tmp_path):
    # Sharded checkpoints, killed and resumed: the fixture's one-file run, bitwise (the same reductions).
    run = tmp_path / "run"
    args = [*tiny_args(tiny_root, run, *EPOCHS), *FSDP, *SHARDED]
    killed = run_project(["fit", *args, *EVERY_STEP, callback("stop_callbacks.SignalAtStep", step=3)], timeout=900)
    assert killed.returncode != 0
    stopped = trained(run, tmp_path)
    assert (stopped["step"], stopped["epoch"]) == (3, 1)  # epoch 1, after its first batch
    # One process, no process group, exports it (python -m project export checks the program's logits against the
    # network's): the shards read into the one-file checkpoint they stand for.
    files = export_main(["--ckpt_path", str(run / LAST), "--out_dir", str(tmp_path / "export"), "--no-onnx"])
    assert files["pt2"].is_file()
    assert_ok(run_project(["fit", *args, "--ckpt_path=last"], timeout=900))
    assert_same_training(trained(run, tmp_path), final_state(fsdp_run), tolerance=0)
    # Each checkpoint is its file and one folder: the earlier saves' folders were deleted as each new one landed.
    checkpoints = (run / LAST).parent
    assert sorted(p.name.split(".shards")[0].rsplit(".", 1)[0] for p in checkpoints.glob(".*.shards")) == sorted(
        "." + p.name for p in checkpoints.glob("*.ckpt"))


@pytest.mark.parametrize("refused, message", [
    (["--trainer.sync_batchnorm=true"], "sync_batchnorm is not applied under strategy fsdp2"),
    ([callback("project.callbacks.ema.EMA")], "EMA does not average sharded weights"),
])
def test_fsdp_refuses_sync_batchnorm_and_ema_in_one_line(refused, message, tiny_root, tmp_path, monkeypatch, capsys):
    args = ["fit", *tiny_args(tiny_root, tmp_path), "--config", str(CONFIGS / "fsdp.yaml"), *refused]
    try:
        code, _, err = project_in_process(args, monkeypatch, capsys)
    finally:
        close_process_group()  # the 1-process gloo group the refused run started
    assert code == 2 and message in err.strip().splitlines()[-1]
    assert "Traceback" not in err


def test_the_rooms_load_pretrained_reads_a_sharded_checkpoint(tmp_path):
    path = sharded_checkpoint(tmp_path)  # --model.finetune.weights <ckpt> of a fsdp2_sharded run
    network = nn.Sequential(nn.Linear(2, 2, bias=False))
    load_pretrained(network, str(path), arch=None, num_classes=2)
    assert network[0].weight.tolist() == [[1, 1], [1, 1]]


def test_fsdp_with_channels_last_trains_with_nhwc_convolutions(tiny_root, tmp_path):
    # configs/ddp_8gpu.yaml sets channels_last, so `--config configs/ddp_8gpu.yaml --config configs/fsdp.yaml` did this.
    # FSDP2 shards contiguous parameters only: converted after fully_shard, its lazy init failed ("view size is not
    # compatible"); before, fully_shard refuses them. The NHWC input alone makes the convolutions NHWC.
    args = [*tiny_args(tiny_root, tmp_path, "--trainer.max_steps=1", "--trainer.limit_val_batches=1"),
            "--config", str(CONFIGS / "fsdp.yaml"), "--model.channels_last=true"]
    nhwc = []

    def record(module, inputs, out) -> None:
        if not out.is_meta:  # not the FLOP counter's weightless copy
            nhwc.append(out.is_contiguous(memory_format=torch.channels_last))

    with mock.patch.dict(os.environ):  # the 1-process gloo group's MASTER_* stay out of the tests that follow
        try:
            cli = cli_main(args, run=False)
            for conv in (cli.model.network.conv1, cli.model.network.layer4[1].conv2):  # the root's, a block's
                conv.register_forward_hook(record)
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        finally:
            close_process_group()
    assert cli.trainer.global_step == 1
    assert nhwc and all(nhwc), nhwc


def test_fsdp_under_bf16_mixed_gathers_bf16_weights_and_keeps_batchnorm_float32(tiny_root, tmp_path, monkeypatch):
    # Without a MixedPrecisionPolicy, FSDP2 all-gathered float32 weights that autocast then cast to bf16. BatchNorm
    # refuses bf16 weights beside its float32 running statistics ("expected scalar type BFloat16 but found Float"):
    # its own unit, float32, as FSDP1 did (pytorch#75478). Gradients are reduced in float32, as ddp reduces them.
    import classifier_engine.strategies.fsdp as fsdp

    policies, gathered = {}, {}
    real = fsdp.fully_shard

    def recording(module, **kwargs):
        policy = kwargs.get("mp_policy", MixedPrecisionPolicy())
        policies.setdefault(type(module).__name__, set()).add((policy.param_dtype, policy.reduce_dtype))
        return real(module, **kwargs)

    def record(module, inputs, out) -> None:
        if not out.is_meta:  # not the FLOP counter's weightless copy
            gathered[module.name] = module.weight.dtype

    monkeypatch.setattr(fsdp, "fully_shard", recording)
    args = [*tiny_args(tiny_root, tmp_path, "--trainer.max_steps=1", "--trainer.limit_val_batches=1"),
            "--config", str(CONFIGS / "fsdp.yaml"), "--trainer.precision=bf16-mixed"]
    with mock.patch.dict(os.environ):
        try:
            cli = cli_main(args, run=False)
            for name in ("conv1", "bn1"):  # a block's
                module = getattr(cli.model.network.layer1[0], name)
                module.name = name
                module.register_forward_hook(record)
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        finally:
            close_process_group()
    assert cli.trainer.global_step == 1
    assert policies == {"BatchNorm2d": {(None, None)}, "Sequential": {(torch.bfloat16, torch.float32)},
                        "ResNet": {(torch.bfloat16, torch.float32)}}
    assert gathered == {"conv1": torch.bfloat16, "bn1": torch.float32}


def bf16_fsdp_fit(tiny_root, tmp_path, batchnorm_units: bool) -> tuple[dict, float]:
    """Two steps under fsdp2 at bf16-mixed (one gloo rank): the dtype a block's BatchNorm ran with, the last loss."""
    args = [*tiny_args(tiny_root, tmp_path, "--trainer.max_steps=2", "--trainer.limit_val_batches=1"),
            "--config", str(CONFIGS / "fsdp.yaml"), "--trainer.precision=bf16-mixed", FSDP_STRATEGY,
            f"--trainer.strategy.batchnorm_units={str(batchnorm_units).lower()}"]
    seen = {}

    def record(module, inputs, out) -> None:
        if not out.is_meta:  # not the FLOP counter's weightless copy
            seen.update(weight=module.weight.dtype, statistics=module.running_mean.dtype, output=out.dtype)

    with mock.patch.dict(os.environ):  # the 1-process gloo group's MASTER_* stay out of the tests that follow
        try:
            cli = cli_main(args, run=False)
            cli.model.network.layer1[0].bn1.register_forward_hook(record)
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
            units = {type(m).__name__ for m in cli.model.network.modules() if hasattr(m, "reshard")}
        finally:
            close_process_group()
    assert cli.trainer.global_step == 2
    return {**seen, "units": units}, float(cli.trainer.callback_metrics["train/loss"])


@pytest.mark.slow  # two fits
def test_fsdp_gathers_batchnorm_with_its_block_in_bf16_and_trains_as_its_own_units_do(tiny_root, tmp_path):
    own, own_loss = bf16_fsdp_fit(tiny_root, tmp_path / "own", batchnorm_units=True)
    grouped, grouped_loss = bf16_fsdp_fit(tiny_root, tmp_path / "grouped", batchnorm_units=False)
    assert own == {"weight": torch.float32, "statistics": torch.float32, "output": torch.bfloat16,
                   "units": {"FSDPBatchNorm2d", "FSDPSequential", "FSDPResNet"}}
    assert grouped == {"weight": torch.bfloat16, "statistics": torch.float32, "output": torch.bfloat16,
                       "units": {"FSDPSequential", "FSDPResNet"}}  # no unit of its own: one all-gather less each
    # The second step's loss, after one update with BatchNorm's weights rounded to bf16 for the forward
    assert grouped_loss == pytest.approx(own_loss, rel=2e-2)
