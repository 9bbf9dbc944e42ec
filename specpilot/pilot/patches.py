"""Code deltas of memory entries: rebuild a source tree from stock + patches with git (paper §3.5).

A code entry stores a patch (``git diff`` output) against stock with its required entries applied, the
stock commit, and the git tree id of the approved system's code. :func:`rebuild_tree` applies the chain
to the stock commit in a scratch index (``GIT_INDEX_FILE`` in a temporary directory, ``git apply
--cached``: no checkout, the repository's own index and work tree are untouched) and returns the tree id
that ``git write-tree`` gives, so reproduction is an exact comparison of tree ids.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


@dataclass(frozen=True)
class Rebuild:
    """Outcome of :func:`rebuild_tree`: ``status`` is ``built`` (``tree`` is the id), ``not checkable``
    (no git, or the stock commit is not in the repository) or ``does not apply`` (``detail`` names the
    patch and git's message)."""

    status: str
    tree: str | None = None
    detail: str = ""


def _git(repo: Path, args: list[str], env: dict | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], input=stdin, capture_output=True, text=True, env=env,
                          timeout=60)


def rebuild_tree(repo: str | Path, base_commit: str, patches: Sequence[tuple[str, str]]) -> Rebuild:
    """Apply ``patches`` in order to ``base_commit`` of ``repo`` in a scratch index; return the tree id.

    Args:
        repo: a git repository (work tree or bare) holding ``base_commit``.
        base_commit: the stock commit (any revision git accepts).
        patches: ``(name, patch text)`` in application order (required entries first).
    Returns:
        :class:`Rebuild`. Never raises for a bad patch or a missing commit: those are statuses.
    """
    try:
        ok = _git(Path(repo), ["cat-file", "-e", f"{base_commit}^{{commit}}"])
    except (OSError, subprocess.SubprocessError) as e:
        return Rebuild("not checkable", detail=f"git is not usable here ({e})")
    if ok.returncode != 0:
        return Rebuild("not checkable", detail=f"stock commit {base_commit[:12]} is not in {repo}")
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        r = _git(Path(repo), ["read-tree", base_commit], env)
        if r.returncode != 0:
            return Rebuild("not checkable", detail=f"git read-tree {base_commit[:12]}: {r.stderr.strip()[:200]}")
        for name, text in patches:
            r = _git(Path(repo), ["apply", "--cached", "--whitespace=nowarn", "-"], env, stdin=text)
            if r.returncode != 0:
                first = (r.stderr.strip().splitlines() or ["git apply failed"])[0]
                return Rebuild("does not apply", detail=f"{name}: {first}")
        r = _git(Path(repo), ["write-tree"], env)
        if r.returncode != 0:
            return Rebuild("not checkable", detail=f"git write-tree: {r.stderr.strip()[:200]}")
        return Rebuild("built", tree=r.stdout.strip())


def tree_of(repo: str | Path, rev: str = "HEAD") -> str:
    """The tree id of revision ``rev`` in ``repo`` (to record an approved system's code).

    Raises:
        ValueError: ``rev`` is not a commit of ``repo`` (or git is unusable).
    """
    try:
        r = _git(Path(repo), ["rev-parse", f"{rev}^{{tree}}"])
    except (OSError, subprocess.SubprocessError) as e:
        raise ValueError(f"git is not usable here ({e})") from None
    if r.returncode != 0:
        raise ValueError(f"{rev} is not a commit of {repo}")
    return r.stdout.strip()


def head_state(repo: str | Path, paths: Sequence[str] = ()) -> tuple[str, str, bool]:
    """``(HEAD commit, HEAD tree id, dirty)`` of the checkout ``repo``; ``dirty``: tracked files (under
    ``paths``, or anywhere) differ from HEAD.

    Raises:
        ValueError: ``repo`` is not a git checkout (or git is unusable).
    """
    try:
        head = _git(Path(repo), ["rev-parse", "HEAD", "HEAD^{tree}"])
        status = _git(Path(repo), ["status", "--porcelain", "--untracked-files=no", "--", *paths])
    except (OSError, subprocess.SubprocessError) as e:
        raise ValueError(f"git is not usable here ({e})") from None
    if head.returncode != 0:
        raise ValueError(f"{repo} is not a git checkout")
    commit, tree = head.stdout.split()
    return commit, tree, bool(status.stdout.strip())
