"""The engine stays within its limits: ruff (engine/pyproject.toml) finds nothing, no function is longer than 60
lines, it names no word of a template's room, and its public API stays about twenty names (its size per release is in
CHANGELOG.md). That a template's room reaches it only through that API: the template's tests/test_public_api.py.

    python -m pytest engine/tests/test_lint.py -q
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

import classifier_engine

ENGINE = Path(__file__).resolve().parents[1]  # engine/, the distribution
PACKAGE = ENGINE / "classifier_engine"
MAX_FUNCTION_LINES = 60
# The room's words (the template's model, network, options and metric names): the engine reads a model and data only
# through the contract (classifier_engine/contract.py), so none may appear in its code, strings or comments.
ROOM_WORDS = re.compile(r"val/acc1|val_acc1|\.network\b|[\"']network[\"']|\barch\b|ImageClassifier"
                        r"|ImageNetDataModule|lr_per_256|label_smoothing|freeze_backbone|backbone_lr_factor|mixup"
                        r"|cutmix|(?<![-/\w])project\.[a-z_]"
                        # the template's package and files: `python -m project`, project/..., configs/..., slurm/...
                        r"|-m project\b|(?<![-\w.])project/|(?<![-\w./])(configs|slurm)/")


def python_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.py"))


def test_ruff_finds_nothing():
    command = [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "classifier_engine",
               "tests"]
    result = subprocess.run(command, cwd=ENGINE, capture_output=True, text=True)
    assert result.returncode == 0, (f"ruff check found this (`ruff check --fix` mends the import order and unused "
                                    f"imports):\n{result.stdout}{result.stderr}")


def test_no_function_is_longer_than_60_lines():
    long = []
    for path in python_files(PACKAGE):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ENGINE)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, f"functions past {MAX_FUNCTION_LINES} lines (name the decisions inside them):\n" + "\n".join(long)


# The floors, lowest first: a module imports only from its own floor or lower ones (lazy imports inside functions
# count), and no import circle closes anywhere. A name is a package (every module in it) or one module.
FLOORS = (
    ("errors",),
    ("options", "seeds", "compat", "storage", "run_plan", "config_edits"),  # the ground: no engine above them
    ("contract", "class_switch"),
    ("run",),  # what makes a run safe to start, stop and continue: one question per file
    ("strategies", "samplers"),
    ("data",),
    ("callbacks",),
    ("plan",),  # the run plan's passes: they ask run/ and class_switch, in order
    ("additions", "summary"),
    ("cli",),
    ("export",),
    ("entry", "__main__", ""),  # the commands; "" is the package itself (its public names, imported on first use)
)


def engine_imports() -> dict[str, set[str]]:
    """{module: the engine's modules it imports}, by the module's dotted name under classifier_engine ("" for the
    package), lazy imports included; `from classifier_engine import x` of a submodule is an import of it."""
    graph: dict[str, set[str]] = {}
    for path in python_files(PACKAGE):
        name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix("__init__").rstrip(".")
        found = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets += [f"{node.module}.{alias.name}" if (PACKAGE / node.module.replace("classifier_engine", "")
                            .strip(".").replace(".", "/") / f"{alias.name}.py").is_file()
                            or (PACKAGE / alias.name).is_dir() and node.module == "classifier_engine"
                            else node.module for alias in node.names]
            found |= {t.removeprefix("classifier_engine").strip(".") for t in targets
                      if t == "classifier_engine" or t.startswith("classifier_engine.")}
        found.discard(name)
    return graph


def floor_of(module: str) -> int:
    matches = [(len(name), index) for index, names in enumerate(FLOORS) for name in names
               if module == name or (name and module.startswith(name + "."))]
    assert matches, f"classifier_engine.{module} is on no floor: add it to FLOORS"
    return max(matches)[1]


def test_the_library_floors_run_one_way_and_close_no_circle():
    graph = engine_imports()
    upward = [f"{m} -> {t}" for m, targets in graph.items() for t in targets if floor_of(t) > floor_of(m)]
    assert not upward, "imports that run up a floor (FLOORS):\n" + "\n".join(sorted(upward))
    circles, seen = [], set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        for target in sorted(graph.get(module, ())):
            if target in path:
                circles.append(" -> ".join(path[path.index(target):] + (target,)))
            elif target not in seen:
                seen.add(target)
                visit(target, path + (target,))

    for module in sorted(graph):
        visit(module, (module,))
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_library_links_only_its_own_docs():
    # The library ships with its docs/ (engine/docs): a docstring's or comment's docs/X.md names one of them.
    named = {(path.relative_to(ENGINE), name) for path in python_files(PACKAGE)
             for name in re.findall(r"docs/([\w-]+\.md)", path.read_text())}
    missing = sorted(f"{path}: docs/{name}" for path, name in named if not (ENGINE / "docs" / name).is_file())
    assert not missing, "links to docs the library does not ship:\n" + "\n".join(missing)


def test_the_cli_reads_as_the_runs_sequence():
    cli = PACKAGE / "cli.py"
    assert len(cli.read_text().splitlines()) <= 300
    assert len(engine_imports()["cli"]) <= 12, sorted(engine_imports()["cli"])


def test_the_engine_names_no_word_of_the_room():
    found = [f"{path.relative_to(ENGINE)}:{number}: {line.strip()}" for path in python_files(PACKAGE)
             for number, line in enumerate(path.read_text().splitlines(), 1) if ROOM_WORDS.search(line)]
    assert not found, "the engine names the template's room (read it through the contract):\n" + "\n".join(found)


def test_the_engine_imports_nothing_outside_itself_but_its_dependencies():
    first_party = {"classifier_engine"}
    allowed = first_party | set(sys.stdlib_module_names) | {
        "torch", "torchvision", "lightning", "torchmetrics", "jsonargparse", "yaml", "numpy", "PIL", "sklearn",
        "tensorboard", "typing_extensions", "fsspec", "packaging", "lightning_utilities",
        # the extras, imported where they are used
        "onnx", "onnxscript", "onnxruntime", "torchcodec", "nvidia", "simplejpeg", "mlflow", "wandb", "optuna",
        "matplotlib", "boto3",
        "botocore"}
    outside = []
    for path in python_files(PACKAGE):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            outside += [f"{path.relative_to(ENGINE)}:{node.lineno} {name}" for name in names
                        if name.partition(".")[0] not in allowed]
    assert not outside, "the engine imports what its distribution does not declare:\n" + "\n".join(outside)


def test_the_public_api_is_about_twenty_names_each_importable():
    assert len(classifier_engine.__all__) <= 20
    for name in classifier_engine.__all__:
        assert getattr(classifier_engine, name) is not None, name
