"""`python -m classifier_engine` in-process: checkpoints, saved config, `test`, reloads, --print_config, batch limits.

    python -m pytest engine/tests/test_cli.py
"""

import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import yaml
from lightning.pytorch.cli import LightningArgumentParser

from classifier_engine import ImageFolderDataModule
from conftest import cli_main, model_class, read_scalars, run_project, tiny_args

TEST_KEYS = {"test/loss", "test/acc1", "test/acc5"}


class Run:
    """One finished `fit` on the tiny data: its arguments, directories and final metrics."""

    def __init__(self, args: list[str], root_dir: Path, metrics: dict[str, float]):
        self.args, self.root_dir, self.metrics = args, root_dir, metrics
        self.version_dir = root_dir / "lightning_logs" / "version_0"
        self.checkpoints = self.version_dir / "checkpoints"
        self.last = self.checkpoints / "last.ckpt"


@pytest.fixture(scope="module")
def run(tiny_root, tmp_path_factory) -> Run:
    root_dir = tmp_path_factory.mktemp("fit")
    args = tiny_args(tiny_root, root_dir)
    cli = cli_main(["fit", *args])
    metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    return Run(args, root_dir, metrics)


def test_fit_keeps_last_and_best_by_val_acc1_checkpoints_and_the_config(run):
    names = sorted(p.name for p in run.checkpoints.iterdir())
    best = f"epoch000-val_acc1={run.metrics['val/acc1']:.4f}.ckpt"
    assert names == sorted(["last.ckpt", best])
    saved = yaml.safe_load((run.version_dir / "config.yaml").read_text())
    assert saved["checkpoint"]["monitor"] == "val/acc1" and saved["checkpoint"]["mode"] == "max"
    assert saved["data"]["init_args"]["batch_size"] == 8


def test_test_subcommand_logs_test_metrics_equal_to_val(run, tmp_path):
    # Without a ROOT/test/ folder `test` evaluates val/: the same images as fit's last validation.
    cli = cli_main(["test", *run.args, f"--trainer.default_root_dir={tmp_path}", f"--ckpt_path={run.last}"])
    scalars = read_scalars(Path(cli.trainer.log_dir))
    assert TEST_KEYS <= scalars.keys()
    assert scalars["test/acc1"][-1][1] == pytest.approx(run.metrics["val/acc1"])
    assert scalars["test/loss"][-1][1] == pytest.approx(run.metrics["val/loss"], rel=1e-5)

def test_reloaded_checkpoint_and_validate_ckpt_path_give_the_same_val_acc1(run, tmp_path):
    model = model_class().load_from_checkpoint(run.last)
    datamodule = ImageFolderDataModule.load_from_checkpoint(run.last)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    (reloaded,) = trainer.validate(model, datamodule=datamodule)

    cli = cli_main(["validate", *run.args, f"--trainer.default_root_dir={tmp_path}", f"--ckpt_path={run.last}"])
    validated = float(cli.trainer.callback_metrics["val/acc1"])
    assert reloaded["val/acc1"] == pytest.approx(run.metrics["val/acc1"])
    assert validated == pytest.approx(run.metrics["val/acc1"])


def opens_of(path: Path, trace: Path) -> list[str]:
    """The open/openat calls of `path` in an `strace -f` output (every process, Python's and C++'s opens alike)."""
    return [line for line in trace.read_text().splitlines() if f'"{path}"' in line and "open" in line]


@pytest.mark.slow  # another process, under strace
@pytest.mark.parametrize("subcommand", ["validate", "fit"])
def test_a_start_reads_its_checkpoint_once_and_hands_it_along(run, tmp_path, subcommand):
    # The plan maps the file once (a memory-mapped, weights-only load: 2 opens); the fit checks, LightningCLI's
    # hyperparameters and Lightning's restore use that load. Before: 9 opens for `validate --ckpt_path FILE`.
    strace = shutil.which("strace")
    # --seccomp-bpf stops the process only at the traced calls (3x faster than stopping at every call; strace >= 5.3)
    tracer = [strace, "--seccomp-bpf", "-f", "-qq", "-e", "trace=open,openat,openat2"]
    if strace is None or subprocess.run([*tracer, "-o", "/dev/null", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs a working strace (>= 5.3, with seccomp-bpf)")
    root = tmp_path / "root"
    checkpoint = root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    checkpoint.parent.mkdir(parents=True)
    shutil.copy(run.last, checkpoint)  # fit continues that run: it rewrites last.ckpt (a new file, not an open of it)
    trace = tmp_path / "trace.txt"
    args = [subcommand, *run.args, f"--trainer.default_root_dir={root}", "--trainer.max_epochs=2",
            f"--ckpt_path={checkpoint}"]
    result = run_project(args, launcher=[*tracer, "-o", str(trace), sys.executable])
    assert result.returncode == 0, result.stderr[-3000:]
    opens = opens_of(checkpoint, trace)
    assert 1 <= len(opens) <= 2, "\n".join(opens)


def test_print_config_fed_back_reproduces_the_run_into_the_same_dir(run, capsys, tmp_path):
    with pytest.raises(SystemExit) as exited:
        cli_main(["fit", *run.args, "--print_config"])
    assert exited.value.code == 0
    printed = tmp_path / "printed.yaml"
    printed.write_text(capsys.readouterr().out)

    # The printed config names the same default_root_dir: this rerun lands next to the first one, not over it.
    before = {p: p.stat().st_mtime_ns for p in run.version_dir.rglob("*") if p.is_file()}
    cli = cli_main(["fit", "--config", str(printed)])
    rerun_dir = Path(cli.trainer.log_dir)
    assert rerun_dir == run.root_dir / "lightning_logs" / "version_1"
    assert {p: p.stat().st_mtime_ns for p in run.version_dir.rglob("*") if p.is_file()} == before
    first, second = (yaml.safe_load((d / "config.yaml").read_text()) for d in (run.version_dir, rerun_dir))
    # Each run's config names its own version dir (the logger is pinned to it); everything else is the same.
    assert [c["trainer"].pop("logger")["init_args"]["version"] for c in (first, second)] == [0, 1]
    assert second == first
    assert float(cli.trainer.callback_metrics["val/acc1"]) == pytest.approx(run.metrics["val/acc1"])


def test_a_batch_limit_of_1_is_one_batch_and_1_0_all_of_them(tiny_root, tmp_path):
    # Lightning types these Union[float, int]: parsed float-first, `1` used to arrive as 1.0 = every batch.
    LightningArgumentParser().add_lightning_class_args(L.Trainer, "trainer")  # a stock Trainer parser built first
    limits = tmp_path / "limits.yaml"
    limits.write_text("trainer:\n  limit_val_batches: 1\n")
    cli = cli_main(["fit", *tiny_args(tiny_root, tmp_path, "--trainer.limit_train_batches=1", "--config", str(limits))])
    assert cli.trainer.global_step == 1  # 40 images at batch 8 would be 5 steps
    assert cli.trainer.num_val_batches == [1]  # 17 val images at batch 8 would be 3
    cli = cli_main(tiny_args(tiny_root, tmp_path, "--trainer.limit_train_batches=1.0",
                             "--trainer.limit_val_batches=0.5"),
                   run=False)
    assert (cli.trainer.limit_train_batches, cli.trainer.limit_val_batches) == (1.0, 0.5)


def test_an_empty_argument_list_is_the_command_line_not_sys_argv(monkeypatch, capsys):
    # cli_main([]) from a notebook: the kernel's own sys.argv is no command line of the run.
    monkeypatch.setattr(sys, "argv", ["ipykernel_launcher.py", "--trainer.max_epochs=not-a-number"])
    with pytest.raises((SystemExit, ValueError)) as raised:  # (in-process, a bad value is jsonargparse's ValueError)
        cli_main([], model=model_class(), data=ImageFolderDataModule, run=False)
    said = f"{raised.value}\n{capsys.readouterr().err}"
    assert "data.root is not set" in said and "max_epochs" not in said, said[-2000:]


@pytest.mark.parametrize("given", [["--config", "{file}"], ["-c", "{file}"], ["--config={file}"], ["-c={file}"]])
def test_options_a_config_file_set_for_the_class_switched_from_are_named_however_the_file_was_given(given, tmp_path,
                                                                                                     capsys):
    file = tmp_path / "folders.yaml"
    file.write_text(yaml.safe_dump({"data": {"root": str(tmp_path / "images"), "batch_size": 8}}))
    with pytest.raises(SystemExit) as done:
        cli_main(["fit", *(word.format(file=file) for word in given), "--data.class_path",
                  "classifier_engine.data.ShardDataModule", f"--data.init_args.shards={tmp_path / 'shards'}",
                  f"--trainer.default_root_dir={tmp_path / 'runs'}", "--plan"],
                 model=model_class(), data=ImageFolderDataModule)
    out = capsys.readouterr().out
    assert done.value.code == 0 and "data: root (set for ImageFolderDataModule in a config file) left out: not " \
        "options of classifier_engine.data.ShardDataModule" in out, out
