"""A config read back from an object store is untrusted input, as a checkpoint is: it may name only the code that the
command line, a local config or the entry point names too (docs/reliability.md#run-dirs-on-object-storage).

    python -m classifier_engine export --ckpt_path MIRROR/lightning_logs/version_0/checkpoints/last.ckpt
    # error: config file .../config.yaml came from s3://bucket/runs/...: it names planted.Module, ...
"""

import importlib.util
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from classifier_engine.errors import ConfigError, config_files, load_config_file
from classifier_engine.run.mirror_journal import stored_origin

DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
# What the engine itself writes into a run's config.yaml: the default logger, pinned to the run dir (resume.py).
WRITTEN_BY_THE_ENGINE = frozenset({"lightning.pytorch.loggers.TensorBoardLogger"})


def code_names(value: Any) -> set[str]:
    """Every text of a config that jsonargparse could import or read as code: class_path values (a short name too),
    dotted names of an importable module (a callable's import path), and other config files it names."""
    if isinstance(value, dict):
        found = {str(value["class_path"])} if "class_path" in value else set()
        return found.union(*(code_names(item) for key, item in value.items() if key != "class_path"))
    if isinstance(value, list):
        return set().union(*(code_names(item) for item in value))
    if not isinstance(value, str):
        return set()
    if value.lower().endswith((".yaml", ".yml", ".json")):
        return {value}  # a section given as a file: read relative to the config (a file of the same bucket)
    return {value} if DOTTED.fullmatch(value) and importlib.util.find_spec(value.split(".")[0]) else set()


def _imported(name: str) -> Any:
    """The object a dotted name stands for if its module is imported already (nothing is imported here), else None."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        found = sys.modules.get(".".join(parts[:cut]))
        for attribute in parts[cut:] if found is not None else ():
            found = getattr(found, attribute, None)
        if found is not None:
            return found
    return None


def public_classes() -> set[str]:
    """The library's public classes (classifier_engine.__all__): the code its own entry point is built to run, trusted
    as a template's default classes are (read from the imported package: no import edge up to it)."""
    package = sys.modules[__name__.split(".")[0]]
    return {f"{package.__name__}.{name}" for name in package.__all__ if isinstance(getattr(package, name, None), type)}


def check_stored_config(settings: Any, path: str | os.PathLike, trusted: Iterable[str]) -> None:
    """ConfigError when the config file `path` came from an object store and names code nothing local names (by
    name, or an imported object another name of it stands for: `pkg.Data` for `pkg.data.Data`)."""
    origin = stored_origin(Path(path))
    if origin is None:
        return
    trusted = set(trusted) | WRITTEN_BY_THE_ENGINE | public_classes()
    objects = [found for found in map(_imported, trusted) if found is not None]
    untrusted = sorted(name for name in code_names(settings) - trusted
                       if not any(_imported(name) is found for found in objects))
    if untrusted:
        more = f" (and {len(untrusted) - 1} more)" if len(untrusted) > 1 else ""
        raise ConfigError(f"config file {path} came from {origin}, and a file from an object store is not trusted to "
                          f"name code: it names {untrusted[0]}{more}, which neither the command line nor a local "
                          "config names; read it, then pass a copy of your own (--config my_run.yaml), or name "
                          f"{untrusted[0]} in a local config beside it")


def _named(text: str) -> set[str]:
    """What a command-line word names: itself, and the class paths of a JSON or YAML value (`--x+={...}`)."""
    try:
        return {text} | code_names(yaml.safe_load(text))
    except yaml.YAMLError:
        return {text}


def check_stored_configs(argv: list[str], entry_classes: Iterable[str]) -> None:
    """Each `--config FILE` of argv that came from an object store, against what the rest of argv (its flags and
    local config files) and the entry point's default classes name."""
    files = config_files(argv)
    stored = {name for name in files if stored_origin(Path(name).expanduser()) is not None}
    if not stored:
        return
    trusted = set(entry_classes).union(*(_named(part) for word in argv for part in (word, word.partition("=")[2])))
    for name in set(files) - stored:
        trusted |= code_names(load_config_file(name))
    for name in stored:
        check_stored_config(load_config_file(name), Path(name).expanduser(), trusted)
