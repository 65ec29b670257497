"""The room reaches the engine only through its public API (classifier_engine's __all__, and the option types of
classifier_engine.options): what the engine promises to keep across releases.

    python -m pytest tests/test_public_api.py
"""

import ast
from pathlib import Path

import classifier_engine

import project
from conftest import REPO


def test_the_template_room_imports_only_the_public_api():
    room = Path(project.__file__).parent  # (renamed with the room: the rename's sed rewrites this name)
    private = []
    for path in sorted(room.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("classifier_engine."):
                if node.module != "classifier_engine.options":  # the option types: a public namespace
                    private.append(f"{path.relative_to(REPO)}:{node.lineno} {node.module}")
            if isinstance(node, ast.ImportFrom) and node.module == "classifier_engine":
                private += [f"{path.relative_to(REPO)}:{node.lineno} {alias.name}" for alias in node.names
                            if alias.name not in classifier_engine.__all__]
    assert not private, "the room reaches past the engine's public API:\n" + "\n".join(private)
