"""Count the host-device synchronisation points of each training step and validation batch, and who caused them (our
code or Lightning's).

    --trainer.callbacks+='{"class_path": "sync_counter.CountHostSyncs", "init_args": {"output": "/tmp/syncs"}}'

On a CPU nothing really waits, so what is counted are the calls that would synchronise a GPU with the host: reading a
tensor on the host (.item(), .tolist(), bool/int/float(tensor), .numpy()), ops whose output size depends on the values
(torch.unique, nonzero: the host reads the size), torch.cuda.synchronize, and the blocking collectives
(torch.distributed.all_reduce, broadcast, barrier, all_gather, and Lightning's strategy.reduce, broadcast, barrier,
all_gather, reduce_boolean_decision, which call them). A call is *ours* when, walking the stack from the call outwards,
a frame of the library (or of a package named in `packages`: a template's, `["project"]`) comes before any frame of
Lightning's loops or Trainer: our callback calling strategy.reduce is ours; Lightning's progress bar reading a tensor is
Lightning's.
"""

import importlib.util
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

import classifier_engine

LIBRARY = str(Path(classifier_engine.__file__).resolve().parent) + os.sep
LIGHTNING = str(Path(L.__file__).resolve().parent / "pytorch")
LIGHTNING_DRIVERS = tuple(os.path.join(LIGHTNING, part) + os.sep for part in ("loops", "trainer"))

TENSOR_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "numpy")
SIZED_BY_VALUES = ("unique", "nonzero")  # torch.X and Tensor.X
COLLECTIVES = ("all_reduce", "broadcast", "barrier", "all_gather", "broadcast_object_list")
STRATEGY_CALLS = ("reduce", "broadcast", "barrier", "all_gather", "reduce_boolean_decision")


TORCH_ROOT = str(Path(torch.__file__).resolve().parent) + os.sep
TORCH_DATA = str(Path(torch.__file__).resolve().parent / "utils" / "data") + os.sep


def package_folder(name: str) -> str:
    """The folder of an importable package, as frames name their files."""
    return str(Path(importlib.util.find_spec(name).origin).resolve().parent) + os.sep


def origin(ours: tuple[str, ...]) -> str:
    """'ours' or 'lightning' for the current call (see the module docstring), `ours` the folders whose frames are ours;
    'input' inside DataLoader fetching, which reads CPU tensors of the input pipeline (in workers, or in the main
    process before the copy to the GPU)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(TORCH_DATA):
            return "input"
        frame = frame.f_back
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(ours):
            return "ours"
        if filename.startswith(LIGHTNING_DRIVERS):
            return "lightning"
        frame = frame.f_back
    return "lightning"


class CountHostSyncs(L.Callback):
    """Patches the synchronising calls while fit runs; writes {key: {"ours": n, "lightning": n, "what": [...]}}, keyed
    by training step ("3": from its start to the next one's), validation batch ("val1", "sanity0": from its start to its
    end, summed over the validation runs) and "after_val" (from a validation batch's end on: the epoch's reductions)."""

    def __init__(self, output: str = "", packages: list[str] | None = None):
        self.output = output
        self.ours = (LIBRARY, *(package_folder(name) for name in packages or []))
        self.step: int | str | None = None
        self.counts: dict = defaultdict(lambda: {"ours": 0, "lightning": 0, "input": 0, "what": []})
        self._saved: list[tuple[object, str, object]] = []
        self._inside = False

    def _wrap(self, owner, name: str) -> None:
        original = getattr(owner, name)
        counter = self

        def counted(*args, **kwargs):
            if not counter._inside and counter.step is not None:
                counter._inside = True  # a collective's own tensor reads belong to the collective
                try:
                    who = origin(counter.ours)
                    entry = counter.counts[counter.step]
                    entry[who] += 1
                    if who != "input":
                        caller = sys._getframe(1)
                        while caller.f_code.co_filename.startswith(TORCH_ROOT):
                            caller = caller.f_back
                        entry["what"].append(f"{who}:{name}@{Path(caller.f_code.co_filename).name}:{caller.f_code.co_name}")
                    return original(*args, **kwargs)
                finally:
                    counter._inside = False
            return original(*args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, counted)

    def setup(self, trainer, pl_module, stage):
        if stage != "fit":
            return
        for name in TENSOR_READS:
            self._wrap(torch.Tensor, name)
        for name in SIZED_BY_VALUES:
            self._wrap(torch.Tensor, name)
            self._wrap(torch, name)
        for name in COLLECTIVES:
            self._wrap(dist, name)
        self._wrap(torch.cuda, "synchronize")
        for name in STRATEGY_CALLS:
            self._wrap(type(trainer.strategy), name)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step = trainer.global_step

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.step = f"{'sanity' if trainer.sanity_checking else 'val'}{batch_idx}"
        self.counts[self.step]  # noqa: B018  listed even when nothing is counted

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.step = "after_val"

    def teardown(self, trainer, pl_module, stage):
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
        if self.output:
            path = Path(f"{self.output}.rank{trainer.global_rank}.json")
            path.write_text(json.dumps({str(k): v for k, v in self.counts.items()}))
