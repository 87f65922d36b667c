"""The core requirements install into a GPU user's stack: no upper bound on torch, transformers or peft.

The pins of this machine's CPU vLLM build live with the ``vllm`` extra and in ``constraints/cpu.txt``
(what ``scripts/setup.sh`` installs); the core's lower bounds are exactly those versions, so the suite tests
them; ``constraints/newest.txt`` (``scripts/setup-newest.sh``, run by ``.ci/run``) pins the newest releases,
which the core must admit. Read from pyproject.toml and from the installed project's metadata.
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).parents[1]
BOUNDED = ("torch", "transformers", "peft")  # a user's stack decides these


def core_requirements() -> dict[str, Requirement]:
    """Name → requirement of pyproject.toml's ``[project] dependencies``."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {(r := Requirement(d)).name: r for d in deps}


def pins(path: Path) -> dict[str, Version]:
    """Name → version of a constraints file's ``name==version`` lines (a ``+local`` part dropped)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[name.strip().lower()] = Version(Version(version.strip()).base_version)
    return out


def upper_bounds(req: Requirement) -> list[str]:
    return [str(s) for s in req.specifier if s.operator in ("<", "<=", "==", "===", "~=")]


@pytest.mark.parametrize("name", BOUNDED)
def test_core_requirement_has_no_upper_bound(name):
    req = core_requirements()[name]
    assert req.marker is None and not req.extras, req
    assert not upper_bounds(req), f"pyproject.toml core requirement {req} puts an upper bound on {name}; " \
                                  f"a pin only this machine needs belongs to an extra or constraints/cpu.txt"


def test_installed_metadata_has_no_upper_bound():
    try:
        requires = importlib.metadata.requires("weightsync") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("weightsync is not installed (pip install -e .): pyproject.toml is checked above")
    core = [Requirement(r) for r in requires if "extra ==" not in r]
    bounded = {r.name: upper_bounds(r) for r in core if r.name in BOUNDED}
    assert bounded.keys() == set(BOUNDED), f"installed metadata lacks {set(BOUNDED) - bounded.keys()}"
    assert not any(bounded.values()), f"installed weightsync caps {bounded} (reinstall: bash scripts/setup.sh)"


@pytest.mark.parametrize("name", BOUNDED)
def test_lower_bound_is_the_version_this_machine_tests(name):
    req, cpu = core_requirements()[name], pins(ROOT / "constraints" / "cpu.txt")
    lower = [Version(s.version) for s in req.specifier if s.operator == ">="]
    assert lower == [cpu[name]], f"{req}: its lower bound must be constraints/cpu.txt's {name}=={cpu[name]}, " \
                                 f"the version scripts/setup.sh installs and the suite runs on"


@pytest.mark.parametrize("name", BOUNDED)
def test_core_admits_the_newest_pinned_release(name):
    req, newest = core_requirements()[name], pins(ROOT / "constraints" / "newest.txt")
    assert newest[name] in req.specifier, f"{req} refuses constraints/newest.txt's {name}=={newest[name]}"


def test_vllm_extra_carries_the_cpu_build_pins():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    vllm = {(r := Requirement(d)).name: r for d in extras["vllm"]}
    cpu = pins(ROOT / "constraints" / "cpu.txt")
    assert cpu["torch"] in vllm["torch"].specifier and cpu["transformers"] in vllm["transformers"].specifier
    assert upper_bounds(vllm["transformers"]), "the vLLM CPU build's transformers cap belongs to its extra"
