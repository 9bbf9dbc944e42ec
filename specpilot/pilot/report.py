"""Report writer: ``report.json``, ``report.md`` and PNG plots of a pilot run (paper §3, §4).

Expected keys of the report dict (every one optional; missing parts are shown as "—" or skipped):

- ``device`` (str or dict), ``deployment`` (dict: target, drafter, dtype, batch, ...).
- ``ar_tokens_per_s``, ``stock_tokens_per_s``, ``sealed_tokens_per_s``: throughput (tokens/s).
- ``speedup_vs_ar``, ``speedup_vs_stock``: ratios; ``speedup_ci_low``: 95% lower bound of speedup_vs_ar;
  ``speedup_vs_stock_ci_low``: 95% lower bound of speedup_vs_stock (paired bootstrap, §3.3).
- ``benchmarks``: ``{name: {requests, ar_tokens_per_s, stock_tokens_per_s, sealed_tokens_per_s, vs_ar,
  vs_ar_low, vs_stock, vs_stock_low}}`` from the seal's interleaved run (lower bounds None for a
  benchmark of one request); drawn as ``speedup.png``.
- ``tau``: tokens per exact pass of the sealed system; ``c``: its c(N) = T_step(N) / T_AR; ``ar_step_ms``,
  ``step_ms``, ``stock_c``, ``steps_method``: where they come from (one interleaved run).
- ``sealed_label``, ``sealed_seal``: the sealed system's label and SHA-256 seal.
- ``ceiling``: ``{tree, kernel, outside}`` factors of the sealed system (§3.2).
- ``token_forcing``: ``{mismatch_rate, events, event_rate, delta, tokens, stock_mismatch_rate,
  stock_event_rate, passed}`` (§3.4; rates are fractions).
- ``sigma``: stock noise σ (fraction).
- ``entries``: memory entries, each an id string or a dict with ``id``, ``title``, ``gain``, ``requires``.
- ``candidates``: list of dicts ``{round, name, gain, lower_bound, bar, outputs_differ, forcing_passed,
  mismatch_rate, predicted: {tau, c, c_screened}, approved, reason, entry, superseded_by, reused_from}``.
- ``rounds``: list of dicts ``{round, ceiling: {tree, kernel, outside}, attacked, incumbent, tau, c,
  tokens_per_s}`` (round 0 when AR was judged against stock).
- ``reused`` / ``memory_source``: per entry of an earlier memory (``--memory``): ``{id, status, reason,
  config, gain, lower_bound, entry}``.
- ``tau_curve``: ``{builder: {N: tau}}``; ``c_curve``: ``{N: c}`` (N may be int or str); ``c_curve_method``;
  ``c_measured``: ``[{label, N, c, source}]`` measured points drawn on the c plot.
- ``execution``: ``{mode: local | workers, slots: [[device, ...]], paired_devices, agent}`` (where the
  controller's runs ran: one slot judges one candidate; a two-device slot runs A and B on one device each,
  swapped half way).
- ``adversarial``: list of dicts ``{name, cheat, defence, gain, lower_bound, bar, outputs_differ,
  forcing_passed, approved, reason, defence_fired}`` (``pilot --adversarial``).

``plots`` may override the plot data: ``{"speedup": benchmarks, "tau_vs_n": {builder: {N: tau}}, "c_vs_n": {N: c},
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


def _label(r: dict, key: str) -> str:
    """`` (`label`)`` of a headline system when the report names it, else ''."""
    return f" (`{r[key]}`)" if r.get(key) else ""


def _headline(r: dict) -> list[str]:
    speed = r.get("speedup_vs_stock")
    rows = [
        "| system | tokens/s | speedup vs AR (95% lower bound) | speedup vs stock (95% lower bound) |",
        "|---|---:|---:|---:|",
        f"| AR | {_num(r.get('ar_tokens_per_s'), '{:.1f}')} | 1.000 | — |",
        f"| stock{_label(r, 'stock_label')} | {_num(r.get('stock_tokens_per_s'), '{:.1f}')} | {_stock_vs_ar(r)} | 1.000 |",
        f"| sealed{_label(r, 'sealed_label')} | {_num(r.get('sealed_tokens_per_s'), '{:.1f}')} | {_num(r.get('speedup_vs_ar'))} "
        f"({_num(r.get('speedup_ci_low'))}) | {_num(speed)} ({_num(r.get('speedup_vs_stock_ci_low'))}) |",
        "",
        f"- τ (tokens per exact pass): **{_num(r.get('tau'))}**; c(N) = T_step / T_AR: **{_num(r.get('c'))}**"
        f" (T_step {_num(r.get('step_ms'))} ms, T_AR {_num(r.get('ar_step_ms'))} ms; τ / c = "
        f"{_num(_ratio(r.get('tau'), r.get('c')))}, decode steps only; stock's c {_num(r.get('stock_c'))})",
    ]
    if r.get("steps_method"):
        rows.append(f"- τ and c: {r['steps_method']}")
    rows += _headline_warnings(r)
    if r.get("sealed_label") or r.get("sealed_seal"):
        rows.append(f"- sealed system: `{r.get('sealed_label', '')}` seal `{str(r.get('sealed_seal', ''))[:16]}`")
    if r.get("sigma") is not None:
        rows.append(f"- stock noise σ: {_pct(r.get('sigma'))}")
    return rows


def _headline_warnings(r: dict) -> list[str]:
    """Lines that flag a sealed system that failed its seal's token-forcing audit, one slower than AR, a seal that is
    stock itself (its speedup vs stock is noise), and a headline that τ / c of the same runs does not back (the two
    weigh requests differently: see the text)."""
    out = []
    tf = r.get("token_forcing") or {}
    if tf.get("passed") is False:
        out.append("- **Warning: the sealed system failed token forcing in the seal's audit** ("
                   + "; ".join(tf.get("reasons") or ["see Token forcing"]) + "). Its outputs are not certified as "
                   "stock's: see Token forcing below (the audited outputs are kept for `specpilot audit`).")
        if tf.get("reaudit_float32_command"):
            out.append(f"  The scorer ran in {tf.get('scorer_dtype')}, which rounds like stock's own kernels: on flat "
                       "logits a lossless kernel that accumulates in another order (W12) can fail on near-ties alone. "
                       f"The same audit against a float32 scorer: `{tf['reaudit_float32_command']}`.")
    vs_ar, low, tc = r.get("speedup_vs_ar"), r.get("speedup_ci_low"), _ratio(r.get("tau"), r.get("c"))
    if isinstance(vs_ar, (int, float)) and vs_ar < 1:
        r0 = next((x for x in r.get("rounds") or [] if x.get("round") == 0), None)
        if r.get("sealed_label") == "AR":
            why = "The sealed system is AR itself: this is AR against AR, run-to-run noise."
        elif r0 is not None and not r0.get("approved"):
            why = (f"Round 0 judged AR against stock and did not approve it: its 95% lower bound did not clear the bar "
                   f"(1% + 2σ, σ = {_num(r.get('sigma'), '{:.1%}')}). AR (no drafter) may be the better system here; rerun on "
                   "a quieter machine to decide.")
        else:
            why = ("Round 0 judges AR only when stock loses to AR in Phase 0; noise (σ) can hide a small loss there: "
                   "AR (no drafter) may be the better system here; rerun on a quieter machine to decide.")
        out.append(f"- **Warning: the sealed system is slower than AR in this run** ({_num(vs_ar)}x, 95% lower bound "
                   f"{_num(low)}). " + why)
    if r.get("sealed_label") and r.get("sealed_label") == r.get("stock_label"):
        out.append(f"- Note: the sealed system is stock itself (`{r['sealed_label']}`, no change approved): its speedup "
                   f"vs stock ({_num(r.get('speedup_vs_stock'))}, 95% lower bound {_num(r.get('speedup_vs_stock_ci_low'))}) "
                   "is stock against stock, run-to-run noise; a paired lower bound of a system against itself clears "
                   "1.0 about 2.5% of the time.")
    if isinstance(vs_ar, (int, float)) and isinstance(tc, (int, float)) and abs(vs_ar / tc - 1) > 0.05:
        out.append(f"- Note: the headline speedup ({_num(vs_ar)}x) and τ / c ({_num(tc)}) of the same runs differ by "
                   f"{abs(vs_ar / tc - 1):.0%}: the headline is the geometric mean over benchmarks of per-request "
                   "throughput ratios (prefill included, each request's faster run: the controller's statistic), "
                   "τ / c sums decode steps over all requests (long requests weigh more). Neither is wrong; they "
                   "answer different questions.")
    return out


def _ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def _benchmarks(r: dict) -> list[str]:
    bm = r.get("benchmarks") or {}
    if not bm:
        return []
    md = ["## Speedup per benchmark", "",
          "From the seal's interleaved run; 95% lower bounds by paired bootstrap over the benchmark's requests "
          "(— for a benchmark of one request).", "",
          "| benchmark | requests | AR tok/s | stock tok/s | sealed tok/s | sealed vs AR (95% low) | sealed vs stock (95% low) |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    for name, b in bm.items():
        md.append(f"| {name} | {b.get('requests', '—')} | {_num(b.get('ar_tokens_per_s'), '{:.1f}')} | "
                  f"{_num(b.get('stock_tokens_per_s'), '{:.1f}')} | {_num(b.get('sealed_tokens_per_s'), '{:.1f}')} | "
                  f"{_num(b.get('vs_ar'))} ({_num(b.get('vs_ar_low'))}) | {_num(b.get('vs_stock'))} ({_num(b.get('vs_stock_low'))}) |")
    return md + [""]


def _verdict(c: dict) -> str:
    """``approved → entry``, ``approved, superseded by X`` or ``rejected: reason`` (one cell)."""
    if not c.get("approved"):
        reason = str(c.get("reason", "")).replace("|", "/").removeprefix("rejected").lstrip(": ")
        return "rejected" + (f": {reason}" if reason else "")
    if c.get("superseded_by"):
        return f"approved, superseded (by {c['superseded_by']}: a higher lower bound this round)"
    out = "approved"
    if c.get("entry"):
        out += f" → entry `{c['entry']}`"
    if c.get("reused_from"):
        out += " (reused)"
    return out


def _forcing_cell(c: dict) -> str:
    if c.get("forcing_passed") is None:
        return "—"
    return f"{'passed' if c['forcing_passed'] else 'failed'} ({_pct(c.get('mismatch_rate'))})"


def _candidates(cands: list) -> list[str]:
    md = ["## Candidates (§3.3)", "",
          "Gain = geometric mean over benchmarks of the throughput ratio vs the incumbent; 95% low = paired-bootstrap "
          "lower bound; bar = what `low − 1` had to exceed; forcing = token forcing (mismatch rate); replay τ and "
          "model c = the cost model's prediction; screened c = live decode steps interleaved with AR.", "",
          "| round | candidate | gain | 95% low | bar | output differs | forcing | replay τ | model c | screened c | verdict |",
          "|---|---|---:|---:|---:|---|---|---:|---:|---:|---|"]
    for c in cands:
        p = c.get("predicted") or {}
        md.append(f"| {c.get('round', '—')} | {c.get('name', '—')} | {_num(c.get('gain'))} | "
                  f"{_num(c.get('lower_bound'))} | {_pct(c.get('bar'))} | {_num(c.get('outputs_differ'))} | "
                  f"{_forcing_cell(c)} | {_num(p.get('tau', c.get('tau')))} | {_num(p.get('c', c.get('c')))} | "
                  f"{_num(p.get('c_screened'))} | {_verdict(c)} |")
    return md + [""]


def _reuse(r: dict) -> list[str]:
    rows = r.get("reused") or []
    if not rows and not r.get("memory_source"):
        return []
    md = ["## Reused from memory (§3.5)", "", f"Source: `{r.get('memory_source', '—')}`. Reused entries were "
          "re-tuned and re-measured here against the incumbent; they are not new discoveries.", "",
          "| source entry | kind | status | recorded → re-tuned | gain | 95% low | new entry | reason |",
          "|---|---|---|---|---:|---:|---|---|"]
    for x in rows:
        md.append(f"| `{x.get('id', '?')}` | {x.get('kind', '—')} | {x.get('status', '—')} | "
                  f"{x.get('recorded', '—')} → {x.get('config', '—')} | {_num(x.get('gain'))} | "
                  f"{_num(x.get('lower_bound'))} | {('`' + x['entry'] + '`') if x.get('entry') else '—'} | "
                  f"{str(x.get('reason', '')).replace('|', '/')} |")
    if not rows:
        md.append("| — | | | | | | | no entries |")
    return md + [""]


def _stock_vs_ar(r: dict) -> str:
    ar, st = r.get("ar_tokens_per_s"), r.get("stock_tokens_per_s")
    return _num(st / ar) if isinstance(ar, (int, float)) and isinstance(st, (int, float)) and ar else "—"


def _device_value(v) -> str:
    """One device field for report.md: dicts (the measured peaks) as ``name value`` pairs with 3 significant digits."""
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} {x:.3g}" if isinstance(x, float) else f"{k} {x}" for k, x in v.items()) + "}"
    return str(v)


def _markdown(r: dict, images: list[str]) -> str:
    dev = r.get("device")
    dev = ", ".join(f"{k}: {_device_value(v)}" for k, v in dev.items() if k not in ("threads", "threads_reason")) \
        if isinstance(dev, dict) else (dev or "—")  # threads get their own line below
    ver = r.get("versions")
    ver = ", ".join(f"{k} {v}" for k, v in ver.items()) if isinstance(ver, dict) else "—"
    md = ["# SpecPilot report", "", f"Commit: {r.get('commit') or '—'}; versions: {ver}", "", f"Device: {dev}", ""]
    if isinstance(r.get("deployment"), dict):
        md += ["Deployment: " + ", ".join(f"{k}: {v}" for k, v in r["deployment"].items()), ""]
    if isinstance(r.get("device"), dict) and r["device"].get("threads") is not None:
        md += [f"torch threads: {r['device']['threads']} ({r['device'].get('threads_reason', '—')})", ""]
    ex = r.get("execution")
    if isinstance(ex, dict):
        slots = "; ".join("+".join(sl) for sl in ex.get("slots") or []) or "—"
        how = "paired on two devices, swapped half way" if ex.get("paired_devices") else "A B B A on one device"
        md += [f"Controller runs: {ex.get('mode')} ({how}); slots: {slots}"
               + (f"; agent: `{ex['agent']}`" if ex.get("agent") else ""), ""]
    md += ["## Headline", "", *_headline(r), ""]
    md += _benchmarks(r)
    ceil = r.get("ceiling") or {}
    if ceil:
        prod = 1.0
        for f in FACTORS:
            prod *= float(ceil.get(f) or 1.0)
        md += ["## Ceiling (§3.2)", "", "| tree | kernel | outside | product |", "|---:|---:|---:|---:|",
               f"| {' | '.join(_num(ceil.get(f)) for f in FACTORS)} | {_num(prod)} |", ""]
        out_f = ceil.get("outside")
        if isinstance(out_f, (int, float)) and out_f < 1:
            md += [f"outside = measured step ms / profiled ms = {_num(out_f)} < 1: the profiled run's summed region "
                   "times exceed the timed run's step time. The two are separate runs and the profiler lengthens "
                   "what it records; read it as no time left outside the profiled regions, i.e. a factor of 1.", ""]
    tf = r.get("token_forcing") or {}
    if tf:
        md += ["## Token forcing (§3.4)", "",
               f"- δ = {_num(tf.get('delta'))} nats; events = mismatches with margin ≥ 2δ"
               + (f"; scorer: target in {tf['scorer_dtype']}, FP32 LM head" if tf.get("scorer_dtype") else ""),
               f"- sealed: mismatch rate {_pct(tf.get('mismatch_rate'))}, events {tf.get('events', '—')}"
               f" ({_pct(tf.get('event_rate'))}) over {tf.get('tokens', '—')} tokens",
               f"- stock: mismatch rate {_pct(tf.get('stock_mismatch_rate'))}, "
               f"event rate {_pct(tf.get('stock_event_rate'))}",
               f"- passed: {_num(tf.get('passed'))}"]
        if tf.get("allowance") is not None:
            md.append(f"- rules: mismatch rate at most stock's + {100 * tf['allowance']:.2f} pp (0.5 pp + 2 standard "
                      f"errors of stock's rate); events no more frequent than stock's")
        md += [f"- failed: {r}" for r in tf.get("reasons") or []]
        if tf.get("outputs"):
            md.append(f"- audited outputs: `{tf['outputs']}`, stock's: `{tf.get('stock_outputs')}`")
        if tf.get("reaudit_command"):
            md.append(f"- re-audit: `{tf['reaudit_command']}`")
        md.append("")
    cands = r.get("candidates") or []
    if cands:
        md += _candidates(cands)
    md += _reuse(r)
    rounds = r.get("rounds") or []
    if rounds:
        md += ["## Rounds", "", "Incumbent at the start of each round: its ceiling factors (§3.2), τ and c (T_step and "
               "T_AR interleaved in one measurement), decode tokens/s = 1000 τ / T_step.", "",
               "| round | incumbent | tree | kernel | outside | attacked | τ | c | decode tokens/s | approved |",
               "|---:|---|---:|---:|---:|---|---:|---:|---:|---|"]
        for rd in rounds:
            cl = rd.get("ceiling") or {}
            md.append(f"| {rd.get('round', '—')} | {rd.get('incumbent', '—')} | {' | '.join(_num(cl.get(f)) for f in FACTORS)} | "
                      f"{rd.get('attacked', '—')} | {_num(rd.get('tau'))} | {_num(rd.get('c'))} | "
                      f"{_num(rd.get('tokens_per_s'), '{:.1f}')} | {rd.get('approved') or '—'} |")
        md.append("")
    entries = r.get("entries") or []
    md += ["## Memory entries (§3.5)", ""]
    for e in entries:
        if isinstance(e, dict):
            req = ", ".join(e.get("requires") or []) or "—"
            origin = f"reused from `{e['reused_from']}`, re-measured here" if e.get("reused_from") else "new"
            md.append(f"- `{e.get('id', '?')}` {e.get('title', '')} ({origin}; gain {_num(e.get('gain'))}, "
                      f"95% low {_num(e.get('lower_bound'))}; requires {req})")
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
                  f"{a.get('reason')} | "
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


def _plot_c(path: Path, data: dict, measured: list | None = None) -> bool:
    x, y = _curve(data)
    pts = [(float(p["N"]), float(p["c"])) for p in (measured or []) if isinstance(p, dict)
           and isinstance(p.get("N"), (int, float)) and isinstance(p.get("c"), (int, float))]
    if not x and not pts:
        return False
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    if x:
        ax.plot(x, y, marker="o", label="cost model, drafting excluded")
    labels = [p.get("label", "") for p in measured or [] if isinstance(p, dict)
              and isinstance(p.get("N"), (int, float)) and isinstance(p.get("c"), (int, float))]
    for i, ((n, c), lab) in enumerate(zip(pts, labels)):
        ax.scatter([n], [c], marker="x", s=50, zorder=3, color=f"C{(i + 1) % 10}", label=f"measured: {lab}"[:60])
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set(xlabel="tree nodes N (rows verified − 1)", ylabel="c(N) = T_step(N) / T_AR",
           title="c(N): model curve; crosses: step time over AR's, interleaved")
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return True


def _plot_speedup(path: Path, benchmarks: dict) -> bool:
    """Bar chart of the sealed system's gain per benchmark vs AR and vs stock; the whisker runs down to the
    one-sided 95% lower bound (none for a benchmark of one request)."""
    names = list(benchmarks or {})
    if not names:
        return False
    fig = Figure(figsize=(max(6, 1.4 * len(names)), 4))
    ax = fig.add_subplot()
    w = 0.38
    for j, base in enumerate(("ar", "stock")):
        g = [float(benchmarks[n].get(f"vs_{base}") or 0.0) for n in names]
        low = [benchmarks[n].get(f"vs_{base}_low") for n in names]
        err = [[max(gi - lo, 0.0) if isinstance(lo, (int, float)) else 0.0 for gi, lo in zip(g, low)], [0.0] * len(g)]
        ax.bar([i + j * w for i in range(len(names))], g, w, yerr=err, capsize=4, label=f"sealed vs {base.upper() if base == 'ar' else base}")
    ax.set_xticks([i + w / 2 for i in range(len(names))], names)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(ylabel="speedup (×), whisker: 95% lower bound", title="speedup per benchmark (seal's interleaved run)")
    ax.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return True


def ceiling_rows(rounds: list) -> list[tuple[str, dict]]:
    """``(label, {tree, kernel, outside})`` of every round with ceiling factors, round 0 included, in order;
    a row with ``round == "sealed"`` is labelled ``sealed``."""
    rows = [(f"round {rd.get('round', i)}" if rd.get("round") != "sealed" else "sealed", rd.get("ceiling", rd))
            for i, rd in enumerate(rounds or [])]
    return [(n, c) for n, c in rows if isinstance(c, dict) and any(c.get(f) is not None for f in FACTORS)]


def _plot_ceiling(path: Path, rounds: list) -> bool:
    rows = ceiling_rows(rounds)
    if not rows:
        return False
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    w = 0.8 / len(FACTORS)
    for j, f in enumerate(FACTORS):
        ax.bar([i + j * w for i in range(len(rows))], [float(c.get(f) or 0.0) for _, c in rows], w, label=f)
    ax.set_xticks([i + w for i in range(len(rows))], [n for n, _ in rows])
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
    ceiling_data = plots.get("ceiling")
    if ceiling_data is None:  # every round (round 0 included) and the sealed system
        ceiling_data = list(report.get("rounds") or [])
        if isinstance(report.get("ceiling"), dict):
            ceiling_data.append({"round": "sealed", "ceiling": report["ceiling"]})
    for name, fn, data in (
        ("speedup.png", _plot_speedup, plots.get("speedup", report.get("benchmarks"))),
        ("tau_vs_n.png", _plot_tau, plots.get("tau_vs_n", report.get("tau_curve"))),
        ("c_vs_n.png", lambda p, d: _plot_c(p, d, report.get("c_measured")), plots.get("c_vs_n", report.get("c_curve"))),
        ("ceiling.png", _plot_ceiling, ceiling_data),
    ):
        if fn(out / name, data):
            written[name] = out / name
    (out / "report.json").write_text(json.dumps(report, indent=2, default=_jsonable) + "\n")
    written["report.json"] = out / "report.json"
    (out / "report.md").write_text(_markdown(report, [n for n in written if n.endswith(".png")]))
    written["report.md"] = out / "report.md"
    return written
