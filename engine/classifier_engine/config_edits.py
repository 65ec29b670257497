"""The one writer of the parsed config: a plan's edits, applied in order, each link's target following its source.
Everything else reads the config through a read-only copy (a pass that assigns into it fails at once).

    python -m classifier_engine fit --config CONFIG --global_batch_size 48 --plan     # the edits, with their reasons
"""

from collections.abc import Callable, Iterable
from typing import Any, Optional

from jsonargparse import Namespace


def run_seed(seed_everything: Any) -> int:
    """The run seed the data order and augmentations derive from; `seed_everything: false` gives 0."""
    return seed_everything if isinstance(seed_everything, int) and not isinstance(seed_everything, bool) else 0


# The parse-time links (the CLI registers these; an edit of a source carries over to its target, as a parse would).
# A target a class lacks is skipped, as jsonargparse skips it.
PARSE_LINKS: tuple[tuple[str, str, Optional[Callable[[Any], Any]]], ...] = (
    ("data.init_args.batch_size", "model.init_args.batch_size", None),
    ("seed_everything", "data.init_args.seed", run_seed),
    ("seed_everything", "model.init_args.seed", run_seed),
)


def apply_edits(config: Namespace, edits: Iterable[tuple[str, Any]]) -> None:
    """Set each dotted key of `config` to its value, in order (the only assignment into a parsed config); a number in
    a key is a list's index (`trainer.logger.1.init_args.version`: the second logger's)."""
    for key, value in edits:
        _set(config, key, value)
        for source, target, compute in PARSE_LINKS:
            if key == source and target in config:
                config[target] = compute(value) if compute else value


def _set(config: Namespace, key: str, value: Any) -> None:
    parts = key.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    if index is None:
        config[key] = value
        return
    items = config[".".join(parts[:index])]
    if index + 1 == len(parts):
        items[int(parts[index])] = value
    else:
        _set(items[int(parts[index])], ".".join(parts[index + 1:]), value)


READ_ONLY = ("the parsed config is read-only outside config_edits.py: return the change as an edit of a Decision "
             "(classifier_engine.Decision(topic, value, why, edits=((key, value),)))")


def _refuse(self, *args: Any, **kwargs: Any) -> Any:
    raise TypeError(READ_ONLY)


class _ReadOnly(Namespace):
    __setattr__ = __setitem__ = __delitem__ = __delattr__ = pop = update = _refuse

    def clone(self, with_meta: bool = True) -> Namespace:
        return _copy(self, Namespace)  # a writable copy: the caller's own


def _copy(value: Any, kind: type) -> Any:
    """A deep copy of a config value whose namespaces are of `kind` (their keys kept as stored)."""
    if isinstance(value, Namespace):
        copy = kind()
        for key, item in vars(value).items():
            object.__getattribute__(copy, "__dict__")[key] = _copy(item, kind)
        return copy
    if isinstance(value, dict):
        return {key: _copy(item, kind) for key, item in value.items()}
    if isinstance(value, list):
        return [_copy(item, kind) for item in value]
    return value


def read_only(config: Namespace) -> Namespace:
    """A copy of `config` that refuses every assignment (TypeError naming the way: an edit)."""
    return _copy(config, _ReadOnly)
