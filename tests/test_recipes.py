"""Every recipe (configs/recipe/*.yaml, configs/quickstart_recipe.yaml) composes after configs/quickstart.yaml and
trains one shrunk CPU epoch with all its ingredients on.

    python -m pytest tests/test_recipes.py --durations=0
"""

import math

import pytest
import torch
import yaml
from torchvision import models

from conftest import CONFIGS, QUICKSTART, SHRINK
from project import cli_main
from project.weights import hub_file
from test_weights import hub, imagenet_resnet18  # noqa: F401  (the offline torch hub fixture)

RECIPES = sorted((CONFIGS / "recipe").glob("*.yaml")) + [CONFIGS / "quickstart_recipe.yaml"]


def test_the_recipes_are_found():
    assert {p.name for p in RECIPES} >= {"torchvision_v2.yaml", "fast.yaml", "finetune.yaml", "quickstart_recipe.yaml"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.relative_to(CONFIGS).as_posix())
@pytest.mark.usefixtures("hub")
def test_recipe_composes_with_the_quickstart_and_trains_one_shrunk_epoch(recipe, tiny_root, tmp_path):
    path = hub_file(models.ResNet18_Weights.IMAGENET1K_V1)  # finetune.yaml starts from resnet18's DEFAULT weights
    path.parent.mkdir(parents=True)
    torch.save(imagenet_resnet18(), path)
    # The recipe after the quickstart, then the shrink flags: its trainer length and batch size give way to them.
    args = ["fit", "--config", str(QUICKSTART), "--config", str(recipe), *SHRINK, f"--data.root={tiny_root}",
            f"--trainer.default_root_dir={tmp_path}", "--trainer.limit_train_batches=2",
            "--trainer.limit_val_batches=1"]
    cli = cli_main(args)
    # Every ingredient the file names arrived (the shrink flags only set the batch size and the length).
    settings = yaml.safe_load(recipe.read_text())
    for key, value in settings.get("model", {}).items():
        if isinstance(value, dict):  # a group (optim, loss, finetune): each field the file sets
            for field, field_value in value.items():
                assert cli.model.hparams[key][field] == field_value, f"{key}.{field}"
        else:
            assert cli.model.hparams[key] == value, key
    for key, value in settings.get("data", {}).items():
        if key != "batch_size":
            assert cli.datamodule.hparams[key] == value, key
    for wanted in settings.get("trainer", {}).get("callbacks", []):  # the EMA, with the file's settings
        (found,) = [c for c in cli.trainer.callbacks
                    if f"{type(c).__module__}.{type(c).__name__}" == wanted["class_path"]]
        assert all(getattr(found, name) == value for name, value in wanted.get("init_args", {}).items()), wanted
    assert cli.trainer.global_step == 2
    assert math.isfinite(float(cli.trainer.callback_metrics["train/loss"]))
    assert 0.0 <= float(cli.trainer.callback_metrics["val/acc1"]) <= 1.0
