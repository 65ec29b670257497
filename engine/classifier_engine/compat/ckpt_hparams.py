"""With `--ckpt_path`, `--model.*` values given explicitly win over the checkpoint's, and each is shown."""

import sys
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from jsonargparse import ArgumentParser, Namespace, dict_to_namespace

# Sources of the parse-time links (classifier_engine.cli): a parse without defaults must still see them.
LINK_SOURCES = ("seed_everything", "data.init_args.batch_size")


def _plain(value: Any) -> Any:
    """Comparable form: Namespaces as dicts, tuples as lists."""
    if isinstance(value, Namespace):
        value = value.as_dict()
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def explicit_values(parser: ArgumentParser, args: Any, config: Namespace, subcommand: Optional[str],
                    link_sources: Sequence[str] = LINK_SOURCES) -> Namespace:
    """What the command line and its config files set, without the defaults (the subcommand's part, if any), and the
    values of `link_sources`, which a parse without defaults must see (a missing link source fails the parse)."""
    if isinstance(args, (dict, Namespace)):  # cli_main(settings): everything given is explicit
        given = dict_to_namespace(args) if isinstance(args, dict) else args
        return given.get(subcommand, given) if subcommand else given
    argv = list(sys.argv[1:] if args is None else args)
    part = config[subcommand] if subcommand else config
    sources = [f"--{key}={part[key]}" for key in link_sources if part.get(key) is not None]
    parsed = parser.parse_args([*argv, *sources], defaults=False, _skip_validation=True)  # checked by the real parse
    return parsed[subcommand] if subcommand else parsed


def _lookup(hparams: Mapping, dotted: str) -> tuple[bool, Any]:
    """(found, value) of `optim.lr` in nested hparams ({"optim": {"lr": ...}})."""
    value: Any = hparams
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return False, None
        value = value[part]
    return True, value


def keep_explicit_model_values(config: Namespace, explicit: Namespace, checkpoint_hparams: Mapping) -> list[str]:
    """Put explicit `model.*` leaves (`model.optim.lr`) back into `config` where the checkpoint's differ."""
    given = explicit.get("model.init_args")  # subclass mode: the model's arguments are its init_args
    if not isinstance(given, Namespace):
        return []
    lines = []
    for key, value in given.items():
        found, saved = _lookup(checkpoint_hparams, key)
        if not found or _plain(saved) == _plain(value):
            continue
        config.model.init_args[key] = value
        lines.append(f"model.{key}: {_plain(value)!r} (given) instead of the checkpoint's {_plain(saved)!r}")
    return lines
