"""The room's strategy and precision configs (configs/*.yaml): each found, parsed onto the quickstart setting only what
it switches, the GPU ones with cuDNN autotuning, the mixed-precision ones building a trainer on CPU.

    python -m pytest tests/test_strategy_configs.py
"""

import io
from contextlib import redirect_stdout

import pytest
import yaml

from conftest import CONFIGS, cli_main, tiny_args

# Every config composed onto the quickstart, except the quickstart's own and the folders of model and recipe configs.
STRATEGY_CONFIGS = sorted(p.name for p in CONFIGS.glob("*.yaml") if not p.name.startswith("quickstart"))


def leaves(tree: dict, prefix: tuple = ()) -> dict[tuple, object]:
    """{("trainer", "devices"): 8, ...}: every value of a nested config by its path (a class's init_args as its
    own keys, as a config file may write them)."""
    out = {}
    for key, value in tree.items():
        path = prefix if key == "init_args" else (*prefix, key)
        out.update(leaves(value, path) if isinstance(value, dict) else {path: value})
    return out


def printed_config(*args: str) -> dict:
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", *args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(out.getvalue())


def test_the_strategy_and_precision_configs_are_found():
    assert {"ddp_8gpu.yaml", "dp_8gpu.yaml", "ddp_spawn_8gpu.yaml", "gpu.yaml", "fp16.yaml", "bf16.yaml",
            "cpu_ddp.yaml", "multinode.yaml"} <= set(STRATEGY_CONFIGS)


@pytest.mark.parametrize("name", STRATEGY_CONFIGS)
def test_strategy_config_parses_and_sets_only_what_it_switches(name, tiny_root, tmp_path):
    base = leaves(printed_config(*tiny_args(tiny_root, tmp_path)))
    composed = leaves(printed_config(*tiny_args(tiny_root, tmp_path), "--config", str(CONFIGS / name)))
    wanted = leaves(yaml.safe_load((CONFIGS / name).read_text()))
    assert {key: composed[key] for key in wanted} == wanted  # everything it sets arrives
    moved = {key for key in composed if composed[key] != base.get(key)}
    assert moved <= wanted.keys(), f"{name} changes {sorted(moved - wanted.keys())} without saying so"


GPU_CONFIGS = [name for name in STRATEGY_CONFIGS
               if (yaml.safe_load((CONFIGS / name).read_text()).get("trainer") or {}).get("accelerator") == "gpu"]


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_gpu_configs_turn_cudnn_autotuning_on(name, tiny_root, tmp_path):
    # Lightning leaves benchmark=None, torch's default (off): cuDNN's heuristic picks, never timed, for every shape.
    assert {"gpu.yaml", "ddp_8gpu.yaml", "dp_8gpu.yaml", "vit_l16_fsdp_8gpu.yaml"} <= set(GPU_CONFIGS)
    assert printed_config(*tiny_args(tiny_root, tmp_path), "--config", str(CONFIGS / name))["trainer"]["benchmark"]


@pytest.mark.parametrize("name, expected", [("fp16.yaml", "bf16-mixed"), ("bf16.yaml", "bf16-mixed")])
def test_mixed_precision_configs_build_a_trainer_on_cpu(name, expected, tiny_root, tmp_path):
    # 16-mixed on CPU is turned into (emulated, slow) bf16 by Lightning: built here, never trained on CPU.
    cli = cli_main([*tiny_args(tiny_root, tmp_path), "--config", str(CONFIGS / name)], run=False)
    assert cli.trainer.precision == expected
