"""python -m project {fit,validate,test,predict,export,sweep} --config configs/quickstart.yaml

`export` is project.engine.export (a run's checkpoint as torch.export / ONNX files), `sweep` project.engine.run.sweep (Optuna
trials, each an ordinary fit); the others are LightningCLI's.
"""

import sys

from project.engine.cli import cli_main, main

if __name__ == "__main__":
    if sys.argv[1:2] == ["export"]:
        from project.engine.errors import exit_on_user_error
        from project.engine.export import main as export_main

        exit_on_user_error(lambda: export_main(sys.argv[2:]))
    elif sys.argv[1:2] == ["sweep"]:  # project.engine.run.sweep: Optuna trials, each an ordinary fit
        from project.engine.errors import exit_on_user_error
        from project.engine.run.sweep import main as sweep_main

        exit_on_user_error(lambda: sweep_main(sys.argv[2:], cli_main))
    else:
        main()
