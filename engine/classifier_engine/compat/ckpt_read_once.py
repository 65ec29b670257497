"""`--ckpt_path` hyperparameters from the run plan's one load of the checkpoint, values only (docs/how-it-works.md).

    python -m classifier_engine validate --config CONFIG --ckpt_path <run>/checkpoints/last.ckpt
"""

import dataclasses
import pydoc
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Optional, Union

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_info

CODE_KEYS = {"class_path", "_class_path", "init_args", "dict_kwargs", "_instantiator"}  # what jsonargparse builds from
CONTAINERS = (list, tuple, dict, Union, types.UnionType)


def names_code(value: Any) -> bool:
    """A mapping with class_path / init_args / _instantiator keys at any depth."""
    if isinstance(value, Mapping):
        return bool(CODE_KEYS & set(value)) or any(names_code(item) for item in value.values())
    return isinstance(value, (list, tuple)) and any(names_code(item) for item in value)


def holds_values(annotation: Any) -> bool:
    """Whether jsonargparse parses this annotation into plain values, never importing what a string names."""
    if annotation is type(None) or isinstance(annotation, type) and issubclass(annotation, (int, float, str)):
        return True  # bool is an int; classifier_engine.options' number types subclass int and float
    if dataclasses.is_dataclass(annotation):
        hints = typing.get_type_hints(annotation)
        return all(holds_values(hints[field.name]) for field in dataclasses.fields(annotation))
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return True
    return origin in CONTAINERS and all(holds_values(arg) for arg in typing.get_args(annotation) if arg is not ...)


def checkpoint_values(model_class: type, hparams: Mapping[str, Any], linked: Sequence[str] = ()) -> tuple[
        dict[str, Any], list[str]]:
    """The hyperparameters the model class may take (none that names code, or whose type could), the others' names."""
    try:
        hints = typing.get_type_hints(model_class.__init__)
    except Exception:  # an annotation that does not resolve: take nothing, the config stands
        hints = {}
    # LightningCLI saves every instantiation link's value, also one jsonargparse skipped as the class lacks it: not the
    # user's, never refused (classifier_engine.compat: "applied instantiation links").
    hparams = {key: value for key, value in hparams.items() if key not in linked or key in hints}
    # A key the class lacks goes on to the parse, which refuses it in one line.
    taken = {key: value for key, value in hparams.items()
             if (key not in hints or holds_values(hints[key])) and not names_code(value) and key not in CODE_KEYS}
    return taken, [key for key in hparams if key not in taken and key not in ("_class_path", "_instantiator")]


class CheckpointReadOnceCLI(LightningCLI):
    linked_model_arguments: tuple[str, ...] = ()  # what the CLI's links may set in a model's init arguments
    def loaded_checkpoint(self) -> Optional[dict[str, Any]]:
        """The checkpoint `--ckpt_path` names, as already loaded; None: there is none."""
        return None

    def _parse_ckpt_path(self) -> None:
        # lightning 2.6.6 LightningCLI._parse_ckpt_path, minus its torch.load, its `_class_path` and code-naming values
        subcommand = self.config.get("subcommand")
        checkpoint = self.loaded_checkpoint() if subcommand else None
        if checkpoint is None:
            return
        model = self.config[subcommand].model
        class_path = model.get("class_path") if self.subclass_mode_model else None
        model_class = pydoc.locate(class_path) if class_path else self._model_class  # never the checkpoint's
        hparams, dropped = checkpoint_values(model_class, checkpoint.get("hyper_parameters") or {},
                                             self.linked_model_arguments)
        if dropped:
            rank_zero_info(f"checkpoint hyperparameters not used (checkpoints carry values, the config names classes): "
                           f"{', '.join(f'model.{key}' for key in dropped)}")
        if not hparams:
            return
        if class_path:
            hparams = {"class_path": class_path, "init_args": hparams}
        try:
            self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)
        except SystemExit:
            sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
            raise
