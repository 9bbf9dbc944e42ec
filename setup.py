"""Build hook (setuptools): write the source tree's git commit into the built package as
``specpilot/BUILD_COMMIT``, so that a non-editable install (``pip install .``, the README's first command)
still names the commit its results came from (:func:`specpilot.provenance.git_commit`). Everything else is
in pyproject.toml."""

import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


def _commit(src: Path) -> str | None:
    """``git rev-parse HEAD`` of ``src`` plus ``-dirty`` when tracked files changed; None without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=src, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=src, capture_output=True,
                            text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if st.stdout.strip() else "")


class BuildPyWithCommit(build_py):
    """``build_py`` that also writes ``BUILD_COMMIT`` next to the built package's ``__init__.py``."""

    def run(self):
        super().run()
        if self.dry_run:
            return
        commit = _commit(Path(__file__).resolve().parent)
        out = Path(self.build_lib) / "specpilot" / "BUILD_COMMIT"
        if commit is None:  # no git here: ship no commit rather than a stale one left in build/ by an earlier build
            out.unlink(missing_ok=True)
            return
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(commit + "\n")


setup(cmdclass={"build_py": BuildPyWithCommit})
