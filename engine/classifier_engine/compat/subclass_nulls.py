"""`--model.group.field=null` sets None: jsonargparse's subclass mode parses it as the string 'None'."""

from collections.abc import Sequence

from jsonargparse import Namespace


def restore_nulls(config: Namespace, argv: Sequence[str]) -> None:
    """Set back to None each `--key=null` (or `--key null`) of `argv` that the parse left as the string 'None'."""
    for index, arg in enumerate(argv):
        key, sep, value = arg[2:].partition("=")
        if not sep:
            value = argv[index + 1] if index + 1 < len(argv) else ""
        if not arg.startswith("--") or value not in ("null", "None"):
            continue
        head, _, rest = key.partition(".")
        for candidate in (key, f"{head}.init_args.{rest}" if rest and not rest.startswith("init_args.") else key):
            if config.get(candidate) == "None":
                config[candidate] = None
