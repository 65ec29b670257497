"""python -m project {fit,validate,test,predict,export} --config configs/quickstart.yaml

`export` is project.export (a run's checkpoint as torch.export / ONNX files); the others are LightningCLI's.
"""

import sys

from project.cli import main

if __name__ == "__main__":
    if sys.argv[1:2] == ["export"]:
        from project.errors import exit_on_user_error
        from project.export import main as export_main

        exit_on_user_error(lambda: export_main(sys.argv[2:]))
    else:
        main()
