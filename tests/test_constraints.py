"""constraints.txt pins every package the dev extra installs, inside pyproject's ranges, never a compromised release.

    python -m pytest tests/test_constraints.py
"""

import importlib.metadata
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11; CI runs 3.11

ROOT = Path(__file__).resolve().parents[1]
# GHSA-w37p-236h-pfx3 (Lightning #21691): credential-stealing code on `import lightning`.
COMPROMISED = {"lightning": {"2.6.2", "2.6.3"}, "pytorch-lightning": {"2.6.2", "2.6.3"}}


def pins() -> dict[str, Version]:
    """constraints.txt as {canonical name: pinned version}; every line must be a plain `name==version`."""
    pinned = {}
    for number, line in enumerate((ROOT / "constraints.txt").read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        specifiers = list(requirement.specifier)
        assert len(specifiers) == 1 and specifiers[0].operator == "==" and not requirement.marker, (
            f"constraints.txt line {number}: {line!r} is not an exact pin (name==version)")
        name = canonicalize_name(requirement.name)
        assert name not in pinned, f"constraints.txt pins {name} twice"
        assert name != "project", "constraints.txt must not pin the project itself"
        pinned[name] = Version(specifiers[0].version)
    return pinned


def dev_requirements() -> list[Requirement]:
    """pyproject's dependencies plus the dev extra, with `project[...]` self-references expanded into those extras."""
    metadata = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = metadata["optional-dependencies"]
    self_name = canonicalize_name(metadata["name"])

    def expand(lines: list[str]) -> list[Requirement]:
        requirements = []
        for requirement in map(Requirement, lines):
            if canonicalize_name(requirement.name) == self_name:
                requirements += [r for extra in sorted(requirement.extras) for r in expand(extras[extra])]
            else:
                requirements.append(requirement)
        return requirements

    return expand(metadata["dependencies"] + extras["dev"])


def installed_closure() -> dict[str, tuple[Version, list[Requirement]]]:
    """Every distribution the dev extra pulls in here (markers evaluated for this machine): its installed version and
    the requirements on it met on the way."""
    versions: dict[str, Version] = {}
    required_by: dict[str, list[Requirement]] = {}
    todo = [(requirement, frozenset(requirement.extras)) for requirement in dev_requirements()]
    seen = set()
    while todo:
        requirement, extras = todo.pop()
        name = canonicalize_name(requirement.name)
        required_by.setdefault(name, []).append(requirement)
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f"{name} (needed by the dev extra) is not installed: pip install -e \".[dev]\" -c "
                        "constraints.txt")
        versions[name] = Version(distribution.version)
        environments = [{"extra": extra} for extra in extras] or [{"extra": ""}]
        for line in distribution.requires or []:
            child = Requirement(line)
            if child.marker is None or any(child.marker.evaluate(env) for env in environments):
                todo.append((child, frozenset(child.extras)))
    return {name: (versions[name], required_by[name]) for name in versions}


def test_the_compromised_lightning_releases_are_excluded_by_pyproject_and_never_pinned():
    pinned = pins()
    for requirement in dev_requirements():
        name = canonicalize_name(requirement.name)
        if name in COMPROMISED:
            assert not any(requirement.specifier.contains(bad) for bad in COMPROMISED[name]), (
                f"pyproject's {requirement} admits a compromised release {sorted(COMPROMISED[name])}")
    assert {"lightning", "pytorch-lightning"} <= set(pinned)
    for name, bad in COMPROMISED.items():
        assert str(pinned[name]) not in bad, f"constraints.txt pins the compromised {name}=={pinned[name]}"


def test_every_pin_of_a_direct_requirement_is_inside_pyprojects_range():
    pinned = pins()
    for requirement in dev_requirements():
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"constraints.txt does not pin {name}, which pyproject requires ({requirement})"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"constraints.txt pins {name}=={pinned[name]}, outside pyproject's {requirement}")


def test_constraints_pin_every_package_the_dev_extra_installs_at_the_installed_version():
    pinned, closure = pins(), installed_closure()
    assert len(closure) > 50  # torch alone brings its CUDA libraries: a short closure means the walk went wrong
    unpinned = sorted(set(closure) - set(pinned))
    assert not unpinned, f"constraints.txt lacks {unpinned}, which pip install -e \".[dev]\" installs"
    # CI installs with -c constraints.txt, so what runs the tests is what the file says; and the pins agree with
    # every requirement on the way (lightning's packaging<27, torchvision's torch==, ...).
    drifted = {name: (str(pinned[name]), str(version))
               for name, (version, _) in closure.items() if pinned[name] != version}
    assert not drifted, f"installed versions differ from constraints.txt (pinned, installed): {drifted}"
    for name, (_, requirements) in closure.items():
        for requirement in requirements:
            assert requirement.specifier.contains(pinned[name], prereleases=True), (
                f"{name}=={pinned[name]} vs {requirement}")


def test_ci_installs_with_the_constraints():
    # tests/test_readme.py checks that this line is the README's test command, verbatim.
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"# --- the README's test command, verbatim ---\n(.+)\n# ---", ci).group(1)
    assert command == 'pip install -e ".[dev]" -c constraints.txt && python -m pytest', command
