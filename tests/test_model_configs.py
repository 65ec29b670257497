"""Every config under configs/ that sets `model:` keys builds through the CLI and takes a training step, at tiny size.
The recipes (configs/recipe/, configs/quickstart_recipe.yaml) train composed with the quickstart in test_recipes.py.

    python -m pytest tests/test_model_configs.py --durations=0
"""

import inspect
import math
import os
from unittest import mock

import lightning as L
import pytest
import torch
import yaml
from torchvision import models
from torchvision.ops import StochasticDepth

from conftest import CONFIGS, QUICKSTART, SHRINK
from project import ImageClassifier, cli_main
from project.backbones import family_of
from test_recipes import RECIPES

MODEL_CONFIGS = sorted(path for path in CONFIGS.rglob("*.yaml")
                       if "model" in (yaml.safe_load(path.read_text()) or {}) and path not in RECIPES)

# Networks stepped as the smallest of their torchvision family, everything else of the config as it is: the same
# family code for a fraction of the compute (wide_resnet50_2's two steps at 32 px took 26 s of CI's 2 cores, ViT-L's
# 50 s). The configured network is built on meta and counted; tests/test_backbones.py steps each config's own network
# (the ResNets: their forward, on meta but resnet18).
STEPPED_AS = {"resnet": "resnet18", "efficientnet": "efficientnet_b0", "mobilenetv3": "mobilenet_v3_small",
              "vision_transformer": "vit_b_32"}


def arch_of(section: dict) -> str:
    return section.get("arch", inspect.signature(ImageClassifier).parameters["arch"].default)


def stepped_as(arch: str) -> str:
    return STEPPED_AS.get(family_of(arch), arch)


def distinct_model_sections() -> dict[str, dict]:
    """{"a.yaml+b.yaml": model section}: configs whose `model:` parts step the same (the 8-GPU ones; the ResNets that
    only name their arch) are stepped once."""
    groups: dict[str, tuple[list[str], dict]] = {}
    for path in MODEL_CONFIGS:
        section = yaml.safe_load(path.read_text())["model"] or {}
        stepped = {**section, "arch": stepped_as(arch_of(section))}
        names, _ = groups.setdefault(yaml.safe_dump(stepped, sort_keys=True), ([], section))
        names.append(path.relative_to(CONFIGS).as_posix())
    return {"+".join(names): section for names, section in groups.values()}


MODEL_SECTIONS = distinct_model_sections()


def test_model_configs_are_found_and_hold_only_model_keys():
    assert {f"model/{arch}.yaml" for arch in ("resnet18", "resnet50", "wide_resnet50_2", "resnext50_32x4d")} <= {
        path.relative_to(CONFIGS).as_posix() for path in MODEL_CONFIGS
    }
    for path in sorted((CONFIGS / "model").glob("*.yaml")):
        keys = set(yaml.safe_load(path.read_text()))
        assert keys == {"model"}, f"{path} sets {sorted(keys - {'model'})}: a model config holds only `model:` keys"


def needs_224px(section: dict) -> bool:
    """ViT and MaxViT take exactly 224 px (position embeddings, attention windows sized for it); the rest runs at 32."""
    return "backbone" not in section and family_of(arch_of(section)) in ("vision_transformer", "maxvit")


@pytest.mark.parametrize("section", [
    # two ViT-B steps at 224 px: ~15 s on 2 CPU cores
    pytest.param(section, id=name, marks=[pytest.mark.slow] if needs_224px(section) else [])
    for name, section in MODEL_SECTIONS.items()
])
def test_model_config_builds_and_takes_a_training_step(section: dict, tiny_root, tmp_path):
    # The quickstart's trainer and data parts (CPU, 32 px) with only this config's model part on the model's
    # defaults: a config's own trainer part may ask for GPUs, its data part for ImageNet.
    quickstart = yaml.safe_load(QUICKSTART.read_text())
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({**quickstart, "model": section}))
    arch = arch_of(section)
    size = 224 if needs_224px(section) else 32
    args = ["--config", str(config), *SHRINK, "--data.batch_size=2", f"--data.root={tiny_root}",
            f"--trainer.default_root_dir={tmp_path}", f"--data.train_crop_size={size}",
            f"--data.eval_resize_size={size}", f"--data.eval_crop_size={size}",
            "--model.compile=false",  # torch.compile takes minutes on CPU; the network is the same without it
            "--model.optim.warmup_epochs=0",  # a recipe's long warmup would make two steps' updates vanish in rounding
            "--model.finetune.weights=null",  # pretrained files are tested in test_finetune.py, offline
            "--model.finetune.freeze_backbone_epochs=0"]  # a frozen backbone does not move by design (test_finetune.py)
    if "backbone" not in section and stepped_as(arch) != arch:  # (beside a backbone, an arch flag is refused)
        with torch.device("meta"):
            configured = sum(p.numel() for p in getattr(models, arch)(num_classes=3).parameters())
        assert configured > 0, f"{arch} builds"
        arch = stepped_as(arch)
        args.append(f"--model.arch={arch}")
    optim = section.get("optim") or {}
    if needs_224px(section) and optim.get("optimizer", "sgd") == "sgd":
        # SGD at batch 2 moves a deep transformer's LayerNorm weights (1.0) by less than fp32 resolves in two steps
        args.append(f"--model.optim.lr_per_256={max(optim.get('lr_per_256', 0.1), 4.0)}")
    with mock.patch.dict(os.environ):  # the CLI seeds and sets PL_GLOBAL_SEED: keep it out of later tests
        cli = cli_main(args, run=False)
        model = cli.model
        for module in model.modules():  # stochastic depth may drop a whole block in both steps: no gradient reaches it
            if isinstance(module, StochasticDepth):
                module.p = 0.0
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        # Two steps: ViT zero-initialises its head, so in the first only the head gets a gradient.
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=2, limit_val_batches=0,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.fit(model, datamodule=cli.datamodule)

    assert math.isfinite(float(trainer.callback_metrics["train/loss"]))
    if "backbone" not in section:  # the configured torchvision network was built, not the model's default one
        # meta: shapes only, no memory, no initialisation; RegNet computes its widths with tensor ops meta cannot run
        with torch.device("cpu" if family_of(arch) == "regnet" else "meta"):
            expected = sum(p.numel() for p in getattr(models, arch)(num_classes=3).parameters())
        assert sum(p.numel() for p in model.network.parameters()) == expected, f"expected a {arch}"
    with torch.no_grad():
        assert model.eval()(torch.zeros(2, 3, size, size)).shape == (2, 3)  # num_classes linked from the 3-class data
    changed = [name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])]
    assert len(changed) == len(before), f"parameters not updated by the step: {sorted(set(before) - set(changed))[:5]}"


def test_an_unknown_model_key_is_one_line_naming_it(tiny_root, tmp_path, monkeypatch, capsys):
    import sys

    from project import main

    run_dir = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["python -m project", "fit", "--config", str(QUICKSTART), *SHRINK,
                                      f"--data.root={tiny_root}", f"--trainer.default_root_dir={run_dir}",
                                      "--model.lr_per_256=0.2"])
    with pytest.raises(SystemExit) as exited:
        main()
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1 and "model.lr_per_256" in err[-1], err
    assert not run_dir.exists()
    assert "Traceback" not in "\n".join(err) and not run_dir.exists()
