"""The README and docs/ say what the repository holds: links and paths resolve, CI runs the README's set-up commands.

    python -m pytest tests/test_readme.py -q
"""

import re
import shlex
import subprocess
import sys
import tomllib

import pytest
import yaml

from conftest import REPO, deleted
from tools.workarounds_table import generated_part, markdown_table

README = REPO / "README.md"
DOCS = sorted([*(REPO / "docs").glob("*.md"), *(REPO / "engine" / "docs").glob("*.md")])
# Files the README asks the reader to create: named, so they cannot exist yet.
WRITTEN_BY_THE_READER = {"project/my_net.py", "configs/model/my_net.yaml"}
# The room's package: SHIPPED as the template ships it, another name after docs/your-own-project.md's rename.
SHIPPED = "project"
ROOM = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
ROOM = ROOM[0].rstrip("*")
TOP_FOLDERS = (ROOM, SHIPPED, "engine", "tests", "bench", "tools", "slurm", "notebooks", "configs", "docs", ".ci")


def without_code(markdown: str) -> str:
    """The prose: fenced blocks and inline code spans blanked (a `[x](y)` or `# x` inside them is not markup)."""
    markdown = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", markdown)


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: its text lowercased, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.replace("`", ""))
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    found, seen = set(), {}
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M), flags=re.M):
        anchor = github_anchor(heading)
        found.add(anchor if anchor not in seen else f"{anchor}-{seen[anchor]}")
        seen[anchor] = seen.get(anchor, 0) + 1
    return found


def section(markdown: str, title: str) -> str:
    """The text under the first `## <title>...` heading, up to the next `## ` heading."""
    match = re.search(rf"^## {re.escape(title)}.*?$(.*?)(?=^## |\Z)", markdown, flags=re.S | re.M)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def flag_values(words: list[str], flag: str) -> list[str]:
    return [value for word, value in zip(words, words[1:]) if word == flag]


def setup_commands() -> list[str]:
    block = re.search(r"^```bash\n(.*?)^```", section(README.read_text(), "Set-up"), flags=re.S | re.M)
    assert block, "README 'Set-up' has no ```bash block"
    lines = [line.strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def the_command(what: str) -> str:
    (command,) = [c for c in setup_commands() if what in c]
    return command


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_points_to_an_existing_file_and_heading(doc):
    broken = []
    for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", without_code(doc.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists() and file.is_relative_to(REPO) and deleted(file.relative_to(REPO).as_posix()):
            continue  # a part the user deleted (docs/your-own-project.md)
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(f"{target} (no heading #{anchor} in {file.relative_to(REPO)})")
    assert not broken, f"{doc.relative_to(REPO)}: " + "; ".join(broken)


def test_every_config_the_readme_names_exists():
    readme = README.read_text()
    named = set(re.findall(r"(?<![\w/.-])configs/[\w/.-]*\.yaml", readme))
    assert "configs/quickstart.yaml" in named  # the pattern finds them at all
    for created in WRITTEN_BY_THE_READER & named:
        assert created in section(readme, "Add your model"), f"{created} is named outside the recipe that creates it"
    missing = sorted(p for p in named - WRITTEN_BY_THE_READER if not (REPO / p).is_file() and not deleted(p))
    assert not missing, f"README.md names configs that do not exist: {missing}"


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_repository_path_the_docs_name_exists(doc):
    pattern = rf"(?<![\w/.~-])(?:{'|'.join(re.escape(f) for f in TOP_FOLDERS)})/[\w/.-]*"
    named = {p.rstrip(".") for p in re.findall(pattern, doc.read_text())}
    if doc.is_relative_to(REPO / "engine") and ROOM != SHIPPED:  # the library's docs name the template as shipped
        named = {p for p in named if not p.startswith(SHIPPED + "/")}
    missing = sorted(p for p in named - WRITTEN_BY_THE_READER if not (REPO / p).exists() and not deleted(p))
    assert not missing, f"{doc.relative_to(REPO)} names paths that do not exist: {missing}"


def test_the_setup_is_two_commands_and_ci_runs_the_readmes_test_command_verbatim():
    commands = setup_commands()
    assert len(commands) == 2, commands
    test_command = the_command("pytest")
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert test_command in [line.strip() for line in ci], f".ci/run does not run the README's {test_command!r}"


def test_the_setup_commands_name_files_and_extras_that_exist():
    for command in setup_commands():
        for step in command.split("&&"):
            words = shlex.split(step)
            if words[:2] == ["pip", "install"]:
                for flag, value in zip(words, words[1:]):
                    if flag in ("-c", "-r", "--constraint", "--requirement"):
                        assert (REPO / value).is_file(), f"{command!r}: {value} does not exist"
                    if flag == "-e":
                        path, _, extra = value.partition("[")
                        assert (REPO / path / "pyproject.toml").is_file(), command
                        extras = tomllib.loads((REPO / path / "pyproject.toml").read_text())["project"][
                            "optional-dependencies"]
                        assert {e for e in extra.rstrip("]").split(",") if e} <= set(extras), command
            for config in flag_values(words, "--config"):
                assert (REPO / config).is_file(), f"{command!r}: {config} does not exist"


def test_the_quickstarts_closing_line_shown_is_where_its_config_writes():
    configs = flag_values(shlex.split(the_command(" fit --config")), "--config")
    roots = [yaml.safe_load((REPO / c).read_text()).get("trainer", {}).get("default_root_dir") for c in configs]
    root = [r for r in roots if r][-1]
    shown = re.search(r"^run dir .*$", section(README.read_text(), "Set-up"), flags=re.M)
    assert shown, "README 'Set-up' no longer shows the run's closing line"
    line = shown.group(0)
    assert line.startswith(f"run dir {root}/lightning_logs/version_0; best checkpoint {root}/"), line
    assert f"; look at it with: tensorboard --logdir {root}/lightning_logs" in line, line
    assert line.endswith(" of its time for the next batch (data-bound above 10 %)"), line  # the input's verdict


def test_the_workarounds_table_is_the_registry():
    document = (REPO / "engine" / "docs" / "workarounds.md").read_text()
    committed = generated_part(document)
    assert committed is not None, "engine/docs/workarounds.md lost its generated-table markers"
    assert committed == markdown_table(), "engine/docs/workarounds.md differs from the registry: run " \
                                          "python -m tools.workarounds_table --write engine/docs/workarounds.md"


@pytest.mark.slow  # two processes, ~10 s of imports each
def test_the_readmes_commands_run_the_cli_and_the_table_generator():
    fit = shlex.split(the_command(" fit --config").split("&&")[-1])
    assert fit[:3] == ["python", "-m", "project"]
    parsed = subprocess.run([sys.executable, *fit[1:], "--print_config"], cwd=REPO, capture_output=True, text=True,
                            timeout=900)
    assert parsed.returncode == 0, parsed.stderr[-2000:]
    assert yaml.safe_load(parsed.stdout)["data"]["init_args"]["root"] == "embedded:digits"  # the no-download data

    printed = subprocess.run([sys.executable, "-m", "tools.workarounds_table"], cwd=REPO, capture_output=True,
                             text=True, timeout=900)
    assert printed.returncode == 0, printed.stderr[-2000:]
    assert printed.stdout == markdown_table()
