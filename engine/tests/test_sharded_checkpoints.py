"""Sharded checkpoints as strategy fsdp2_sharded writes them, read by the library's loader: crafted shards refused in
one line without running them, a save killed before its file, optimizer states matched to parameters by position.

    python -m pytest engine/tests/test_sharded_checkpoints.py
"""

import dataclasses
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from classifier_engine.errors import CheckpointError
from classifier_engine.run.checkpoint_io import load_checkpoint
from classifier_engine.run.run_dirs import SHARDS
from classifier_engine.run.sharded_checkpoints import by_position
from classifier_engine.strategies import FSDPStrategy


class RunsCode:
    """What a crafted checkpoint pickles: unpickling it runs `call(argument)` (os.system, builtins.exec)."""

    def __init__(self, call, argument: str):
        self.call, self.argument = call, argument

    def __reduce__(self):
        return self.call, (self.argument,)


def sharded_checkpoint(directory: Path, lr: object = 0.1, name: str = "last.ckpt", stamp: int = 1) -> Path:
    """A small sharded checkpoint as strategy fsdp2 writes one: <directory>/<name>, and the folder it names beside it
    with the tensors and the optimizer's values (DCP torch.saves each non-tensor item, here the LR)."""
    folder = directory / f".{name}.{stamp}.shards"
    tensors = {"state_dict": {"network.0.weight": torch.ones(2, 2)},  # an ImageClassifier's network: Linear(2, 2)
               "optimizer_0": {"state": {"network.0.weight": {"momentum_buffer": torch.zeros(2, 2)}},
                               "param_groups": [{"lr": lr, "params": ["network.0.weight"]}]}}
    with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming ... a single process": it is
        warnings.simplefilter("ignore")
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    torch.save({"epoch": 0, "global_step": stamp, SHARDS: folder.name}, directory / name)
    return directory / name


@pytest.mark.parametrize("crafted", ["metadata calls os.system", "metadata calls builtins.exec", "bytes item",
                                     "metadata cut short", "metadata not DCP's", "folder outside", "file outside"])
def test_crafted_shards_are_refused_in_one_line_and_run_nothing(crafted, tmp_path):
    path, ran = sharded_checkpoint(tmp_path), tmp_path / "ran"
    loaded = load_checkpoint(path)  # one process, no process group: the one-file checkpoint it stands for
    assert loaded["state_dict"]["network.0.weight"].tolist() == [[1, 1], [1, 1]] and loaded["global_step"] == 1
    (optimizer,) = loaded["optimizer_states"]  # keyed by position, as torch.optim keys it
    assert optimizer["param_groups"] == [{"lr": 0.1, "params": [0]}]
    assert optimizer["state"][0]["momentum_buffer"].shape == (2, 2)
    metadata, expected = tmp_path / ".last.ckpt.1.shards" / ".metadata", "is not a trusted checkpoint: it holds pickled"
    if crafted == "bytes item":  # read by DCP's own planner with torch.load(weights_only=False)
        path = sharded_checkpoint(tmp_path, lr=RunsCode(os.system, f"touch {ran}"), stamp=2)
    elif crafted.startswith("metadata cut") or crafted.startswith("metadata not"):  # damaged: not code, one line too
        metadata.write_bytes(metadata.read_bytes()[:100] if "cut" in crafted else pickle.dumps([1, {"a": 2}]))
        expected = r"last.ckpt is not a complete checkpoint: its shards .last.ckpt.1.shards do not load \("
    elif crafted == "folder outside":  # the file names the folder above it
        torch.save({"epoch": 0, "global_step": 1, SHARDS: ".."}, path)
        expected = r"do not load \('\.\.' is not a shard folder's name\)"
    elif crafted == "file outside":  # .metadata points DCP's reader at a file beside the folder (it would load it)
        shards = pickle.loads(metadata.read_bytes())
        for name, info in shards.storage_data.items():
            shutil.copyfile(metadata.parent / info.relative_path, tmp_path / "elsewhere.distcp")
            shards.storage_data[name] = dataclasses.replace(info, relative_path="../elsewhere.distcp")
        metadata.write_bytes(pickle.dumps(shards))
        expected = r"do not load \(its \.metadata names files outside its folder\)"
    else:  # read by DCP's own reader with pickle.load
        payload = RunsCode(os.system, f"touch {ran}") if "system" in crafted else RunsCode(exec, f"open('{ran}', 'w')")
        pickle.loads(pickle.dumps(payload))  # it is live: a plain unpickling runs it
        assert ran.exists()
        ran.unlink()
        metadata.write_bytes(pickle.dumps(payload))
    with pytest.raises(CheckpointError, match=expected) as refused:
        load_checkpoint(path)
    assert "\n" not in str(refused.value)
    assert not ran.exists()


def test_a_sharded_save_killed_before_its_file_leaves_the_previous_checkpoint_and_removal_takes_its_folder(tmp_path):
    path = sharded_checkpoint(tmp_path)
    killed = tmp_path / ".last.ckpt.2.shards"  # a later save's shards, killed before rank 0 replaced last.ckpt
    killed.mkdir()
    (killed / "__0_0.distcp").write_bytes(b"half")
    assert load_checkpoint(path)["global_step"] == 1
    other = sharded_checkpoint(tmp_path, name="epoch=0-step=1.ckpt")
    FSDPStrategy(sharded=True).remove_checkpoint(path)  # as ModelCheckpoint drops one from its top k
    assert sorted(p.name for p in tmp_path.iterdir()) == [".epoch=0-step=1.ckpt.1.shards", other.name]


def test_optimizer_states_are_matched_to_parameters_by_position_in_their_groups_as_torch_optim_does():
    # Two groups (decay_norm_and_bias=false) of Sequential(Linear(4, 3), BatchNorm1d(3), Linear(3, 2)): the matrices,
    # then the vectors. Lightning's one-file fsdp checkpoint numbers them in model order, torch.optim (ddp) in group
    # order; FSDP's rekey_optim_state_dict reads both in model order, which gives ddp's 2.weight momentum to 0.bias.
    shapes = {"0.weight": (3, 4), "2.weight": (2, 3), "0.bias": (3,), "1.weight": (3,), "1.bias": (3,), "2.bias": (2,)}
    names = list(shapes)  # the optimizer's order
    for groups in ([[0, 4], [1, 2, 3, 5]], [[0, 1], [2, 3, 4, 5]]):  # fsdp one-file, ddp
        ids = [i for group in groups for i in group]
        state = {"state": {i: {"momentum_buffer": torch.zeros(shapes[name])} for i, name in zip(ids, names)},
                 "param_groups": [{"lr": 0.1, "params": group} for group in groups]}
        by_name = by_position(state, names)
        assert {name: tuple(s["momentum_buffer"].shape) for name, s in by_name["state"].items()} == shapes
        assert [g["params"] for g in by_name["param_groups"]] == [names[:2], names[2:]]
        assert [g["params"] for g in by_position(by_name)["param_groups"]] == [[0, 1], [2, 3, 4, 5]]  # torch.optim's
