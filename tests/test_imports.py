"""Every module of the package imports on its own, first, in a fresh interpreter (a circular import shows
only when the cycle is entered from the 'wrong' side: ``import specpilot.w12.gemv`` failed while
every test imported ``w12_gemm`` first)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import specpilot

PKG = Path(specpilot.__file__).parent

SCRIPT = r"""
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    for m in [m for m in sys.modules if m == "specpilot" or m.startswith("specpilot.")]:
        del sys.modules[m]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc().strip().splitlines()[-1])
print("\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_first():
    names = sorted("specpilot." + ".".join(p.relative_to(PKG).with_suffix("").parts)
                   for p in PKG.rglob("*.py") if p.name != "__init__.py" and p.name != "__main__.py")
    assert "specpilot.w12.gemv" in names and len(names) > 40
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *names], capture_output=True, text=True, timeout=600,
                          cwd=PKG.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


def test_every_module_imports_without_triton():
    """A CPU install without triton (the README's) imports every module: kernels fall back to their references
    (a module importing a Triton-only helper at import time broke the CLI there)."""
    names = sorted("specpilot." + ".".join(p.relative_to(PKG).with_suffix("").parts)
                   for p in PKG.rglob("*.py") if p.name != "__init__.py" and p.name != "__main__.py")
    blocked = "import sys\nsys.modules['triton'] = None\nsys.modules['triton.language'] = None\n"
    proc = subprocess.run([sys.executable, "-c", blocked + SCRIPT, *names], capture_output=True, text=True,
                          timeout=600, cwd=PKG.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
