"""``report.md`` of a pilot run: headline, benchmarks, ceiling, token forcing, candidates, reuse, rounds,
memory entries and the adversarial check, from the report dict (keys: :mod:`specpilot.pilot.report`)."""

from __future__ import annotations

from pathlib import Path

from specpilot.pilot.report_plots import FACTORS


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
    """Lines that flag a sealed system that failed its seal's token-forcing audit, one slower than AR or not shown
    faster (its lower bound below 1), a seal that is
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
                       f"The same audit against a float32 scorer, from this report's directory: "
                       f"`{tf['reaudit_float32_command']}`.")
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
    elif (isinstance(vs_ar, (int, float)) and isinstance(low, (int, float)) and low < 1
          and r.get("sealed_label") != "AR"):
        out.append(f"- **Note: the sealed system is not shown faster than AR** ({_num(vs_ar)}x, 95% lower bound "
                   f"{_num(low)} < 1): the controller approved it against the incumbent (stock, or what replaced it), "
                   "not against AR; rerun on a quieter machine, or with more requests, to tell.")
    if r.get("sealed_label") and r.get("sealed_label") == r.get("stock_label"):
        out.append(f"- Note: the sealed system is stock itself (`{r['sealed_label']}`, no change approved): its speedup "
                   f"vs stock ({_num(r.get('speedup_vs_stock'))}, 95% lower bound {_num(r.get('speedup_vs_stock_ci_low'))}) "
                   "is stock against stock, run-to-run noise; a paired lower bound of a system against itself clears "
                   "1.0 about 2.5% of the time.")
    if isinstance(vs_ar, (int, float)) and isinstance(tc, (int, float)) and abs(vs_ar / tc - 1) > 0.05:
        out.append(f"- Note: the headline speedup ({_num(vs_ar)}x) and τ / c ({_num(tc)}) of the same runs differ by "
                   f"{abs(vs_ar / tc - 1):.0%}: the headline is the geometric mean over benchmarks of per-request "
                   "throughput ratios (prefill included, each request's faster run: the controller's statistic), "
                   "τ / c pools the decode steps and tokens of all requests, so each request weighs by its time "
                   "and those speculation speeds up most weigh least. For the decode throughput of this whole mix "
                   "read τ / c; for the typical request (§5.1's gain), the headline.")
    out += _phase0_vs_headline(r)
    return out


def _phase0_vs_headline(r: dict) -> list[str]:
    """A note when Phase 0's stock-vs-AR gain and the headline's stock / AR throughput disagree by more than Phase
    0's own two-sided interval (gain ± (gain − 95% lower bound)), with why two measurements of one ratio can."""
    p0 = r.get("phase0") or {}
    g, low = p0.get("stock_vs_ar_gain"), p0.get("stock_vs_ar_lower_bound")
    ar, st = r.get("ar_tokens_per_s"), r.get("stock_tokens_per_s")
    if not all(isinstance(x, (int, float)) for x in (g, low, ar, st)) or not ar:
        return []
    head, half = st / ar, max(g - low, 0.0)
    if abs(head - g) <= half:
        return []
    return [f"- Note: Phase 0 measured stock at {_num(g)}x AR (95% interval ±{_num(half)}) and the headline at "
            f"{_num(head)}x: outside Phase 0's interval. They are two measurements of one ratio, on different salted "
            "prompt variants at the start and the end of the run (the headline also keeps each request's faster of "
            "two runs); a gap beyond the interval means the machine's speed changed between them (another process, "
            "clocks, thermal state): compare Phase 0's σ with a quiet run, and trust neither to better than the gap."]


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


#: the marker after a candidate whose drafter is ``calibrated`` (its acceptance is simulated, §2.4), and its legend
SIMULATED = " [SIMULATED]"
SIMULATED_LEGEND = ("[SIMULATED] marks the `calibrated` drafter, whose acceptance is simulated from a real pair's "
                    "calibration (it is told the target's greedy continuations): its τ and gains are not a real "
                    "drafter's.")


def _simulated(row: dict) -> bool:
    """Whether a candidates / predictions row is a ``calibrated`` drafter's: its ``config`` says so, or (prediction
    rows carry no config) its label, which :meth:`SystemConfig.label` starts with the drafter kind."""
    cfg = row.get("config")
    if isinstance(cfg, dict) and cfg.get("drafter"):
        return cfg["drafter"] == "calibrated"
    return str(row.get("name", "")).startswith("calibrated/")


def _name_cell(row: dict) -> str:
    """A row's candidate cell: its label, with :data:`SIMULATED` for a calibrated drafter's."""
    return str(row.get("name", "—")) + (SIMULATED if _simulated(row) else "")


def _legend(rows: list) -> list[str]:
    """The one-line legend under a table any of whose ``rows`` carries :data:`SIMULATED`, else nothing."""
    return ["", SIMULATED_LEGEND] if any(isinstance(x, dict) and _simulated(x) for x in rows) else []


def _candidates(cands: list) -> list[str]:
    md = ["## Candidates (§3.3)", "",
          "Gain = geometric mean over benchmarks of the throughput ratio vs the incumbent; 95% low = paired-bootstrap "
          "lower bound; bar = what `low − 1` had to exceed; forcing = token forcing (mismatch rate); replay τ and "
          "model c = the cost model's prediction; screened c = live decode steps interleaved with AR.", "",
          "| round | candidate | gain | 95% low | bar | output differs | forcing | replay τ | model c | screened c | verdict |",
          "|---|---|---:|---:|---:|---|---|---:|---:|---:|---|"]
    for c in cands:
        p = c.get("predicted") or {}
        md.append(f"| {c.get('round', '—')} | {_name_cell(c)} | {_num(c.get('gain'))} | "
                  f"{_num(c.get('lower_bound'))} | {_pct(c.get('bar'))} | {_num(c.get('outputs_differ'))} | "
                  f"{_forcing_cell(c)} | {_num(p.get('tau', c.get('tau')))} | {_num(p.get('c', c.get('c')))} | "
                  f"{_num(p.get('c_screened'))} | {_verdict(c)} |")
    return md + _legend(cands) + [""]


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


def _predictions(p: dict, inputs: dict) -> list[str]:
    """How the cost model's predictions held against every screened candidate's live step (§3.2)."""
    if not p.get("candidates"):
        return []
    verdict = "held" if p.get("holds") else "did not hold"
    md = ["## Predictions (§3.2)", "",
          f"Over {p['candidates']} screened candidates the cost model's c {verdict} ({p.get('bar', '')}): median "
          f"|error| {_pct(p.get('median_abs_error'))}, Spearman {_num(p.get('spearman'), '{:.2f}')}; replay τ "
          f"against live τ: median |error| {_pct(p.get('tau_median_abs_error'))}. "
          f"T_spec {_num(inputs.get('spec_overhead_ms'))} ms: {inputs.get('spec_overhead_source', '—')}.", "",
          "Replay τ, model c and the live figures are over the same few requests of each screening, on the prompts "
          "the cost model recorded (Phase 0's first salted variant); the candidates' ranking uses replay τ over "
          "every request.",
          "", "| round | candidate | replay τ | live τ | model c | live c |", "|---:|---|---:|---:|---:|---:|"]
    for row in p.get("screened") or []:
        md.append(f"| {row.get('round') if row.get('round') is not None else '—'} | {_name_cell(row)} | "
                  f"{_num(row.get('tau_replay'))} | {_num(row.get('tau_live'))} | {_num(row.get('c_predicted'))} | "
                  f"{_num(row.get('c_live'))} |")
    return md + _legend(p.get("screened") or []) + [""]


def render_markdown(r: dict, images: list[str]) -> str:
    """The text of ``report.md`` for report dict ``r`` (every key optional; missing parts show "—" or are
    skipped), with ``images`` (file names relative to the report directory) under "Plots"."""
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
    md += _duration(r.get("duration"))
    md += ["## Headline", "", *_headline(r), ""]
    md += _benchmarks(r)
    ceil = r.get("ceiling") or {}
    if ceil:
        prod = 1.0
        for f in FACTORS:
            prod *= float(ceil.get(f) or 1.0)
        md += ["## Ceiling (§3.2)", "", "| tree | kernel | outside | product |", "|---:|---:|---:|---:|",
               f"| {' | '.join(_num(ceil.get(f)) for f in FACTORS)} | {_num(prod)} |", ""]
        for why in ((ceil.get("detail") or {}).get("explanations") or {}).values():
            md += [why + ".", ""]
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
            md.append(f"- re-audit, from this report's directory: `{tf['reaudit_command']}`")
        md.append("")
    md += _predictions(r.get("predictions") or {}, r.get("cost_inputs") or {})
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


def _duration(d) -> list[str]:
    """The run's wall time against the estimate printed before Phase 0, per phase (seconds)."""
    if not isinstance(d, dict) or d.get("actual_s") is None:
        return []
    est, act = d.get("estimate_by_phase_s") or {}, d.get("actual_by_phase_s") or {}
    phases = ", ".join(f"{p} {_num(act.get(p), '{:.0f}')} s ({_num(est.get(p), '{:.0f}')})" for p in act)
    sized = ("; --quick plan: " + (", ".join(d["plan_changes"]) or "unchanged")) if d.get("target_s") else ""
    expected = f"{d['estimate_s'] / 60:.1f} min" if isinstance(d.get("estimate_s"), (int, float)) else "—"
    return [f"Duration: {d['actual_s'] / 60:.1f} min, expected {expected} before Phase 0 "
            f"(per phase, actual (expected): {phases}){sized}", ""]


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
