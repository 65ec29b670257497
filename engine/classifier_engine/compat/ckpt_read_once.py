"""`--ckpt_path` hyperparameters taken from the run plan's one load of the checkpoint (LightningCLI's own parse of them
loads the file again and takes `_class_path`: the CLI turns it off), values only (docs/how-it-works.md).

    python -m classifier_engine validate --config CONFIG --ckpt_path <run>/checkpoints/last.ckpt
"""

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union

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
