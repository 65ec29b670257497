"""A sharded checkpoint (strategy fsdp2_sharded: a .ckpt file and the folder of tensors it names) read whole in one
process, weights-only: its DCP metadata through an allow-list, its non-tensor items with torch.load(weights_only=True).

    python -m classifier_engine export --ckpt_path RUN/checkpoints/last.ckpt      # a sharded one too
"""

import itertools
import pickle
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

from classifier_engine.errors import CheckpointError, untrusted_checkpoint_message
from classifier_engine.run.run_dirs import SHARDS


class MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata holds its dataclasses, torch sizes and dtypes, and plain values; no other global loads."""

    ALLOWED = {("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")} | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
        ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED or module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Weights only load failed: Unsupported global: {module}:{name}, not DCP metadata")


class WeightsOnlyLoadPlanner(_EmptyStateDictLoadPlanner):
    """DCP's planner for reading a whole checkpoint in one process, its non-tensor items read weights-only."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                    torch.load(value, weights_only=True))


def read_sharded(path: Path, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The one-file checkpoint a sharded one stands for, read in one process (no process group): its state_dict and
    optimizer_states (keyed by position, as torch.optim keys them) from the folder it names, beside it."""
    folder = path.parent / Path(str(checkpoint.pop(SHARDS))).name
    tensors: dict[str, Any] = {}
    try:
        if not folder.name.endswith(".shards"):  # a crafted name ("..", ""): nothing outside
            raise ValueError(f"{folder.name!r} is not a shard folder's name")
        metadata = read_metadata(folder)
        reader, planner = dcp.FileSystemReader(folder), WeightsOnlyLoadPlanner()
        planner.set_up_planner(tensors, metadata, True)
        reader.set_up_storage_reader(metadata, True)
        (plan,) = reader.prepare_global_plan(planner.create_global_plan([planner.create_local_plan()]))
        reader.read_data(planner.finish_plan(plan), planner).wait()
    except Exception as error:  # pickled code, or a folder missing, damaged or crafted otherwise: one line each
        reason = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
        raise CheckpointError(untrusted_checkpoint_message(error, folder) or f"{path} is not a complete checkpoint: "
                              f"its shards {folder.name} do not load ({reason})") from error
    checkpoint["state_dict"] = tensors.pop("state_dict")
    if tensors:  # not a weights-only save
        checkpoint["optimizer_states"] = [by_position(tensors[f"optimizer_{i}"]) for i in range(len(tensors))]
    return checkpoint


def read_metadata(folder: Path) -> Any:
    """A shard folder's DCP metadata, through the allow-list; ValueError when it names files outside the folder."""
    with open(folder / ".metadata", "rb") as file:
        metadata = MetadataUnpickler(file).load()
    if any(Path(info.relative_path).name != info.relative_path for info in metadata.storage_data.values()):
        raise ValueError("its .metadata names files outside its folder")
    return metadata


def missing_shards(folder: Path) -> list[str]:
    """Files a shard folder lacks: its .metadata, else the shards it names (none if that is damaged: load says why)."""
    try:
        metadata = read_metadata(folder)
    except FileNotFoundError:
        return [".metadata"]
    except Exception:  # noqa: BLE001  damaged or crafted: read_sharded refuses it in one line
        return []
    return sorted({info.relative_path for info in metadata.storage_data.values()} - {p.name for p in folder.iterdir()})


def by_position(state: dict[str, Any], keys: Optional[list] = None) -> dict[str, Any]:
    """An optimizer state relabelled by position in its parameter groups, as torch.optim matches one to its parameters:
    to 0, 1, ... (as torch.optim keys it), or to `keys` (parameter names)."""
    groups = state.get("param_groups", [])
    new = dict(zip((key for group in groups for key in group["params"]), keys or itertools.count()))
    return {"state": {new[key]: value for key, value in state.get("state", {}).items()},
            "param_groups": [{**group, "params": [new[key] for key in group["params"]]} for group in groups]}
