"""A name read from an untrusted list (a shard set's index.json, a manifest row) names a file inside the list's own
folder, or the list is refused before anything is read or written (docs/reliability.md#untrusted-lists)."""

import os
from pathlib import Path

from classifier_engine.errors import ConfigError


def inside(folder: Path, name: object, where: str) -> Path:
    """folder/name, the name a relative path that stays inside `folder` once `..` are resolved; else ConfigError
    naming `where` (the list and its line). Links inside the folder are followed: they are its owner's choice."""
    if not isinstance(name, str) or not name.strip() or "\x00" in name:
        raise ConfigError(f"{where}: {name!r} is not a file name: expected a path relative to {folder}")
    normal = os.path.normpath(name)
    if os.path.isabs(normal) or normal == "." or normal.split(os.sep)[0] == "..":
        raise ConfigError(f"{where}: {name!r} names a file outside {folder}: a list may name files inside its own "
                          "folder only (move the files there, or write the list beside them)")
    return folder / normal
