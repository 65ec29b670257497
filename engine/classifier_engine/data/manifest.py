"""ManifestDataModule: image paths and class names listed per split in a CSV or JSON Lines manifest (columns `path`
and `label`, paths relative to the manifest), with every option of the folder module.

    python -m classifier_engine fit --config CONFIG --data.class_path classifier_engine.data.ManifestDataModule \
        --data.init_args.train_manifest train.csv --data.init_args.val_manifest val.csv
"""

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

from classifier_engine.data.image_data import ImageDataModule, Samples
from classifier_engine.data.listed_paths import inside
from classifier_engine.errors import ConfigError

COLUMNS = ("path", "label")


def _records(manifest: Path) -> Iterator[tuple[int, dict]]:
    """(line number, record) of a CSV (with a header line) or, for .jsonl / .json, of JSON Lines."""
    try:
        yield from _lines(manifest)
    except UnicodeDecodeError as error:  # (Excel's "CSV" is cp1252; its "Unicode text" UTF-16)
        data, line = manifest.read_bytes(), "?"  # (the error's position is in the reader's chunk, not in the file)
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as whole:
            line = data[:whole.start].count(b"\n") + 1
        raise ConfigError(f"manifest {manifest}: not UTF-8 text ({error.reason} on line {line}): save it as UTF-8 "
                          "(Excel: CSV UTF-8)") from None
    except csv.Error as error:
        raise ConfigError(f"manifest {manifest}: not a CSV file ({error}): write one line per image, path,label") \
            from None


def _lines(manifest: Path) -> Iterator[tuple[int, dict]]:
    with open(manifest, newline="", encoding="utf-8-sig") as lines:  # -sig: Excel's "CSV UTF-8" starts with a BOM
        if manifest.suffix.lower() not in (".jsonl", ".json"):
            rows = csv.DictReader(lines)
            _check_columns(manifest, "its header", rows.fieldnames or [])
            yield from ((rows.line_num, row) for row in rows)
            return
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError as error:
                    raise ConfigError(f"manifest {manifest}, line {number}: not JSON ({error})") from None
                _check_columns(manifest, f"line {number}", list(record) if isinstance(record, dict) else [])
                yield number, record


def _check_columns(manifest: Path, where: str, columns: list) -> None:
    if sorted(map(str, columns)) != sorted(COLUMNS):
        raise ConfigError(f"manifest {manifest}: {where} has the columns {columns}, expected exactly "
                          f"{', '.join(COLUMNS)} (an image path relative to the manifest, and its class name)")


def read_manifest(option: str, value: str) -> list[tuple[str, str]]:
    """(image path, class name) of every line of the manifest `value`, checked (ConfigError naming `data.option`)."""
    manifest = Path(value).expanduser()
    if not manifest.is_file():
        raise ConfigError(f"data.{option}: {manifest} {'is not a file' if manifest.exists() else 'does not exist'}; "
                          "expected a CSV (or .jsonl) file with the columns path,label")
    samples, first_line = [], {}
    for number, record in _records(manifest):
        if record["path"] in (None, "") or record["label"] in (None, ""):
            raise ConfigError(f"manifest {manifest}, line {number}: expected an image path and a label, got {record}")
        path = str(inside(manifest.parent, str(record["path"]), f"manifest {manifest}, line {number}"))
        if path in first_line:
            raise ConfigError(f"manifest {manifest}: {record['path']} is listed twice (lines {first_line[path]} and "
                              f"{number}): list each image once")
        first_line[path] = number
        samples.append((path, str(record["label"])))
    if not samples:
        raise ConfigError(f"manifest {manifest} lists no images (data.{option}): expected a line per image, path,label")
    return samples


def read_manifests(given: dict[str, str],
                   flags: Optional[dict[str, str]] = None) -> tuple[list[str], dict[str, Samples]]:
    """The train manifest's sorted labels, and each split's (path, class index), of the manifests given by option
    (`flags`: how a message names each option, make_shards' --source and --val-source; else data.<option>)."""
    listed = {option: read_manifest(option, value) for option, value in given.items() if value is not None}
    classes = sorted({label for _, label in listed["train_manifest"]})
    for option, rows in listed.items():
        if unknown := sorted({label for _, label in rows} - set(classes)):
            where = f"{flags[option]} {given[option]}" if flags else f"data.{option}"
            raise ConfigError(f"{where}: label(s) {unknown[:10]} are not in the train manifest (its classes: "
                              f"{classes[:10]}{' ...' if len(classes) > 10 else ''})")
    index = {name: i for i, name in enumerate(classes)}
    return classes, {option.removesuffix("_manifest"): [(path, index[label]) for path, label in rows]
                     for option, rows in listed.items()}


class ManifestDataModule(ImageDataModule):
    """Classes are the distinct labels of the train manifest, sorted; the other splits' labels are mapped by name."""

    def __init__(self, train_manifest: Optional[str] = None, val_manifest: Optional[str] = None,
                 test_manifest: Optional[str] = None, **options):
        """
        Args:
            train_manifest: CSV (or JSON Lines: .jsonl) of the training images: columns path (relative to the
                manifest) and label (the class name).
            val_manifest: the validation images, as train_manifest; it may lack some classes.
            test_manifest: the test images, as val_manifest; None tests on the validation images.
            **options: the options every image data module has (classifier_engine.data.image_data.ImageDataModule).
        """
        super().__init__(**options)  # the options are checked first: nothing is read before
        given = {"train_manifest": train_manifest, "val_manifest": val_manifest, "test_manifest": test_manifest}
        if missing := [f"data.{name}" for name, value in list(given.items())[:2] if value is None]:
            raise ConfigError(f"{' and '.join(missing)} not set: pass --{missing[0]} (a CSV with the columns "
                              "path,label)")
        self.class_names, self.manifests = read_manifests(given)
        self.num_classes = len(self.class_names)
        self.class_labels = list(self.class_names)

    def samples(self, split: str) -> Samples:
        return self.manifests.get(split) or self.manifests["val"]

    def predict_images(self) -> list[Path]:
        return [Path(path) for path, _ in self.manifests["val"]]
