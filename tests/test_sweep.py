"""The room's sweep files (configs/sweep/*.yaml) are valid sweeps of its model and data: `--plan` checks every setting,
every space entry and every choice against the fit's own parser, and names the study, its storage and its space.
How sweeps run (workers, pruning, retries, the journal) is the library's to test: engine/tests/test_sweep.py.

    python -m pytest tests/test_sweep.py
"""

import pytest
import yaml

from conftest import CONFIGS, REPO, project_in_process

SWEEP_FILES = sorted(CONFIGS.glob("sweep/*.yaml"))


def test_the_readmes_sweep_files_are_here():
    assert {"quickstart.yaml", "finetune.yaml"} <= {path.name for path in SWEEP_FILES}


@pytest.mark.parametrize("sweep", SWEEP_FILES, ids=lambda path: path.stem)
def test_a_sweep_files_plan_names_its_space_study_and_storage_and_writes_nothing(sweep, tmp_path, monkeypatch,
                                                                                   capsys):
    monkeypatch.chdir(REPO)  # as the README runs it: the `configs:` a sweep file builds on are paths from here
    root = tmp_path / "runs"
    code, out, err = project_in_process(["sweep", "--plan", "--config", str(sweep.relative_to(REPO)),
                                         f"--trainer.default_root_dir={root}"], monkeypatch, capsys)
    assert code == 0, err[-3000:]
    lines = [line.strip() for line in out.strip().splitlines()]
    assert lines[0] == "plan of sweep (dry: no study opened, no trial run, nothing written):", lines
    study = root / "sweeps" / sweep.stem
    assert f"study: {sweep.stem} in {study} (sweep.study, else the sweep file's name)" in lines
    assert any(line.startswith(f"storage: {study / 'journal.log'} ") for line in lines), lines
    space = next(line for line in lines if line.startswith("space: "))
    for name in yaml.safe_load(sweep.read_text())["sweep"]["space"]:
        assert f" {name} {{" in f" {space.removeprefix('space: ')}", (name, space)
    assert not root.exists()
