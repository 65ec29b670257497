"""With `--ckpt_path`, `--model.*` values given explicitly win over the checkpoint's, and each is shown; the explicit
values are what a parse without defaults finds (the start's second parse)."""

import sys
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from jsonargparse import ArgumentParser, Namespace, dict_to_namespace

from classifier_engine.errors import config_files, load_config_file

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


def explicit_values(parser: ArgumentParser, args: Any, config: Namespace, subcommand: Optional[str]) -> Namespace:
    """What the command line and its config files set, without the defaults (the subcommand's part, if any). A parse
    without defaults must see the link sources (a missing one fails it): they are given to it, then left out again
    unless a flag or a config file sets them."""
    if isinstance(args, (dict, Namespace)):  # cli_main(settings): everything given is explicit
        given = dict_to_namespace(args) if isinstance(args, dict) else args
        return given.get(subcommand, given) if subcommand else given
    argv = list(sys.argv[1:] if args is None else args)
    part = config[subcommand] if subcommand else config
    sources = [key for key in LINK_SOURCES if part.get(key) is not None]
    parsed = parser.parse_args([*argv, *(f"--{key}={part[key]}" for key in sources)], defaults=False,
                               _skip_validation=True)  # checked by the real parse
    explicit = parsed[subcommand] if subcommand else parsed
    for key in sources:
        if not _set_by(argv, key):
            explicit.pop(key)  # (the explicit values: a namespace of their own, not the parsed config)
    return explicit


def _set_by(argv: Sequence[str], key: str) -> bool:
    """Whether a flag (`--data.batch_size` or `--data.init_args.batch_size`) or a --config file sets `key`."""
    short = key.replace(".init_args.", ".")
    if any(word.split("=")[0] in (f"--{key}", f"--{short}") for word in argv):
        return True
    for name in config_files(list(argv)):
        found = load_config_file(name)
        for part in key.split("."):
            found = found.get(part) if isinstance(found, dict) else None
        if found is not None:
            return True
    return False


def explicit_model_values(model: Namespace, merged: Namespace, explicit: Namespace) -> tuple[
        list[tuple[str, Any]], list[str]]:
    """Edits taking the checkpoint's model values (`merged`: the model section with them parsed in) where they differ
    from `model`'s, except the `model.*` leaves given explicitly (`model.optim.lr`), which stay: those are named."""
    given = explicit.get("model.init_args")  # subclass mode: the model's arguments are its init_args
    given = set(given.keys()) if isinstance(given, Namespace) else set()
    now = dict(model.init_args.items()) if isinstance(model.get("init_args"), Namespace) else {}
    edits, kept = [], []
    taken = dict(merged.init_args.items()) if isinstance(merged.get("init_args"), Namespace) else {}
    for key, value in taken.items():
        if _plain(value) == _plain(now.get(key)):
            continue
        if key in given:
            kept.append(f"model.{key} {_plain(now.get(key))!r} (the checkpoint's: {_plain(value)!r})")
        else:
            edits.append((f"model.init_args.{key}", value))
    return edits, kept
