"""Value types of the data options: a bad value is refused in one line when the command line is parsed.

    python -m project fit --config configs/quickstart.yaml --data.train_crop_size=0
    # error: data.train_crop_size: expected an int >= 1, got 0 (...)

Each type is registered with jsonargparse (its own mechanism for custom types), so LightningCLI checks the value at
parse time and names the key, before a run dir exists. They differ from jsonargparse's PositiveInt & co in one way:
the parsed value is a plain int or float. jsonargparse's restricted types hand their own int subclass to __init__ and,
through `link_arguments`, to the model: it lands in both hyperparameters and torch.load(weights_only=True) refuses the
checkpoint ("Unsupported global: jsonargparse.typing.PositiveInt"). A Python caller passing plain values gets the same
checks from check_option_values, with the same words.
"""

import inspect
import typing
from collections.abc import Callable
from typing import Any, Literal, Optional, Union

from jsonargparse.typing import register_type

from project.engine.errors import ConfigError


def _number(name: str, base: type, expected: str, fits: Callable[[Any], bool]) -> type:
    """A number type for annotations: its `check` parses and checks one value and returns a plain `base`."""

    def check(given: Any) -> Any:
        value = given
        if isinstance(given, str):  # a command-line value reaches a registered type unparsed
            try:
                value = float(given) if base is float else int(given)
            except ValueError:
                pass
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        whole = not (base is int and isinstance(value, float) and not value.is_integer())
        if not (number and whole and fits(value)):
            raise ValueError(f"expected {expected}, got {given if isinstance(given, str) else repr(given)}")
        return base(value)

    number = type(name, (base,), {"__doc__": f"{expected[0].upper()}{expected[1:]}.", "__module__": __name__,
                                  "expected": expected, "check": staticmethod(check)})
    # A plain int/float is never "of" this type, so jsonargparse always runs check (config files included).
    register_type(number, serializer=base, deserializer=check)
    return number


PositiveInt = _number("PositiveInt", int, "an int >= 1", lambda v: v >= 1)
NonNegativeInt = _number("NonNegativeInt", int, "an int >= 0", lambda v: v >= 0)
Probability = _number("Probability", float, "a probability in [0, 1]", lambda v: 0 <= v <= 1)
# RandomResizedCrop's area fraction: a crop of no area, or of more than the image, is never drawn (torchvision
# falls back to the whole image, silently).
AreaFraction = _number("AreaFraction", float, "an area fraction in (0, 1]", lambda v: 0 < v <= 1)
# torchvision's RandAugment indexes 31 magnitude bins: 31 raises IndexError in a worker, -1 silently means 30.
RandAugmentMagnitude = _number("RandAugmentMagnitude", int, "an int in [0, 30] (RandAugment's 31 bins)",
                               lambda v: 0 <= v <= 30)


def _check(annotation: Any, value: Any) -> Any:
    """`value` checked against an annotation made of the types above, Optional, tuple and Literal; else unchanged."""
    check = getattr(annotation, "check", None)
    if check is not None:
        return check(value)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Union and type(None) in args:
        return None if value is None else _check(next(a for a in args if a is not type(None)), value)
    if origin is tuple and args and Ellipsis not in args:
        if not isinstance(value, (tuple, list)) or len(value) != len(args):
            raise ValueError(f"expected {len(args)} values, got {value!r}")
        return tuple(_check(a, v) for a, v in zip(args, value))
    if origin is Literal and value not in args:
        raise ValueError(f"expected one of {', '.join(repr(a) for a in args)}, got {value!r}")
    return value


def check_option_values(function: Callable, values: dict[str, Any], group: str = "data") -> dict[str, Any]:
    """`values` (a call's arguments, e.g. locals()) checked against `function`'s annotations: a ConfigError naming
    `group.key` for the first bad one, else the values with every number plain."""
    hints = typing.get_type_hints(function)
    checked = {}
    for name in inspect.signature(function).parameters:
        if name in values and name in hints:
            try:
                checked[name] = _check(hints[name], values[name])
            except ValueError as error:
                raise ConfigError(f"{group}.{name}: {error}") from None
    return checked


def check_combinations(*, train_crop_scale: tuple[float, float], num_workers: int, prefetch_factor: Optional[int],
                       multiprocessing_context: Optional[str]) -> None:
    """The data options that are each valid but cannot work together (ConfigError, one line with the fix)."""
    low, high = train_crop_scale
    if low > high:  # torch's uniform_ raises in the first worker ("expects to return a [from, to) range")
        raise ConfigError(f"data.train_crop_scale: expected [min, max] area fractions, got [{low}, {high}]: "
                          f"swap them (--data.train_crop_scale=[{high}, {low}])")
    # Both are DataLoader options of worker processes; torch's DataLoader refuses them with num_workers=0 too.
    for name, value in (("prefetch_factor", prefetch_factor), ("multiprocessing_context", multiprocessing_context)):
        if value is not None and num_workers == 0:
            raise ConfigError(f"data.{name}={value} applies to DataLoader worker processes, and data.num_workers=0 "
                              f"loads in the main process: set --data.num_workers (>= 1) or drop data.{name}")
