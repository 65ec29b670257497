"""Value types of the options: a bad value is refused in one line naming the option (docs/how-it-works.md); and which
subcommand uses an option: given to another, it is refused.

    python -m classifier_engine fit --config CONFIG --data.batch_size=-1
"""

import contextlib
import dataclasses
import inspect
import math
import numbers
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, Union

from jsonargparse.typing import register_type

from classifier_engine.errors import ConfigError


def number_type(name: str, base: type, expected: str, fits: Callable[[Any], bool]) -> type:
    """A number type for annotations: its `check` parses and checks one value and returns a plain `base`."""

    def check(given: Any) -> Any:
        value = given
        if isinstance(given, str):  # a command-line value reaches a registered type unparsed
            with contextlib.suppress(ValueError):
                value = float(given) if base is float else int(given)
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        whole = number and (base is float or float(value).is_integer())
        if not (number and whole and fits(value)):
            raise ValueError(f"expected {expected}, got {given if isinstance(given, str) else repr(given)}")
        return base(value)

    number = type(name, (base,), {"__doc__": f"{expected[0].upper()}{expected[1:]}.", "__module__": __name__,
                                  "expected": expected, "check": staticmethod(check)})
    # A plain int/float is never "of" this type, so jsonargparse always runs check (config files included).
    register_type(number, serializer=base, deserializer=check)
    return number


def _finite(fits: Callable[[float], bool]) -> Callable[[float], bool]:
    return lambda v: math.isfinite(v) and fits(v)  # nan passes no comparison; inf would pass `> 0`


PositiveInt = number_type("PositiveInt", int, "an int >= 1", lambda v: v >= 1)
NonNegativeInt = number_type("NonNegativeInt", int, "an int >= 0", lambda v: v >= 0)
PositiveFloat = number_type("PositiveFloat", float, "a float > 0", _finite(lambda v: v > 0))
NonNegativeFloat = number_type("NonNegativeFloat", float, "a float >= 0", _finite(lambda v: v >= 0))
UnitInterval = number_type("UnitInterval", float, "a float in [0, 1]", lambda v: 0 <= v <= 1)
# Momentum, Adam's betas, label smoothing: 1 would be a value that never decays, or targets that carry no label.
BelowOne = number_type("BelowOne", float, "a float in [0, 1)", lambda v: 0 <= v < 1)
# A factor that shrinks (the step schedule's gamma): 0 would stop training at the first milestone.
ShrinkFactor = number_type("ShrinkFactor", float, "a float in (0, 1]", lambda v: 0 < v <= 1)
Probability = number_type("Probability", float, "a probability in [0, 1]", lambda v: 0 <= v <= 1)
# RandomResizedCrop's area fraction: a crop of no area, or of more than the image, is never drawn (torchvision
# falls back to the whole image, silently).
AreaFraction = number_type("AreaFraction", float, "an area fraction in (0, 1]", lambda v: 0 < v <= 1)


def _plain(annotation: Any, value: Any) -> Any:
    """A value of a plain annotation (bool, int, float, str) as that type; ValueError when it is another."""
    if annotation is str:  # a path object where a path is meant: its text (hparams stay plain for weights_only loads)
        ok = isinstance(value, (str, os.PathLike))
        value = os.fspath(value) if ok else value
    else:  # a bool is an int, but not where an int or a float is meant
        kind = {bool: bool, int: numbers.Integral, float: numbers.Real}[annotation]
        ok = isinstance(value, kind) and (annotation is bool or not isinstance(value, bool))
    if not ok:
        raise ValueError(f"expected {annotation.__name__}, got {value!r}")
    return annotation(value)


def check_value(annotation: Any, value: Any) -> Any:
    """`value` checked against an annotation (the types above, bool/int/float/str, Optional, Literal, tuple, list,
    dict; classes and callables pass: jsonargparse checks those), numbers made plain; else ValueError saying why."""
    check = getattr(annotation, "check", None)
    if check is not None:
        return check(value)
    if annotation in (bool, int, float, str):
        return _plain(annotation, value)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        others = [a for a in args if a is not type(None)]
        if value is None and len(others) < len(args):
            return None
        return check_value(others[0], value) if len(others) == 1 else value
    if origin is Literal:
        if value not in args:
            raise ValueError(f"expected one of {', '.join(repr(a) for a in args)}, got {value!r}")
        return value
    if origin is tuple and args and Ellipsis not in args:
        if not isinstance(value, (tuple, list)) or len(value) != len(args):
            raise ValueError(f"expected {len(args)} values, got {value!r}")
        return tuple(check_value(a, v) for a, v in zip(args, value))
    if origin is list:
        if not isinstance(value, (tuple, list)):
            raise ValueError(f"expected a list, got {value!r}")
        return [check_value(args[0], v) for v in value] if args else list(value)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ValueError(f"expected a mapping, got {value!r}")
        key_type, value_type = args or (Any, Any)
        return {check_value(key_type, k): check_value(value_type, v) for k, v in value.items()}
    return value


def check_fields(instance: Any, group: str) -> None:
    """A frozen dataclass's fields checked (from __post_init__) and replaced by their checked values."""
    values = {field.name: getattr(instance, field.name) for field in dataclasses.fields(instance)}
    for name, value in check_arguments(type(instance), values, group).items():
        object.__setattr__(instance, name, value)


def check_arguments(function: Callable, values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A call's (or a dataclass's) annotated arguments checked: {name: checked value} for each one in `values`."""
    hints = typing.get_type_hints(function)
    checked = {}
    for name in inspect.signature(function).parameters:
        if name not in hints or name not in values:
            continue
        try:
            checked[name] = check_value(hints[name], values[name])
        except ValueError as error:
            raise ConfigError(f"{where}.{name}: {error}") from None
    return checked


# Options only one subcommand uses: given to another, they would be ignored without a word.
OWNERS = {"global_batch_size": "fit", "last_checkpoint": "fit", "throughput": "fit", "predictions": "predict"}


def refuse_others_options(argv: Iterable[str], subcommand: str, runs: str) -> None:
    """ConfigError for a flag that `subcommand` (running `runs`: a sweep's trials are fits) does not use."""
    for word in argv:
        key = word.split("=")[0].removeprefix("--")
        first = key.split(".")[0]  # (argparse takes a prefix of an option's name: --global_batch is one)
        owner = next((owner for name, owner in OWNERS.items() if name == first or "." not in key and name.startswith(
            first)), None) if word.startswith("--") and first else None
        if owner is not None and owner != runs:
            raise ConfigError(f"--{key} is {owner}'s: {subcommand} does not use it; drop it")
