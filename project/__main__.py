"""python -m project {fit,validate,test,predict,export,sweep} --config configs/quickstart.yaml

`export` is classifier_engine.export (a run's checkpoint as torch.export / ONNX files), `sweep` classifier_engine.run.sweep
(Optuna trials, each an ordinary fit); the others are LightningCLI's.
"""

import sys

from classifier_engine.cli import cli_main, main
from classifier_engine.errors import exit_on_user_error

MORE_SUBCOMMANDS = """
  More subcommands (not LightningCLI's):
    export              A run's checkpoint as torch.export and ONNX files: python -m project export --help
    sweep               Hyperparameter sweeps (Optuna), each trial a fit: python -m project sweep --help"""

if __name__ == "__main__":
    if sys.argv[1:2] == ["export"]:
        from classifier_engine.export import main as export_main

        exit_on_user_error(lambda: export_main(sys.argv[2:]))
    elif sys.argv[1:2] == ["sweep"]:
        from classifier_engine.run.sweep import main as sweep_main

        exit_on_user_error(lambda: sweep_main(sys.argv[2:], cli_main))
    elif sys.argv[1:] in (["-h"], ["--help"]):  # LightningCLI lists its own subcommands only
        try:
            main()
        finally:
            print(MORE_SUBCOMMANDS, flush=True)
    else:
        main()
