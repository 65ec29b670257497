"""`--model.finetune.weights=null` sets None: jsonargparse's subclass mode parses it as the string 'None'."""

from collections.abc import Sequence

from jsonargparse import Namespace

NULLS = ("null", "None")


def _given_nulls(argv: Sequence[str]) -> list[str]:
    keys = []
    for index, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        key, sep, value = arg[2:].partition("=")
        if not sep:
            value = argv[index + 1] if index + 1 < len(argv) else ""
        if value in NULLS:
            keys.append(key)
    return keys


def restore_nulls(config: Namespace, argv: Sequence[str]) -> None:
    """Set back to None each `--key=null` of `argv` that the parse left as the string 'None' in `config`."""
    for key in _given_nulls(argv):
        head, _, rest = key.partition(".")
        for candidate in (key, f"{head}.init_args.{rest}" if rest and not rest.startswith("init_args.") else key):
            if config.get(candidate) == "None":
                config[candidate] = None
