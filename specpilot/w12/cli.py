"""``specpilot w12``: pack a checkpoint directory to W12 and verify one (§4.1; typer sub-app).

``verify`` exits 0 when every tensor and copied file is bit-exact, 1 when one is not (each mismatch is named); errors (missing manifest, truncated
or unreadable file) are one line with exit status 2 (see :mod:`specpilot.cli`); with ``--json`` stdout also gets one
object naming the error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(help="W12 lossless 12-bit weights: pack a checkpoint directory, verify one.", no_args_is_help=True, rich_markup_mode=None)


@app.command()
def pack(
    src: Path = typer.Argument(..., help="Safetensors checkpoint directory (any model)."),
    out: Path = typer.Argument(..., help="New or empty output directory."),
):
    """Convert the linear-layer bf16 weights of SRC to W12 in OUT and copy every other file unchanged."""
    from specpilot.w12.pack import pack_dir

    t = pack_dir(src, out)["totals"]
    print(f"{out}: {t['tensors_w12']} tensors W12, {t['tensors_raw']} kept raw (not bf16); "
          f"{t['weights']:,} weights at {t['bits_per_weight']:.4f} bits/weight, escape rate {t['escape_rate']:.3g}")


@app.command()
def verify(
    directory: Path = typer.Argument(..., help="W12 directory written by `specpilot w12 pack`."),
    source: Optional[Path] = typer.Option(None, "--source", help="Also compare every tensor with this source directory."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (on an error too: "
                                 "{\"directory\", \"bit_exact\": false, \"error\"}, besides the error line)."),
):
    """Restore every tensor and compare it bit for bit with its stored sha256 (and --source); check every copied
    tensor and file against its sha256 in w12.json."""
    from specpilot.errors import SpecPilotError
    from specpilot.w12.verify import verify_dir

    try:
        rep = verify_dir(directory, source)
    except (SpecPilotError, UnicodeError) as e:
        err = e if isinstance(e, SpecPilotError) else SpecPilotError(f"not valid UTF-8: {e}")
        if as_json:  # a script reading stdout gets an object with the reason, not nothing (the status stays 2)
            print(json.dumps({"directory": str(directory), "bit_exact": False, "error": str(err)}))
        raise err from None
    if as_json:
        print(json.dumps(rep))
    else:
        _print_table(rep)
    if not rep["bit_exact"]:
        sys.exit(1)


def _print_table(rep: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    tab = Table(show_footer=True)
    tab.add_column("tensor", footer="total")
    tab.add_column("shape")
    tab.add_column("encoding", footer=f"{rep['tensors_w12']} w12, {rep['tensors_raw']} raw")
    tab.add_column("bits/weight", justify="right", footer=f"{rep['bits_per_weight']:.4f}")
    tab.add_column("escapes", justify="right", footer=f"{rep['escapes']:,}")
    tab.add_column("escape rate", justify="right", footer=f"{rep['escape_rate']:.3g}")
    tab.add_column("bit-exact", footer="yes" if rep["bit_exact"] else "NO")
    for r in rep["tensors"]:
        ok = "yes" if r["bit_exact"] else f"NO ({r['error']})"
        tab.add_row(r["name"], "x".join(map(str, r["shape"])), f"{r['encoding']} ({r['dtype']})",
                    f"{r['bits_per_weight']:.4f}", f"{r['escapes']:,}", f"{r['escape_rate']:.3g}", ok)
    con = Console(width=max(120, Console().width))
    con.print(tab)
    ct, fl = rep.get("copied_tensors", []), rep.get("files", [])
    if ct:
        n_bad = sum(not r["bit_exact"] for r in ct)
        con.print(f"tensors copied unchanged: {len(ct)}, " + ("all match their sha256" if not n_bad else f"{n_bad} do NOT"))
    if fl:
        n_bad = sum(not r["ok"] for r in fl)
        con.print(f"files copied: {len(fl)}, " + ("all match their sha256" if not n_bad else f"{n_bad} do NOT"))
    if not rep["source_checked"]:
        con.print("bit-exact = equal to the sha256 stored at pack time (no --source given: the source itself was "
                  "not read)")
    if rep["source_checked"]:
        bad = rep.get("source_mismatches") or []
        con.print(f"unconverted tensors match the source: {'yes' if rep['unconverted_match_source'] else 'NO'}")
        if bad:
            con.print(f"{len(bad)} tensor(s) differ from --source, first: "
                      + ", ".join(f"{b['name']} ({b['reason']})" for b in bad[:5]), markup=False)
    for note in rep.get("not_checked", []):
        con.print(f"not checked: {note}", markup=False)
    for p in rep.get("problems", []):
        con.print(f"MISMATCH: {p}", markup=False)
