"""``specpilot memory list|show|check DIR``: read and verify a memory directory (paper §3.5).

``check`` exits with status 1 when an entry fails its reproduction check (differs, does not apply,
broken), and 2 when the directory holds no entry (a check of nothing must not read as a pass); entries that are
honestly *not checkable* (a code entry whose stock commit is not in the repository) are reported as such and do
not fail it. ``list`` is an inventory: a directory without entries is a true answer ("no entries", ``[]`` with
``--json``, status 0, as ``ls`` of an empty directory). Bad input (no such directory, an id that is not a plain
entry id, no such entry) is a one-line error with status 2 (:class:`~specpilot.errors.SpecPilotError`) for all
three.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from specpilot.errors import SpecPilotError
from specpilot.pilot.memory import Memory, MemoryEntryError

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Memory of verified entries (§3.5): list, show, reproduction check.")


def _memory(directory: Path) -> Memory:
    if not directory.is_dir():
        what = "is a file, not a memory directory" if directory.exists() else "not found"
        raise SpecPilotError(f"memory directory {directory}: {what}")
    mem = Memory(directory)
    if not mem.ids() and (directory / "memory").is_dir():  # a pilot's report directory
        raise SpecPilotError(f"{directory} holds no memory entries; its memory/ directory may: "
                             f"give {directory / 'memory'}")
    return mem


def _check_repo(repo: Path) -> None:
    """Raise SpecPilotError (one line) unless ``repo`` is a directory inside a git work tree."""
    import subprocess

    if not repo.is_dir():
        what = "is a file, not a directory" if repo.exists() else "directory not found"
        raise SpecPilotError(f"--repo {repo}: {what} (give the git checkout holding the stock commit)")
    try:
        r = subprocess.run(["git", "-C", str(repo), "rev-parse", "--git-dir"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return  # no usable git here: reproduce() reports code entries as not checkable
    if r.returncode != 0:
        raise SpecPilotError(f"--repo {repo} is not a git repository (give the git checkout holding the stock commit)")


@app.command("list")
def list_cmd(directory: Path = typer.Argument(..., help="Memory directory (one sub-directory per entry)."),
             as_json: bool = typer.Option(False, "--json", help="Print a JSON list.")):
    """One line per entry: id, kind, mechanism, requirements, evidence, origin. Exit status 0, also for a
    directory without entries ("no entries", as ls; check exits 2 there: a check of nothing is no pass); 1 when an
    entry is corrupted (listed with its error), so scripts notice; 2 when the directory does not exist."""
    mem = _memory(directory)
    rows = []
    for i in mem.ids():
        try:
            e = mem.get(i)
            rows.append({"id": e.id, "kind": e.kind, "mechanism": e.mechanism, "requires": e.requires,
                         "gain": e.evidence.gain, "lower_bound": e.evidence.lower_bound, "date": e.evidence.date,
                         "reused_from": e.reused_from, "title": e.title})
        except MemoryEntryError as err:
            rows.append({"id": i, "error": str(err)})
    broken = [r["id"] for r in rows if "error" in r]
    if as_json:
        print(json.dumps(rows))
        raise typer.Exit(1 if broken else 0)
    if not rows:
        print(f"no entries in {directory}")
        return
    t = Table("id", "kind", "mechanism", "requires", "gain (95% lower bound)", "date", "reused from")
    for r in rows:
        if "error" in r:
            t.add_row(r["id"], "—", f"[red]{r['error']}[/]", "", "", "", "")
        else:
            t.add_row(r["id"], r["kind"], r["mechanism"], ", ".join(r["requires"]) or "—",
                      f"{r['gain']:.3f} ({r['lower_bound']:.3f})", r["date"], r["reused_from"] or "new")
    Console(width=200).print(t)
    if broken:
        print(f"error: {len(broken)} corrupted entr{'y' if len(broken) == 1 else 'ies'}: {', '.join(broken)}",
              file=sys.stderr)
        raise typer.Exit(1)


@app.command()
def show(directory: Path = typer.Argument(..., help="Memory directory."),
         entry_id: str = typer.Argument(..., help="Entry id (its sub-directory name)."),
         as_json: bool = typer.Option(False, "--json", help="Print the entry as one JSON object.")):
    """The whole entry: metadata, evidence and the delta (config fields or the patch text)."""
    e = _memory(directory).get(entry_id)
    data = e.model_dump(mode="json")
    if as_json:
        print(json.dumps(data))
        return
    for key in ("id", "title", "mechanism", "kind", "requires", "contract", "variants", "options", "base",
                "system", "limits", "not_verified", "reused_from"):
        print(f"{key}: {json.dumps(data[key])}")
    print("evidence: " + json.dumps(data["evidence"], indent=2))
    print("delta:")
    print(e.delta if e.kind == "patch" else json.dumps(e.delta, indent=2, sort_keys=True))


@app.command()
def check(directory: Path = typer.Argument(..., help="Memory directory."),
          repo: Optional[Path] = typer.Option(None, help="Git repository holding the stock commit of code entries (default: this package's checkout)."),
          as_json: bool = typer.Option(False, "--json", help="Print a JSON list of results.")):
    """Rebuild every entry from stock + its requirements + its delta and compare with the recorded system."""
    mem = _memory(directory)
    if repo is not None:
        _check_repo(repo)
    if not mem.ids():  # a check of nothing must not read as a pass
        raise SpecPilotError(f"no memory entries in {directory}: nothing to check")
    res = [mem.reproduce(i, repo) for i in mem.ids()]
    if as_json:
        print(json.dumps([{"id": r.id, "kind": r.kind, "status": r.status, "detail": r.detail} for r in res]))
    else:
        t = Table("id", "kind", "status", "detail")
        for r in res:
            color = "green" if r.ok else ("yellow" if not r.failed else "red")
            t.add_row(r.id, r.kind, f"[{color}]{r.status}[/]", r.detail)
        con = Console(width=200)
        con.print(t)
        n_ok, n_nc = sum(r.ok for r in res), sum(r.status == "not checkable" for r in res)
        con.print(f"{n_ok} reproduced, {n_nc} not checkable, {sum(r.failed for r in res)} failed of {len(res)} entries")
    if any(r.failed for r in res):
        raise typer.Exit(1)
