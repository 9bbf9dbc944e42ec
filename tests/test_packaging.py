"""pyproject's dependency ranges: honest (the torch versions we run) and installable here."""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _requirements() -> dict[str, Requirement]:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    return {r.name: r for r in map(Requirement, deps)}


def test_torch_range_is_the_one_the_readme_states():
    """Fresh-user finding: pyproject said torch>=2.4 while the README says 2.11-2.13."""
    spec = _requirements()["torch"].specifier
    for ok in ("2.11.0", "2.12.1", "2.13.0"):
        assert spec.contains(ok), ok
    for bad in ("2.4.0", "2.10.0", "2.14.0", "3.0.0"):
        assert not spec.contains(bad), bad
    assert "2.11" in (PYPROJECT.parent / "README.md").read_text()


def test_every_dependency_is_bounded_below_and_satisfied_here():
    for name, req in _requirements().items():
        assert any(s.operator in (">=", "==", "~=") for s in req.specifier), f"{name}: no lower bound"
        try:
            have = version(name)
        except PackageNotFoundError:
            continue
        assert req.specifier.contains(have.split("+")[0], prereleases=True), f"{name} {have} outside {req.specifier}"
