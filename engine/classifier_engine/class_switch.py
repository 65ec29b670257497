"""A model or data class chosen by `class_path` starts from its own defaults (engine/README.md, "Your defaults").

    python -m classifier_engine fit --data.class_path my_data.Digits  # Digits' batch_size default, not the template's

On a class switch jsonargparse keeps every `init_args` value of the previous class that the new class also takes,
its defaults included (seen in jsonargparse 4.30-4.53, documented behaviour): a data module's `batch_size: int = 64`
trained at the template's 256. Here a value the previous class had only by default is reset to the new class's default
(`resets`: edits of the run plan's "classes" decision; engine/README.md says what happens to values someone set).
"""

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import yaml
from jsonargparse import ArgumentParser, Namespace

from classifier_engine.contract import class_of
from classifier_engine.errors import ConfigError, config_files

PARTS = ("model", "data")


def class_defaults(cls: type) -> dict[str, Any]:
    """Every init argument of `cls` (dotted for groups) with its default, as the CLI would fill it in."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, fail_untyped=False, sub_configs=True)
    return dict(parser.get_defaults().items())


def _given_keys(explicit: Any) -> set[str]:
    """The init arguments a config file or flag set for one part ({} when none), dotted, without class_path."""
    if not isinstance(explicit, Namespace):
        return set()
    flat = {key.removeprefix("init_args.") for key in dict(explicit.items()) if key != "class_path"}
    return {key for key in flat if not key.startswith("dict_kwargs")}


def _before_switch(args: Sequence[str], part: str) -> tuple[set[str], set[str]]:
    """(keys of the `--part.key` flags, keys of the config files' `part:` sections) given on the command line before
    the last `--part.class_path` / `--part X`: what was set for the class before it."""
    switch = max((i for i, word in enumerate(args) if word in (f"--{part}", f"--{part}.class_path")
                  or word.startswith((f"--{part}=", f"--{part}.class_path="))), default=-1)
    flags, files, before = set(), set(), list(args[:max(switch, 0)])
    for word in before:
        if word.startswith(f"--{part}.") and not word.startswith(f"--{part}.class_path"):
            flags.add(word[len(part) + 3:].partition("=")[0].removeprefix("init_args."))
    for path in config_files(before):
        if os.path.isfile(path):  # config files are trusted input (README)
            section = (yaml.safe_load(Path(path).read_text()) or {}).get(part)
            if isinstance(section, dict):
                files |= {key for key in (section.get("init_args") or section) if key not in ("class_path",)}
    return flags, files


def resets(config: Namespace, explicit: Namespace, args: Sequence[str], defaults: Mapping[str, Optional[type]],
           linked: Mapping[str, Sequence[str]]) -> tuple[list[tuple[str, Any]], list[str]]:
    """(edits that put a switched-to class's own defaults back where the previous class's defaults were carried over,
    notes on config-file options the new class lacks); ConfigError for a flag the new class lacks."""
    found, notes = [], []
    for part in PARTS:
        section, default_class = config.get(part), defaults.get(part)
        chosen = class_of(section.class_path) if isinstance(section, Namespace) and section.get("class_path") else None
        if default_class is None or chosen is None or chosen is default_class:
            continue
        before, after = class_defaults(default_class), class_defaults(chosen)
        given, takes = _given_keys(explicit.get(part)), {key.split(".")[0] for key in after}
        flags, files = _before_switch(args, part)
        typed, lacking = sorted(flags - takes), sorted(files - takes)
        if typed:
            raise ConfigError(f"--{part}.{typed[0]} was given for {default_class.__qualname__}, and "
                              f"{section.class_path} takes no {typed[0]}: drop it (options before --{part}.class_path "
                              "belong to the class before it)")
        if lacking:
            notes.append(f"{part}: {', '.join(lacking)} (set for {default_class.__qualname__} in a config file) left "
                         f"out: not options of {section.class_path}")
        for key, value in section.init_args.items() if section.get("init_args") else ():
            carried = key in before and value == before[key] and key not in given
            if carried and key in after and after[key] != value and key not in linked.get(part, ()):
                found.append((f"{part}.init_args.{key}", after[key]))
    return found, notes
