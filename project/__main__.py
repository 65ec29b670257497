"""python -m project {fit,validate,test,predict,export} --config configs/quickstart.yaml

`export` is project.export (a run's checkpoint as torch.export / ONNX files); the others are LightningCLI's.
"""

import sys

from project.cli import main

if __name__ == "__main__":
    if sys.argv[1:2] == ["export"]:
        from project.errors import report_and_exit
        from project.export import main as export_main

        try:
            export_main(sys.argv[2:])
        except SystemExit:
            raise
        except BaseException as error:  # noqa: BLE001
            report_and_exit(error)
    else:
        main()
