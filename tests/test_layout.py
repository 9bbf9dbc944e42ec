"""The house stays livable: docs/design.md shows the package tree as it is, files stay short, the product says why
rather than when, and nothing imports a probe script."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specpilot"


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        out = None
    if out is None or out.returncode != 0 or not out.stdout.strip():
        pytest.skip("not a git checkout")
    return out.stdout.split()


def _tree_block() -> tuple[dict[str, set[str]], set[str]]:
    """docs/design.md's tree as ``({directory: names listed in it}, top-level names)``. A line holds names separated
    by two spaces, then (after three or more) a description; indentation nests names under the last directory
    (a name ending in ``/``) of a shallower line."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("## The tree (`git ls-files`)", 1)[1].split("```", 2)[1]
    listed: dict[str, set[str]] = {}
    stack: list[tuple[int, str]] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = "/".join(d for _, d in stack)
        for name in re.split(r"\s{3,}", line.strip(), maxsplit=1)[0].split():
            listed.setdefault(parent, set()).add(name.rstrip("/"))
            if name.endswith("/"):
                stack.append((indent, name.rstrip("/")))
    top = {n.split("/")[0] for n in listed.get("", set())}
    return listed, top


def test_design_tree_lists_every_package_module_and_nothing_else():
    tracked = _tracked()
    listed, top = _tree_block()
    modules = [f for f in tracked if f.startswith("specpilot/") and f.endswith(".py")
               and not (f.endswith("/__init__.py") and f.count("/") > 1)]  # a sub-package's face goes unlisted
    missing = [f for f in modules if Path(f).name not in listed.get(str(Path(f).parent), set())]
    assert not missing, f"docs/design.md's tree lacks {missing}"
    for d, names in listed.items():
        for n in names:
            p = ROOT / d / n
            assert p.exists(), f"docs/design.md lists {d}/{n}, which does not exist"
    tops = {f.split("/")[0] for f in tracked}
    assert tops <= top, f"top-level entries not in docs/design.md's tree: {sorted(tops - top)}"


def test_no_package_file_is_over_400_lines():
    long = {str(f.relative_to(ROOT)): n for f in PACKAGE.rglob("*.py")
            if (n := len(f.read_text().splitlines())) > 400}
    assert not long, long


def test_product_says_why_not_when():
    pat = re.compile(r"\b(session|issue)[ _#]?\d+", re.I)
    hits = [f"{f.relative_to(ROOT)}:{i}" for f in [*PACKAGE.rglob("*.py"), ROOT / "README.md"]
            for i, line in enumerate(f.read_text().splitlines(), 1) if pat.search(line)]
    assert not hits, hits


def test_nothing_imports_a_probe():
    bad = []
    for f in [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        tree = ast.parse(f.read_text())
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "probes":
                bad.append(str(f))
            if isinstance(n, ast.Import) and any(a.name.split(".")[0] == "probes" for a in n.names):
                bad.append(str(f))
        if "sys.path" in f.read_text() and re.search(r"sys\.path\.\w+\([^)]*probes", f.read_text()):
            bad.append(str(f))
    assert not bad, bad
