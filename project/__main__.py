"""python -m project {fit,validate,test,predict} --config configs/quickstart.yaml"""

from project.cli import main

if __name__ == "__main__":
    main()
