"""Provenance of results and artifacts: the repository commit and library versions."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def git_commit(repo: Path | None = None) -> str:
    """``git rev-parse HEAD`` of the repository holding this package, ``-dirty`` when tracked files changed.

    ``SPECPILOT_COMMIT``, when set, wins: a working tree copied to a GPU machine may carry a stale
    ``.git`` of an older commit with every later change showing as ``-dirty``. Next, in a non-editable
    install (``pip install .``), the commit its build recorded (``specpilot/BUILD_COMMIT``, see setup.py);
    then git; else ``unknown``.
    """
    if os.environ.get("SPECPILOT_COMMIT"):
        return os.environ["SPECPILOT_COMMIT"]
    built = Path(__file__).resolve().parent / "BUILD_COMMIT"  # written by setup.py into non-editable installs
    if repo is None and built.is_file() and (recorded := built.read_text().strip()):
        return recorded
    cwd = repo or Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                                capture_output=True, text=True, timeout=10)
            return head.stdout.strip() + ("-dirty" if st.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def versions() -> dict:
    """Versions of python, torch, transformers, triton (if present) and specpilot, for JSON results."""
    import torch
    import transformers

    from specpilot import __version__

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "specpilot": __version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out
