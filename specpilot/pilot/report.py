"""Report writer: ``report.json``, ``report.md`` and PNG plots of a pilot run (paper §3, §4).

Expected keys of the report dict (every one optional; missing parts are shown as "—" or skipped):

- ``device`` (str or dict), ``deployment`` (dict: target, drafter, dtype, batch, ...).
- ``ar_tokens_per_s``, ``stock_tokens_per_s``, ``sealed_tokens_per_s``: throughput (tokens/s).
- ``speedup_vs_ar``, ``speedup_vs_stock``: ratios; ``speedup_ci_low``: 95% lower bound of speedup_vs_ar;
  ``speedup_vs_stock_ci_low``: 95% lower bound of speedup_vs_stock (paired bootstrap, §3.3).
- ``tau``: tokens per exact pass of the sealed system; ``c``: its c(N) = T_step(N) / T_AR.
- ``sealed_label``, ``sealed_seal``: the sealed system's label and SHA-256 seal.
- ``ceiling``: ``{tree, kernel, outside}`` factors of the sealed system (§3.2).
- ``token_forcing``: ``{mismatch_rate, events, event_rate, delta, tokens, stock_mismatch_rate,
  stock_event_rate, passed}`` (§3.4; rates are fractions).
- ``sigma``: stock noise σ (fraction).
- ``entries``: memory entries, each an id string or a dict with ``id``, ``title``, ``gain``, ``requires``.
- ``candidates``: list of dicts ``{round, name, gain, lower_bound, bar, outputs_differ, forcing_passed,
  tau, c, approved, reason}``.
- ``rounds``: list of dicts ``{round, ceiling: {tree, kernel, outside}, attacked, tokens_per_s}``.
- ``tau_curve``: ``{builder: {N: tau}}``; ``c_curve``: ``{N: c}`` (N may be int or str).
- ``adversarial``: list of dicts ``{name, cheat, defence, gain, lower_bound, bar, outputs_differ,
  forcing_passed, approved, reason, defence_fired}`` (``pilot --adversarial``).

``plots`` may override the plot data: ``{"tau_vs_n": {builder: {N: tau}}, "c_vs_n": {N: c},
"ceiling": [{round, tree, kernel, outside}]}``; otherwise it is taken from the report.
"""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure

FACTORS = ("tree", "kernel", "outside")


def _num(x, fmt: str = "{:.3f}") -> str:
    """Format a number, or "—" when absent / not a number."""
    if isinstance(x, bool) or x is None:
        return "—" if x is None else ("yes" if x else "no")
    try:
        return fmt.format(float(x))
    except (TypeError, ValueError):
        return str(x)


def _pct(x) -> str:
    return _num(x, "{:.2%}")


def _jsonable(o):
    """JSON fallback: numpy scalars/arrays, pydantic models, paths, the rest as str."""
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "model_dump"):
        return o.model_dump(mode="json")
    return str(o)


def _curve(d) -> tuple[list[float], list[float]]:
    """Sorted (N, value) pairs of a ``{N: value}`` dict with int/str keys."""
    pts = sorted((float(k), float(v)) for k, v in (d or {}).items() if v is not None)
    return [p[0] for p in pts], [p[1] for p in pts]


def _headline(r: dict) -> list[str]:
    speed = r.get("speedup_vs_stock")
    rows = [
        "| system | tokens/s | speedup vs AR (95% lower bound) | speedup vs stock (95% lower bound) |",
        "|---|---:|---:|---:|",
        f"| AR | {_num(r.get('ar_tokens_per_s'), '{:.1f}')} | 1.000 | — |",
        f"| stock | {_num(r.get('stock_tokens_per_s'), '{:.1f}')} | {_stock_vs_ar(r)} | 1.000 |",
        f"| sealed | {_num(r.get('sealed_tokens_per_s'), '{:.1f}')} | {_num(r.get('speedup_vs_ar'))} "
        f"({_num(r.get('speedup_ci_low'))}) | {_num(speed)} ({_num(r.get('speedup_vs_stock_ci_low'))}) |",
        "",
        f"- τ (tokens per exact pass): **{_num(r.get('tau'))}**; c(N) = T_step / T_AR: **{_num(r.get('c'))}**",
    ]
    if r.get("sealed_label") or r.get("sealed_seal"):
        rows.append(f"- sealed system: `{r.get('sealed_label', '')}` seal `{str(r.get('sealed_seal', ''))[:16]}`")
    if r.get("sigma") is not None:
        rows.append(f"- stock noise σ: {_pct(r.get('sigma'))}")
    return rows


def _stock_vs_ar(r: dict) -> str:
    ar, st = r.get("ar_tokens_per_s"), r.get("stock_tokens_per_s")
    return _num(st / ar) if isinstance(ar, (int, float)) and isinstance(st, (int, float)) and ar else "—"


def _markdown(r: dict, images: list[str]) -> str:
    dev = r.get("device")
    dev = ", ".join(f"{k}: {v}" for k, v in dev.items()) if isinstance(dev, dict) else (dev or "—")
    md = ["# SpecPilot report", "", f"Device: {dev}", ""]
    if isinstance(r.get("deployment"), dict):
        md += ["Deployment: " + ", ".join(f"{k}: {v}" for k, v in r["deployment"].items()), ""]
    md += ["## Headline", "", *_headline(r), ""]
    ceil = r.get("ceiling") or {}
    if ceil:
        prod = 1.0
        for f in FACTORS:
            prod *= float(ceil.get(f) or 1.0)
        md += ["## Ceiling (§3.2)", "", "| tree | kernel | outside | product |", "|---:|---:|---:|---:|",
               f"| {' | '.join(_num(ceil.get(f)) for f in FACTORS)} | {_num(prod)} |", ""]
    tf = r.get("token_forcing") or {}
    if tf:
        md += ["## Token forcing (§3.4)", "",
               f"- δ = {_num(tf.get('delta'))} nats; events = mismatches with margin ≥ 2δ",
               f"- sealed: mismatch rate {_pct(tf.get('mismatch_rate'))}, events {tf.get('events', '—')}"
               f" ({_pct(tf.get('event_rate'))}) over {tf.get('tokens', '—')} tokens",
               f"- stock: mismatch rate {_pct(tf.get('stock_mismatch_rate'))}, "
               f"event rate {_pct(tf.get('stock_event_rate'))}",
               f"- passed: {_num(tf.get('passed'))}", ""]
    cands = r.get("candidates") or []
    if cands:
        md += ["## Candidates (§3.3)", "",
               "| round | candidate | gain | 95% low | bar | output differs | forcing | replay τ | screened c | verdict |",
               "|---:|---|---:|---:|---:|---|---|---:|---:|---|"]
        for c in cands:
            verdict = "approved" if c.get("approved") else "rejected"
            reason = str(c.get("reason", "")).replace("|", "/").removeprefix(verdict).lstrip(": ")
            md.append(f"| {c.get('round', '—')} | {c.get('name', '—')} | {_num(c.get('gain'))} | "
                      f"{_num(c.get('lower_bound'))} | {_pct(c.get('bar'))} | {_num(c.get('outputs_differ'))} | "
                      f"{_num(c.get('forcing_passed'))} | {_num((c.get('predicted') or {}).get('tau', c.get('tau')))} | {_num((c.get('predicted') or {}).get('c_screened') or (c.get('predicted') or {}).get('c', c.get('c')))} | "
                      f"{verdict}{': ' + reason if reason else ''} |")
        md.append("")
    rounds = r.get("rounds") or []
    if rounds:
        md += ["## Rounds", "", "| round | tree | kernel | outside | attacked | tokens/s |", "|---:|---:|---:|---:|---|---:|"]
        for rd in rounds:
            cl = rd.get("ceiling") or {}
            md.append(f"| {rd.get('round', '—')} | {' | '.join(_num(cl.get(f)) for f in FACTORS)} | "
                      f"{rd.get('attacked', '—')} | {_num(rd.get('tokens_per_s'), '{:.1f}')} |")
        md.append("")
    entries = r.get("entries") or []
    md += ["## Memory entries (§3.5)", ""]
    for e in entries:
        if isinstance(e, dict):
            req = ", ".join(e.get("requires") or []) or "—"
            md.append(f"- `{e.get('id', '?')}` {e.get('title', '')} (gain {_num(e.get('gain'))}; requires {req})")
        else:
            md.append(f"- `{e}`")
    if not entries:
        md.append("- none")
    md.append("")
    md += _adversarial(r.get("adversarial") or [])
    if images:
        md += ["## Plots", ""] + [f"![{Path(i).stem}]({i})" for i in images] + [""]
    return "\n".join(md)


def _adversarial(rows: list) -> list[str]:
    """Markdown of the adversarial check (``pilot --adversarial``): one line per cheating candidate."""
    if not rows:
        return []
    bad = [a["name"] for a in rows if a.get("approved")]
    md = ["## Adversarial candidates (§3.3)", "",
          ("**Every cheating candidate was rejected.**" if not bad else f"**APPROVED CHEATS: {', '.join(bad)}**"), "",
          "| candidate | what it does | gain | lower bound | bar | outputs differ | forcing | verdict | expected defence fired |",
          "|---|---|---:|---:|---:|---|---|---|---|"]
    for a in rows:
        md.append(f"| {a.get('name')} | {a.get('cheat')} | {_num(a.get('gain'))} | {_num(a.get('lower_bound'))} | "
                  f"{_pct(a.get('bar'))} | {_num(a.get('outputs_differ'))} | {_num(a.get('forcing_passed'))} | "
                  f"{'approved' if a.get('approved') else 'rejected'}: {a.get('reason')} | "
                  f"{_num(a.get('defence_fired'))} ({a.get('defence')}) |")
    return md + [""]


def _plot_tau(path: Path, data: dict) -> bool:
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    drew = False
    for builder, curve in (data or {}).items():
        x, y = _curve(curve)
        if x:
            ax.plot(x, y, marker="o", label=str(builder))
            drew = True
    if not drew:
        return False
    ax.set(xlabel="tree budget N (nodes)", ylabel="τ (tokens / exact pass)", title="τ vs N per tree builder")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return True


def _plot_c(path: Path, data: dict) -> bool:
    x, y = _curve(data)
    if not x:
        return False
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    ax.plot(x, y, marker="o")
    ax.set(xlabel="rows verified N", ylabel="c(N) = T_step(N) / T_AR", title="relative step cost c(N)")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return True


def _plot_ceiling(path: Path, rounds: list) -> bool:
    rows = [(str(rd.get("round", i)), rd.get("ceiling", rd)) for i, rd in enumerate(rounds or [])]
    rows = [(n, c) for n, c in rows if isinstance(c, dict) and any(c.get(f) is not None for f in FACTORS)]
    if not rows:
        return False
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    w = 0.8 / len(FACTORS)
    for j, f in enumerate(FACTORS):
        ax.bar([i + j * w for i in range(len(rows))], [float(c.get(f) or 0.0) for _, c in rows], w, label=f)
    ax.set_xticks([i + w for i in range(len(rows))], [f"round {n}" for n, _ in rows])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(ylabel="ceiling factor (×)", title="ceiling factors per round")
    ax.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return True


def write_report(out_dir: str | Path, report: dict, plots: dict | None = None) -> dict[str, Path]:
    """Write ``report.json``, ``report.md`` and the PNG plots into ``out_dir`` (created if needed).

    Args:
        out_dir: report directory.
        report: the report dict (keys in the module docstring; all optional).
        plots: optional plot data overriding the report's ``tau_curve`` / ``c_curve`` / ``rounds``.
    Returns:
        ``{name: path}`` of every file written (``report.json``, ``report.md`` and each plot drawn; a plot
        without data is skipped).
    Raises:
        OSError: when ``out_dir`` cannot be written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = plots or {}
    written: dict[str, Path] = {}
    for name, fn, data in (
        ("tau_vs_n.png", _plot_tau, plots.get("tau_vs_n", report.get("tau_curve"))),
        ("c_vs_n.png", _plot_c, plots.get("c_vs_n", report.get("c_curve"))),
        ("ceiling.png", _plot_ceiling, plots.get("ceiling", report.get("rounds"))),
    ):
        if fn(out / name, data):
            written[name] = out / name
    (out / "report.json").write_text(json.dumps(report, indent=2, default=_jsonable) + "\n")
    written["report.json"] = out / "report.json"
    (out / "report.md").write_text(_markdown(report, [n for n in written if n.endswith(".png")]))
    written["report.md"] = out / "report.md"
    return written
