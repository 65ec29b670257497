"""Human-readable class names for ImageFolder classes, from ROOT/class_index.json (written by prepare_imagenet)."""

import json
from pathlib import Path

CLASS_INDEX_FILE = "class_index.json"


def read_class_labels(root: Path, class_names: list[str]) -> list[str]:
    """Human-readable names for the class folders, from ROOT/class_index.json; the folder name where it has none."""
    index_file = Path(root) / CLASS_INDEX_FILE
    if not index_file.is_file():
        return list(class_names)
    names = {entry["wnid"]: entry["name"] for entry in json.loads(index_file.read_text())}
    return [names.get(folder, folder) for folder in class_names]
