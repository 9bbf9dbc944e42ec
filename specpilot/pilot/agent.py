"""External coding agent (§3.3): a command that reads a brief and edits a scratch git worktree; the diff is
the candidate patch, judged like any candidate (controller + token forcing, in a worker on its tree).

``--agent 'CMD ... {brief} {worktree}'`` is a command template: ``{brief}`` becomes the path of
``brief.md`` (``brief.json`` lies next to it), ``{worktree}`` the scratch worktree (both shell-quoted);
it runs through the shell with its working directory the worktree and a timeout. The worktree is a
``git clone --shared`` of the package's repository (no writes to it) checked out at the stock commit, with
the incumbent's code patches applied and committed as the base. The patch is ``git diff --binary`` of
everything the agent left in the worktree (untracked files included) against that base.

Rejected before any run (:class:`AgentRejected`, the reason goes to the report): an agent that fails
(non-zero exit) or times out, an empty patch, a patch touching a file outside :data:`ALLOWED` (never
``specpilot/pilot/``: the controller, forcing, workers, memory).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from specpilot.errors import SpecPilotError

#: Directories an agent's patch may change (prefixes of repository paths): the engine, the model, the drafters,
#: lattices and trees, W12, the certified head and the shared kernels. Never the pilot (:data:`FORBIDDEN`).
ALLOWED = ("specpilot/engine/", "specpilot/model/", "specpilot/spec/", "specpilot/w12/", "specpilot/head/",
           "specpilot/kernels/")
FORBIDDEN = ("specpilot/pilot/",)


class AgentRejected(SpecPilotError):
    """The agent's patch is not judged: it failed, timed out, returned nothing or touched a file outside
    the allowlist. The message is the one-line reason."""


@dataclass(frozen=True)
class AgentPatch:
    """An agent's candidate: ``patch`` (git diff text against stock + the incumbent's patches), ``files``
    (paths it changes), ``tree`` (git tree id of the patched code, stock + all patches), ``worktree``
    (where the patched code is, for the worker) and the agent's output tail ``log``."""

    patch: str
    files: tuple[str, ...]
    tree: str
    worktree: Path
    log: str


def _git(cwd: Path, *args: str, stdin: str | None = None) -> str:
    r = subprocess.run(["git", "-C", str(cwd), *args], input=stdin, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise SpecPilotError(f"git {args[0]} in {cwd}: {(r.stderr.strip().splitlines() or ['failed'])[-1]}")
    return r.stdout


def prepare_worktree(repo: Path, commit: str, patches: Sequence[tuple[str, str]], dest: Path) -> str:
    """Scratch worktree ``dest``: a shared clone of ``repo`` at ``commit`` with ``patches`` (name, text)
    applied in order and committed; returns the base commit id (in ``dest``).

    Raises:
        SpecPilotError: ``dest`` exists, ``repo`` is no git repository holding ``commit``, or a patch does
            not apply.
    """
    if dest.exists():
        raise SpecPilotError(f"agent worktree {dest} already exists")
    dest.parent.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["git", "clone", "--quiet", "--shared", "--no-checkout", str(repo), str(dest)],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise SpecPilotError(f"--agent needs specpilot in a git checkout: {(r.stderr.strip().splitlines() or ['git clone failed'])[-1]}")
    _git(dest, "checkout", "--quiet", "--detach", commit)
    for name, text in patches:
        r = subprocess.run(["git", "-C", str(dest), "apply", "--index", "--whitespace=nowarn", "-"], input=text,
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise SpecPilotError(f"incumbent patch {name} does not apply to {commit[:12]}: {r.stderr.strip()[:200]}")
    if patches:
        _git(dest, "-c", "user.name=specpilot", "-c", "user.email=specpilot@localhost", "commit", "--quiet",
             "--no-verify", "-m", "incumbent: " + ", ".join(n for n, _ in patches))
    return _git(dest, "rev-parse", "HEAD").strip()


def write_brief(dest: Path, brief: dict) -> Path:
    """Write ``brief.json`` and a readable ``brief.md`` into ``dest``; returns the path of ``brief.md``.

    ``brief`` holds: ``goal``, ``cost_model`` (ceiling factors and detail), ``gap`` (ceiling / current),
    ``incumbent``, ``memory`` (entries so far), ``allowed`` / ``forbidden`` (path prefixes), ``contract``.
    """
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "brief.json").write_text(json.dumps(brief, indent=2, default=str))
    lines = ["# SpecPilot agent brief", "", brief.get("goal", ""), "",
             "## Files you may change", *[f"- `{p}`" for p in brief.get("allowed", ())], "",
             "Never change: " + ", ".join(f"`{p}`" for p in brief.get("forbidden", ())), "",
             f"Contract: {brief.get('contract', '')}", "",
             "## Cost model (ceiling factors, §3.2)", "```json", json.dumps(brief.get("cost_model"), indent=2, default=str), "```",
             f"Gap to the ceiling: {brief.get('gap')}", "", f"Incumbent: {brief.get('incumbent')}", "",
             "## Memory entries", *([f"- {m}" for m in brief.get("memory", ())] or ["- (none)"]), ""]
    md = dest / "brief.md"
    md.write_text("\n".join(lines))
    return md


def run_agent(template: str, brief: Path, worktree: Path, base: str, timeout_s: float) -> AgentPatch:
    """Run the agent command and take its patch (see the module doc).

    Args:
        template: command with ``{brief}`` and ``{worktree}`` placeholders. brief: path of brief.md.
        worktree / base: the scratch worktree and its base commit (:func:`prepare_worktree`).
        timeout_s: seconds the agent may run (its whole process group is killed after).
    Returns:
        :class:`AgentPatch`.
    Raises:
        AgentRejected: failure, timeout, empty patch or a file outside the allowlist.
        SpecPilotError: a template with an unknown placeholder.
    """
    try:
        cmd = template.format(brief=shlex.quote(str(brief)), worktree=shlex.quote(str(worktree)))
    except (KeyError, IndexError, ValueError) as e:
        raise SpecPilotError(f"--agent template: unknown or bad placeholder {e} (use {{brief}} and {{worktree}})") from None
    proc = subprocess.Popen(cmd, shell=True, cwd=worktree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AgentRejected(f"agent timed out after {timeout_s:g} s") from None
    log = "\n".join(out.strip().splitlines()[-20:])
    if proc.returncode != 0:
        last = (out.strip().splitlines() or ["no output"])[-1]
        raise AgentRejected(f"agent failed (exit code {proc.returncode}): {last[:200]}")
    _git(worktree, "add", "-A")
    files = tuple(f for f in _git(worktree, "diff", "--cached", "--name-only", base).splitlines() if f)
    if not files:
        raise AgentRejected("agent returned an empty patch")
    bad = [f for f in files if f.startswith(FORBIDDEN) or not f.startswith(ALLOWED)]
    if bad:
        raise AgentRejected(f"patch touches files outside the allowlist: {', '.join(bad[:5])}")
    patch = _git(worktree, "diff", "--cached", "--binary", base)
    return AgentPatch(patch, files, _git(worktree, "write-tree").strip(), worktree, log)
