"""python -m project {fit,validate,test,predict,export,sweep} --config configs/quickstart.yaml

The default model and data of this template, handed to the engine's CLI (LightningCLI, plus export and sweep).
"""

from classifier_engine import main

from project.data import ImageNetDataModule
from project.model import ImageClassifier, backbone_replaces_arch
from project.weights import apply_weights_eval_sizes

if __name__ == "__main__":
    main(model=ImageClassifier, data=ImageNetDataModule, config_hooks=[apply_weights_eval_sizes],
         tidy_hooks=[backbone_replaces_arch])
