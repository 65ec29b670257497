"""`--model.group.field=null` sets None: jsonargparse's subclass mode parses it as the string 'None'."""

from collections.abc import Sequence
from typing import Any

from jsonargparse import Namespace


def restored_nulls(config: Namespace, argv: Sequence[str]) -> list[tuple[str, Any]]:
    """Edits setting back to None each `--key=null` (or `--key null`) of `argv` the parse left as the string 'None'."""
    edits = []
    for index, arg in enumerate(argv):
        key, sep, value = arg[2:].partition("=")
        if not sep:
            value = argv[index + 1] if index + 1 < len(argv) else ""
        if not arg.startswith("--") or value not in ("null", "None"):
            continue
        head, _, rest = key.partition(".")
        nested = f"{head}.init_args.{rest}" if rest and not rest.startswith("init_args.") else key
        for candidate in dict.fromkeys((key, nested)):  # (once where they are the same key)
            if config.get(candidate) == "None":
                edits.append((candidate, None))
    return edits
