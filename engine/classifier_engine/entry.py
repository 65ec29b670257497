"""`python -m <package> {fit,validate,test,predict,export,sweep} ...`: the command, each subcommand's entry point,
and one line and exit 2 for a user's error (CLASSIFIER_ENGINE_DEBUG=1 shows the traceback).

    python -m classifier_engine fit --model.class_path my_models.MyModule --data.class_path my_data.MyData --plan
"""

import sys
from functools import partial
from typing import Optional

from classifier_engine.cli import cli_main, entry_module
from classifier_engine.compat.upstream_noise import quiet_upstream_noise
from classifier_engine.errors import ConfigError, check_config_files, debugging, exit_on_user_error, install_extra
from classifier_engine.run.stored_config import check_stored_configs

MORE_SUBCOMMANDS = """
  More subcommands (not LightningCLI's):
    export              A run's checkpoint as torch.export and ONNX files: python -m {prog} export --help
    sweep               Hyperparameter sweeps (Optuna), each trial a fit: python -m {prog} sweep --help
  Every subcommand takes --plan: print what it would do, each decision with its reason, and exit (nothing is built,
  written or downloaded)."""


def main(argv: Optional[list[str]] = None, **defaults) -> None:
    """`defaults` as cli_main takes them (a template's model, data and passes)."""
    quiet_upstream_noise(debugging())
    given, argv = argv, sys.argv[1:] if argv is None else list(argv)
    prog = entry_module(defaults.get("model"))
    entry_classes = [f"{cls.__module__}.{cls.__qualname__}" for cls in (defaults.get("model"), defaults.get("data"))
                     if cls is not None]
    if argv[:1] == ["export"]:
        from classifier_engine.export import main as export_main

        exit_on_user_error(lambda: export_main(argv[1:], prog=f"python -m {prog}", trusted=entry_classes,
                                               model=defaults.get("model"), data=defaults.get("data")))
        return
    if argv[:1] == ["sweep"]:
        exit_on_user_error(lambda: sweep(argv[1:], partial(cli_main, **defaults)))
        return

    def run() -> None:
        check_config_files(argv)
        check_stored_configs(argv, entry_classes)
        cli_main(given, **defaults)

    try:
        exit_on_user_error(run)
    finally:
        if argv in (["-h"], ["--help"]):  # LightningCLI lists its own subcommands only
            print(MORE_SUBCOMMANDS.format(prog=prog), flush=True)
    close_process_group()


def sweep(argv: list[str], with_defaults) -> None:
    """`sweep`: Optuna's, an extra (its absence is one line, not an import's traceback)."""
    try:
        from classifier_engine.run.sweep import main as sweep_main
    except ImportError as missing:
        raise ConfigError(f"sweep needs {missing.name or 'Optuna'}, which is not installed: {install_extra('sweep')}") \
            from None

    sweep_main(argv, with_defaults)


def close_process_group() -> None:
    """Destroy a finished run's process group (torchrun, srun) before the interpreter exits: in its teardown, gloo's
    threads aborted a rank now and then ("terminate called without an active exception", exit -6)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # no rank tears down its sockets while another still talks to it
        dist.destroy_process_group()
