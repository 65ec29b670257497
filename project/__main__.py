"""python -m project {fit,validate,test,predict,export,sweep} --config configs/quickstart.yaml

The template's default model and data (project/__init__.py), handed to the engine's CLI (LightningCLI, export, sweep).
"""

from project import main

if __name__ == "__main__":
    main()
