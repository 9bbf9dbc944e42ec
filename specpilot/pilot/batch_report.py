"""The batched pilot's output (paper §3.3, §5.1): ``batch_report.json``, ``batch_report.md`` and one sealed system
per batch size (``system_n{n}.json``; ``system.json`` is the smallest size's, the only one with one size, so what
reads a pilot's ``system.json`` keeps working). ``specpilot serve --system system_n{n}.json --max-num-seqs n`` serves
the system sealed for ``n`` requests at once."""

from __future__ import annotations

import datetime as _dt
import json
import math
import platform
import time

import torch

from specpilot.config import SystemConfig
from specpilot.pilot import controller as ctl
from specpilot.pilot.batch_journal import machine_name
from specpilot.pilot.batch_runs import compare
from specpilot.provenance import versions

_fin = lambda x: x if x is not None and math.isfinite(x) else None  # noqa: E731


def system_file(n: int) -> str:
    """The sealed system's file for batch size ``n``: ``system_n{n}.json``."""
    return f"system_n{n}.json"


def verdict_record(name, why, size, inc, cand, run, v, forcing=None) -> dict:
    """One verdict of the batched pilot at batch size ``size`` (JSON-ready): the mechanism, incumbent and candidate,
    the run's figures at that size, token forcing (None: not run), the decision, gain, lower bound and bar."""
    return {"mechanism": name, "why": why, "size": size, "incumbent": inc.label(), "candidate": cand.label(),
            "delta": cand.delta(inc), "run": run.to_dict(), "token_forcing": forcing, "approved": v.approved,
            "reason": v.reason, "gain": v.gain, "lower_bound": _fin(v.lower_bound), "bar": v.bar}


def build_report(pilot, sizes, rounds, groups, plan, ar_stock, aa, sigma: dict, verdicts, entries: dict,
                 sealed: dict, final, budgets: dict, t0: float) -> dict:
    """The report dict. ``sigma`` / ``entries`` / ``sealed``: per batch size (σ from that size's A/A, the approved
    mechanisms, the sealed :class:`SystemConfig`); ``final``: the seal's runs (AR, stock and that size's sealed system
    as ``sealed``, every size's cells merged); ``budgets``: the shared budgets and the pass costs they came from."""
    vs_ar, vs_stock, st_ar = compare(final, "ar", "sealed"), compare(final, "stock", "sealed"), compare(final, "ar", "stock")
    per_size = {}
    for n in sizes:
        fn, cfg = final.at(n), sealed[n]
        row = {"sealed_label": cfg.label(), "sealed_seal": cfg.seal(), "system_file": system_file(n),
               "sealed_is": next((k for k, c in (("ar", pilot.ar), ("stock", pilot.stock)) if c == cfg), None),
               "entries": [e["mechanism"] for e in entries[n]], "sigma": sigma[n], "bar": ctl.BASE_BAR + 2 * sigma[n],
               **{f"{k}_tokens_per_s": final.tokens_per_s(k, n) for k in ("ar", "stock", "sealed")}}
        for key, run in (("sealed_vs_ar", vs_ar), ("sealed_vs_stock", vs_stock), ("stock_vs_ar", st_ar),
                         ("phase0_stock_vs_ar", ar_stock), ("phase0_aa", aa)):
            row[key], row[f"{key}_low"] = run.per_size[n]["gain"], _fin(run.per_size[n]["lower_bound"])
        row["outputs_equal_ar"] = {"stock": fn.equal_outputs("ar", "stock"), "sealed": fn.equal_outputs("ar", "sealed")}
        per_size[str(n)] = row
    dev = torch.device(pilot.o.device)
    first = per_size[str(min(sizes))]
    return {
        "device": {"type": pilot.o.device, "name": machine_name(dev), "threads": torch.get_num_threads(),
                   "threads_reason": pilot.threads_reason, "platform": platform.platform()},
        "versions": versions(), "commit": pilot.commit,
        "deployment": {**pilot.deployment(), "batch": list(sizes)},
        "sizes": list(sizes), "rounds": rounds, "benchmarks": {b: len(r) for b, r in groups.items()},
        "compiled": pilot.o.compile_cpu,  # measured on the compiled batched CPU pass (serve --compile's)
        "max_new_tokens": plan["max_new_tokens"], "stock_label": pilot.stock.label(),
        "sealed_label": first["sealed_label"], "sealed_seal": first["sealed_seal"],  # system.json's (smallest size)
        "sigma": {str(n): sigma[n] for n in sizes},
        "phase0": {"stock_vs_ar": ar_stock.to_dict(), "aa": aa.to_dict(), "sigma": {str(n): sigma[n] for n in sizes}},
        "shared_budget": budgets,
        "per_size": per_size,
        "speedup_vs_ar": vs_ar.gain, "speedup_vs_ar_low": _fin(vs_ar.lower_bound),
        "speedup_vs_stock": vs_stock.gain, "speedup_vs_stock_low": _fin(vs_stock.lower_bound),
        "outputs_equal_ar": {"stock": final.equal_outputs("ar", "stock"), "sealed": final.equal_outputs("ar", "sealed")},
        "seal_flags": {"threads_left_running": final.outside, "nondeterministic": final.nondeterministic},
        "verdicts": verdicts, "entries": {str(n): entries[n] for n in sizes},
        "approval_rule": "per batch size, against that size's incumbent: approve iff the 95% lower bound of the gain "
                         "over that size's cells - 1 > 1% + 2σ (σ from that size's A/A; lossless row choices); a "
                         "candidate whose output differs from the incumbent's (= AR's) on any variant is rejected "
                         "in float32 unless it parts from it at rounding ties only (every token within 1e-3 nats of "
                         "the float32 scorer's argmax: then the lossless bar), token-forced and held to "
                         "max(3%, 1% + 2σ) otherwise; threads left running or "
                         "nondeterminism reject",
        "method": "batch run = a benchmark's requests (salted variants, cycled to at least n) queued at once in a "
                  "BatchEngine of n slots; tokens/s = generated tokens / wall s of generate_all (device synced); "
                  "per (benchmark, size, round) two fresh variant sets in a palindrome (A B, B A), a system's "
                  "figure the higher of its two; gain at a size = geometric mean over benchmarks of the geometric "
                  "mean over rounds; lower bound: paired bootstrap, benchmark strata, rounds resampled; over all "
                  "sizes (the seal's summary) the same with (benchmark, size) strata",
        "duration_s": time.perf_counter() - t0,
    }


def write_outputs(out, report: dict, sealed: dict, entries: dict) -> None:
    """``batch_report.json``, ``batch_report.md``, ``system_n{n}.json`` per size and ``system.json`` (the smallest
    size's) into ``out``; a system file holds ``config``, ``label``, ``seal``, ``entries``, ``deployment``
    (``batch``: its size), ``batch_size``, ``commit`` and ``date``, as ``specpilot serve --system`` reads it."""
    date = _dt.datetime.now().isoformat(timespec="seconds")
    for n in sorted(sealed):
        cfg: SystemConfig = sealed[n]
        system = {"config": cfg.model_dump(), "label": cfg.label(), "seal": cfg.seal(),
                  "entries": [e["mechanism"] for e in entries[n]], "batch_size": n,
                  "deployment": {**report["deployment"], "batch": [n]}, "commit": report["commit"], "date": date}
        text = json.dumps(system, indent=2)
        (out / system_file(n)).write_text(text)
        if n == min(sealed):
            (out / "system.json").write_text(text)
    (out / "batch_report.json").write_text(json.dumps(report, indent=2))
    (out / "batch_report.md").write_text(render_md(report))


def _why(r: dict) -> str:
    """Why a size sealed what it did, in words (from its approved entries and what the sealed system is)."""
    if r.get("fell_back"):
        fb = r["fell_back"]
        how = f"approved ({', '.join(fb['entries'])})" if fb["entries"] else "approved"
        return f"AR: {fb['label']} was {how} but ran {fb['gain_vs_ar']:.3f}x AR in the seal"
    if r["entries"]:
        return "approved in turn, each beating the incumbent of its moment: " + ", ".join(r["entries"])
    if r["sealed_is"] == "ar":
        return "AR: neither stock nor any candidate beat it by the bar"
    return "stock: it beat AR by the bar; no candidate beat it"


def render_md(report: dict) -> str:
    """The batch report as Markdown: the sealed system of each size, a table per size, the verdicts, σ, method."""
    f = lambda g, lo: f"{g:.3f}x" + (f" (≥ {lo:.3f})" if lo is not None else "")  # noqa: E731
    ps = report["per_size"]
    lines = ["# Batched pilot: sealed per batch size", "",
             f"Device {report['device']['type']} ({report['device']['name']}), commit {report['commit']}, sizes "
             f"{report['sizes']}, {report['rounds']} rounds, benchmarks {report['benchmarks']}, "
             f"{report['max_new_tokens']} new tokens; stock {report['stock_label']}"
             + ("; every system measured on the compiled batched pass (`serve --compile`)." if report.get("compiled")
                else "."), "",
             *([f"Requests: {report['deployment']['requests']}; benchmarks above are its groups.", ""]
               if report.get("deployment", {}).get("requests") else []),
             "| n | sealed | why | file | vs AR | vs stock | σ (bar) | outputs equal AR |",
             "|---|---|---|---|---|---|---|---|"]
    for n, r in ps.items():
        lines.append(f"| {n} | {r['sealed_label']} | {_why(r)} | "
                     f"{r['system_file']} | {f(r['sealed_vs_ar'], r['sealed_vs_ar_low'])} | "
                     f"{f(r['sealed_vs_stock'], r['sealed_vs_stock_low'])} | {r['sigma']:.4f} (+{r['bar']:.2%}) | "
                     f"{r['outputs_equal_ar']['sealed']} |")
    flag = "--compile " if report.get("compiled") else ""
    lines += ["", f"Serve them all: `specpilot serve {flag}--system <this directory>` (each step runs the system sealed "
                  "nearest its number of running requests; `specpilot bench --batch SIZES --system <this directory>` "
                  "measures that against AR and stock); one size alone: `--system system_n<n>.json` (system.json is "
                  f"system_n{min(report['sizes'])}.json). Over all sizes, each "
                  f"size's sealed system: {f(report['speedup_vs_ar'], report['speedup_vs_ar_low'])} AR, "
                  f"{f(report['speedup_vs_stock'], report['speedup_vs_stock_low'])} stock (95% lower bounds).", ""]
    sb = report.get("shared_budget")
    if sb:
        lines += [f"Shared budget by batch size (flat region of the batched pass, ±{sb['tolerance']:.0%}): "
                  f"{sb['budgets']} nodes for 1, 2, ... requests.", ""]
        for key, r in (sb.get("replay") or {}).items():  # the candidates' budgets: replayed over the measured pass
            pred = "; ".join(f"{n}: " + ", ".join(f"{b} → {x:.3f}x" for b, x in p.items())
                             for n, p in r["predicted"].items())
            lines += [f"By replay for {key} (never below the flat region's): {r['budgets']}; predicted speedup over "
                      f"AR per budget at each size: {pred}.", ""]
    tf = report.get("token_forcing")
    if tf and tf["sealed"].get("rule") == "float32 rounding ties":  # float32: tokens AR's up to rounding
        t = tf["sealed"]
        lines += [f"Float32 rounding ties: {t['tokens']} tokens where the sealed outputs part from AR's, largest margin "
                  f"below the scorer's argmax {t['largest_margin']:.3g} nats (at most {t['tolerance']:g}): "
                  f"{'passed' if t['passed'] else 'FAILED'}.", ""]
    elif tf:
        lines += [f"Token forcing ({tf['scorer_dtype']} scorer, δ = {tf['delta']}): stock mismatch rate "
                  f"{tf['stock']['mismatch_rate']:.3%}; sealed {tf['sealed']['mismatch_rate']:.3%}, "
                  f"{'passed' if tf['sealed']['passed'] else 'FAILED: ' + '; '.join(tf['sealed']['reasons'])}.", ""]
    for n, r in ps.items():
        lines += [f"## {n} request{'s' if n != '1' else ''} at once", "",
                  "| system | tokens/s | vs AR | vs stock |", "|---|---|---|---|",
                  f"| AR | {r['ar_tokens_per_s']:.1f} | 1 | |",
                  f"| stock | {r['stock_tokens_per_s']:.1f} | {f(r['stock_vs_ar'], r['stock_vs_ar_low'])} | 1 |",
                  f"| sealed: {r['sealed_label']} | {r['sealed_tokens_per_s']:.1f} | "
                  f"{f(r['sealed_vs_ar'], r['sealed_vs_ar_low'])} | {f(r['sealed_vs_stock'], r['sealed_vs_stock_low'])} |",
                  "", f"Phase 0: stock {f(r['phase0_stock_vs_ar'], r['phase0_stock_vs_ar_low'])} AR; A/A "
                      f"{f(r['phase0_aa'], r['phase0_aa_low'])}.", ""]
        if r["sealed_is"]:
            lines += [f"The sealed system is {r['sealed_is']} itself: its ratio to {r['sealed_is']} above is the seal "
                      "run's noise (an A/A), not a gain.", ""]
    lines += ["## Verdicts", "", "| n | mechanism | candidate | gain | lower bound | bar | verdict |",
              "|---|---|---|---|---|---|---|"]
    for v in report["verdicts"]:
        if "skipped" in v:
            lines.append(f"| {v['size']} | {v['mechanism']} | | | | | skipped: {v['skipped']} |")
        else:
            lo = "n/a" if v["lower_bound"] is None else f"{v['lower_bound']:.4f}"
            lines.append(f"| {v['size']} | {v['mechanism']} | {v['candidate']} | {v['gain']:.4f} | {lo} | "
                         f"+{v['bar']:.2%} | {v['reason']}{forcing_reasons(v['token_forcing'])} |")
    lines += ["", f"Rule: {report['approval_rule']}.", "", f"Method: {report['method']}.", ""]
    return "\n".join(lines)


def forcing_reasons(audited: dict | None) -> str:
    """``": rule; rule"`` for a failed token-forcing check (:meth:`~specpilot.pilot.batch_pilot.BatchForcing.check`),
    else ``""``: why a candidate whose output differed was rejected."""
    return "" if not audited or audited["passed"] else ": " + "; ".join(audited["reasons"])
