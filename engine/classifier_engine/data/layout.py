"""The classes of an ImageFolder-layout root (train/<class>/, val/<class>/): the folders, checked (an error that names
the fix), and their human-readable names from ROOT/class_index.json (written by tools/prepare_imagenet.py)."""

import json
import os
from pathlib import Path
from typing import Optional

from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

from classifier_engine.errors import ConfigError

CLASS_INDEX_FILE = "class_index.json"
EXPECTED_LAYOUT = "expected layout: ROOT/train/<class>/<image>.JPEG and ROOT/val/<class>/<image>.JPEG"


class DataLayoutError(ConfigError):
    """The data root does not have the train/<class>/ and val/<class>/ layout."""


def is_data(name: str) -> bool:
    """The one rule below a class folder or a predict root: a name starting with '.' (`._photo.jpg`) is not data."""
    return not name.startswith(".")


def _class_dirs(split_dir: Path) -> list[str]:
    # As ImageFolder.find_classes lists them, hidden folders included: one skipped here would shift every label.
    return sorted(e.name for e in os.scandir(split_dir) if e.is_dir())


def _is_image(path: str, split_dir: Path) -> bool:
    below_its_class = Path(os.path.relpath(path, split_dir)).parts[1:]  # a class folder is ImageFolder's (see above)
    return path.lower().endswith(IMG_EXTENSIONS) and all(map(is_data, below_its_class))


def _has_image(class_dir: Path) -> bool:
    for folder, subfolders, files in os.walk(class_dir, followlinks=True):  # stops at the first image
        subfolders[:] = filter(is_data, subfolders)
        if any(_is_image(os.path.join(folder, name), class_dir.parent) for name in files):
            return True
    return False


def check_layout(root: str | os.PathLike) -> list[str]:
    """Validate ROOT/train and ROOT/val and return the class names (sorted, as ImageFolder indexes them)."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise DataLayoutError(f"data root {root} {'is a file, not a folder' if root.exists() else 'does not exist'}; "
                              f"pass --data.root pointing to your data set ({EXPECTED_LAYOUT}), or use --data.root "
                              "embedded:digits for the built-in quickstart data")
    found = {}
    for split_dir in (root / "train", root / "val"):
        if not split_dir.is_dir():
            raise DataLayoutError(f"data root {root} has no '{split_dir.name}/' folder; {EXPECTED_LAYOUT}")
        if not (classes := _class_dirs(split_dir)):
            raise DataLayoutError(f"{split_dir} holds no class folders; {EXPECTED_LAYOUT}")
        if empty := [c for c in classes if not _has_image(split_dir / c)]:
            shown = ", ".join(empty[:10]) + (f" and {len(empty) - 10} more" if len(empty) > 10 else "")
            raise DataLayoutError(f"{split_dir} has {len(empty)} class folder(s) without images ({shown}); every class "
                                  f"needs an image (extensions: {IMG_EXTENSIONS}). Fill or remove the empty folders.")
        found[split_dir.name] = classes
    _check_known(root / "val", found["val"], found["train"])
    return found["train"]


def _check_known(split_dir: Path, classes: list[str], train_classes: list[str]) -> None:
    # A split may lack classes (labelled by name, below); a class that train/ lacks has no label at all.
    if unknown := sorted(set(classes) - set(train_classes)):
        raise DataLayoutError(f"{split_dir} holds class folders that {split_dir.parent / 'train'} lacks: "
                              f"{unknown[:20]}; every class needs its train/ folder (a label is its index in train/)")


def folder_samples(split_dir: Path, class_names: Optional[list[str]] = None) -> list[tuple[str, int]]:
    """(path, index in `class_names`, default the split's folders) of every image: a class missing shifts no label."""
    present = _class_dirs(split_dir)
    class_names = present if class_names is None else class_names
    _check_known(split_dir, present, class_names)
    return make_dataset(str(split_dir), {name: i for i, name in enumerate(class_names)}, allow_empty=True,
                        is_valid_file=lambda path: _is_image(path, split_dir))


def read_class_labels(root: Path, class_names: list[str]) -> list[str]:
    """Human-readable names for the class folders, from ROOT/class_index.json; the folder name where it has none."""
    index_file = Path(root) / CLASS_INDEX_FILE
    if not index_file.is_file():
        return list(class_names)
    try:
        entries = json.loads(index_file.read_text(encoding="utf-8"))
        problem = "not a list" if not isinstance(entries, list) else next((
            f"entry {k} has no {key!r}" for k, entry in enumerate(entries) for key in ("wnid", "name")
            if not isinstance(entry, dict) or not isinstance(entry.get(key), str)), None)
    except ValueError as error:  # (not JSON, not UTF-8)
        problem = f"not JSON: {error}"
    if problem is not None:
        raise ConfigError(f"{index_file}: not a class index ({problem}): expected a JSON list of {{\"wnid\": <class "
                          "folder>, \"name\": <its name>}, as tools/prepare_imagenet.py writes it; fix or delete it")
    names = {entry["wnid"]: entry["name"] for entry in entries}
    return [names.get(folder, folder) for folder in class_names]
