"""LightningCLI reads `--ckpt_path`'s hyperparameters with a torch.load of its own; here they come from the run
plan's load (project.engine.run.resume), so a start reads its checkpoint once.

    python -m project validate --config configs/quickstart.yaml --ckpt_path <run>/checkpoints/last.ckpt

LightningCLI.__init__ calls its private `_parse_ckpt_path` right after `parse_arguments`: it loads the whole file
(`torch.load(weights_only=True)`, not memory-mapped) to re-parse `hyper_parameters` over the model's config (what
project.engine.compat.ckpt_hparams then corrects). This class overrides that one method with the same parse, fed the
dictionary `loaded_checkpoint()` returns. Written against lightning 2.6.6; if an upgrade renames the method, the
override is dead and the file is read again: tests/test_cli.py counts the opens of the checkpoint.
"""

import sys
from typing import Any, Optional

from lightning.pytorch.cli import LightningCLI


class CheckpointReadOnceCLI(LightningCLI):
    def loaded_checkpoint(self) -> Optional[dict[str, Any]]:
        """The checkpoint `--ckpt_path` names, as already loaded; None: there is none."""
        return None

    def _parse_ckpt_path(self) -> None:
        # lightning 2.6.6 LightningCLI._parse_ckpt_path, minus its torch.load
        subcommand = self.config.get("subcommand")
        checkpoint = self.loaded_checkpoint() if subcommand else None
        if checkpoint is None:
            return
        hparams = dict(checkpoint.get("hyper_parameters") or {})  # a copy: the checkpoint goes on to be restored
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        try:
            self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)
        except SystemExit:
            sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
            raise
