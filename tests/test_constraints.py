"""constraints.txt pins every package the dev extra installs, inside pyproject's ranges; the ranges admit no release
with a known advisory that breaks a promise the README makes (untrusted checkpoints, an uncompromised install).

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

ROOT = Path(__file__).resolve().parents[1]  # the template: constraints.txt and .ci/run
ENGINE = ROOT / "engine"  # engine/pyproject.toml: the ranges (its dev extra installs everything)
# Each advisory, checked at its source (docs/reliability.md): the first release clear of it that the ranges must admit
# (its fix, or the first after the record's last affected one) and the releases on the package index it affects.
LIGHTNING_AFFECTED = ["2.6.5", "2.6.4", "2.6.3", "2.6.2", "2.6.1", "2.6.0", "2.5.6", "2.5.0", "2.4.0"]
ADVISORIES = {
    # GHSA-w37p-236h-pfx3 (Lightning #21691): compromised uploads, credential-stealing code on `import lightning`.
    # GHSA-qqmf-gpg7-g8gw (CVE-2026-58659, PYSEC-2026-3624 / -3967): load_from_checkpoint imports and calls a
    # checkpoint's `_instantiator`, weights_only=True or not; fixed in 2.6.6 (Lightning PR #21832, #21914).
    "GHSA-qqmf-gpg7-g8gw lightning": ("lightning", "2.6.6", LIGHTNING_AFFECTED),
    "GHSA-qqmf-gpg7-g8gw pytorch-lightning": ("pytorch-lightning", "2.6.6", LIGHTNING_AFFECTED),
    # CVE-2026-24747 (GHSA-63cw-57p8-fm3p): torch.load(weights_only=True) memory corruption; fixed in 2.10.0, which
    # PYSEC-2026-139 affects: 2.11.0 is the first release clear of both.
    "CVE-2026-24747": ("torch", "2.11.0", ["2.9.1", "2.9.0", "2.8.0", "2.6.0", "2.4.0"]),
    # PYSEC-2026-139 (CVE-2026-4538): deserialization in torch.export.load's pt2 handler; no fixed release recorded,
    # last affected 2.10.0 (fix proposed in pytorch PR #176791); the next release on the index is 2.11.0.
    "PYSEC-2026-139": ("torch", "2.11.0", ["2.10.0"]),
    # MLflow server advisories, the last fixed in 3.13.0: GHSA-2cm6-r77w-6g96 (CVE-2026-8147, trace endpoints without
    # authorization, 2.14.0rc0-3.12), GHSA-fh64-r2vc-xvhr (3.11.1), GHSA-7qhf-v65m-g5f3 (3.11.0), 3.10.0's file read.
    "GHSA-2cm6-r77w-6g96": ("mlflow", "3.13.0", ["3.12.0", "3.11.1", "3.10.1", "3.9.0", "3.0.0", "2.22.4", "2.12.0"]),
}


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
    metadata = tomllib.loads((ENGINE / "pyproject.toml").read_text())["project"]
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


@pytest.mark.parametrize("advisory", ADVISORIES)
def test_the_ranges_and_pins_admit_no_release_an_advisory_names(advisory):
    name, fixed, affected = ADVISORIES[advisory]
    requirements = [r for r in dev_requirements() if canonicalize_name(r.name) == name]
    assert requirements, f"pyproject no longer requires {name}: drop its row here and in docs/reliability.md"
    for requirement in requirements:
        admitted = [version for version in affected if requirement.specifier.contains(version, prereleases=True)]
        assert not admitted, f"pyproject's {requirement} admits {admitted}, which {advisory} affects"
        assert requirement.specifier.contains(fixed), f"pyproject's {requirement} excludes {fixed}, clear of {advisory}"
    assert pins()[name] >= Version(fixed), f"constraints.txt pins {name}=={pins()[name]}, before {fixed} ({advisory})"


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
    # The file describes a `-c constraints.txt` install (CI's): an environment installed from the ranges alone holds
    # newer releases, which may pull in packages the pins do not (psutil, ipython-pygments-lexers): not its business.
    drifted = sorted(f"{name} {version} (pinned {pinned[name]})" for name, (version, _) in closure.items()
                     if name in pinned and pinned[name] != version)
    if drifted:
        pytest.skip(f"this environment was not installed with -c constraints.txt ({len(drifted)} differ: "
                    f"{', '.join(drifted[:3])}, ...); the pins are checked against pyproject's ranges only")
    unpinned = sorted(set(closure) - set(pinned))
    assert not unpinned, f"constraints.txt lacks {unpinned}, which pip install -e \".[dev]\" installs"
    for name, (_, requirements) in closure.items():  # the pins agree with every requirement met on the way
        for requirement in requirements:
            assert requirement.specifier.contains(pinned[name], prereleases=True), (
                f"{name}=={pinned[name]} vs {requirement}")


def test_ci_installs_with_the_constraints():
    # tests/test_readme.py checks that this line is the README's test command, verbatim.
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"# --- the README's test command, verbatim ---\n(.+)\n", ci).group(1)
    assert command.startswith('pip install -e "./engine[dev]" -e ".[dev]" -c constraints.txt && '), command


def test_jsonargparse_is_capped_below_5_which_removes_what_lightnings_cli_calls():
    # Lightning 2.6.6's CLI calls ArgumentParser.add_instantiator, instantiate_classes and dump(skip_none=...), which
    # jsonargparse 4.49 deprecated and 5.0 removes (Lightning #21900; canary in tests/test_compat.py).
    (requirement,) = [r for r in dev_requirements() if canonicalize_name(r.name) == "jsonargparse"]
    assert not requirement.specifier.contains("5.0.0", prereleases=True), requirement
    assert requirement.specifier.contains(pins()["jsonargparse"]), (requirement, pins()["jsonargparse"])
