"""pyproject's dependency ranges: honest (the torch versions we run) and installable here."""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
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


def test_a_built_package_names_its_commit(tmp_path):
    """Fresh-user finding: ``pip install .`` (the README's first command) gave ``commit: unknown`` in every
    result, since an installed package is not a git checkout. setup.py's build step writes the commit into
    the package (``specpilot/BUILD_COMMIT``); ``git_commit`` reads it there, outside any repository."""
    import os
    import subprocess
    import sys

    from specpilot.provenance import git_commit

    pytest.importorskip("setuptools")  # setup.py's build step needs it (pip's build environment has it)
    root = PYPROJECT.parent
    expected = git_commit(root)
    if expected == "unknown":
        pytest.skip("not a git checkout: the build has no commit to record")
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path / "lib")], cwd=root,
                   check=True, capture_output=True, timeout=300)
    recorded = (tmp_path / "lib" / "specpilot" / "BUILD_COMMIT").read_text().strip()
    assert recorded == expected
    env = {k: v for k, v in os.environ.items() if k != "SPECPILOT_COMMIT"} | {"PYTHONPATH": str(tmp_path / "lib")}
    got = subprocess.run([sys.executable, "-c", "import specpilot.provenance as p; print(p.__file__); print(p.git_commit())"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert got[0].startswith(str(tmp_path)) and got[1] == recorded
