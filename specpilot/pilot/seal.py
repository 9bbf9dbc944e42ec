"""The seal of a pilot run and its report (paper §3.4, §3.5, §5.1).

The last incumbent is sealed, re-measured against AR and stock in one interleaved run (the headline
speedups and, from the same runs, τ, T_AR, T_step and c), audited by token forcing against stock's Phase 0
figures, reproduced from stock + its memory entries, and written as ``report.json`` / ``report.md`` / plots
and ``system.json``.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import platform
from pathlib import Path

import torch

from specpilot.pilot import controller as ctl
from specpilot.pilot.audit import write_outputs
from specpilot.pilot.bootstrap import gain_and_bound
from specpilot.pilot.budget import finish
from specpilot.pilot.ceiling import ceiling
from specpilot.pilot.costinputs import CostInputs, tau_curves
from specpilot.pilot.predictions import prediction_check
from specpilot.pilot.forcing import audit, forcing_verdict, mismatch_allowance
from specpilot.pilot.phase0 import Phase0Result
from specpilot.pilot.report import write_report
from specpilot.pilot.rounds import Search
from specpilot.pilot.state import Pilot
from specpilot.pilot.steps import StepRecorder, StepStats, c_of
from specpilot.provenance import versions


def headline_run(pilot: Pilot, sealed):
    """AR, stock and the sealed system interleaved per request on fresh salted variants (the controller's
    :func:`~specpilot.pilot.paired.interleaved_run`). Returns ``(run, steps)``: ``steps`` maps each name to its
    :class:`StepStats` read from these very runs (NaN figures when the sealed system runs an approved patch in
    worker processes, which return tokens and times only)."""
    bar, advance = pilot.progress("AR, stock, sealed interleaved", 6 * len(pilot.reqs))
    rec = StepRecorder()
    with bar:
        if pilot.code_tree is None:  # in this process: the recorder reads step times from these very runs
            makers = {n: rec.wrap(n, lambda c=c: pilot.dep.system(c))
                      for n, c in (("ar", pilot.ar), ("stock", pilot.stock), ("sealed", sealed))}
            final = ctl.interleaved_run(makers, pilot.reqs, progress=rec.progress(advance), **pilot.salt_kw())
        else:  # the sealed system runs an approved patch: worker processes (no step times from them)
            makers = {"ar": pilot.factory(pilot.ar), "stock": pilot.factory(pilot.stock),
                      "sealed": pilot.factory(sealed, pilot.code_tree)}
            final = ctl.interleaved_run(makers, pilot.reqs, progress=advance, executor=pilot.dispatch.executor(0),
                                        **pilot.salt_kw())
    if pilot.code_tree is None:
        return final, {n: rec.stats(n, final.prompts) for n in ("ar", "stock", "sealed")}
    nan = StepStats(float("nan"), float("nan"), float("nan"), 0, 0)
    return final, {n: nan for n in ("ar", "stock", "sealed")}


def seal(pilot: Pilot, p0: Phase0Result, inputs: CostInputs, search: Search, adversarial: list) -> dict:
    """Seal ``search.incumbent``, re-measure it against AR and stock in one interleaved run, audit it, check
    that its entries reproduce it from stock, and write the report directory; returns the report dict."""
    o, sealed, entries = pilot.o, search.incumbent, search.entries
    o.out.mkdir(parents=True, exist_ok=True)
    pilot.say("seal", f"sealed system {sealed.label()} ({sealed.seal()[:12]})")
    final, steps = headline_run(pilot, sealed)
    vs_ar = final.gain("ar", "sealed")
    vs_stock = final.gain("stock", "sealed")
    c_sealed, c_stock = c_of(steps["sealed"], steps["ar"]), c_of(steps["stock"], steps["ar"])
    pilot.c_measured.append({"label": f"sealed {sealed.label()}", "N": steps["sealed"].rows - 1, "c": c_sealed,
                             "source": "seal's interleaved headline run"})
    outputs = final.samples("sealed")
    outputs_file = write_outputs(o.out / "outputs" / "sealed.jsonl", outputs).relative_to(o.out)
    forcing = audit(pilot.scorer, outputs, pilot.delta)
    passed, reasons = forcing_verdict(forcing, pilot.stock_forcing)
    check = search.memory.check_all(pilot.stock, sealed, [e.id for e in entries])
    pilot.say("seal", f"{vs_ar[0]:.3f}x AR (lower bound {vs_ar[1]:.3f}), {vs_stock[0]:.3f}x stock "
              f"(lower bound {vs_stock[1]:.3f}); τ {steps['sealed'].tau:.2f}, c {c_sealed:.3f}; token forcing "
              f"{'passed' if passed else 'FAILED'}; reproduction check {'ok' if check.ok else 'FAILED'}")
    scorer_dtype = str(pilot.scorer.model.dtype).removeprefix("torch.")
    reaudit = lambda dtype=None: reaudit_command(pilot, p0, outputs_file, dtype)  # noqa: E731
    if not passed:
        pilot.say("seal", f"[yellow bold]warning: the sealed system {sealed.label()} failed token forcing: "
                  f"{'; '.join(reasons)}[/]")
        if scorer_dtype != "float32":
            pilot.say("seal", f"[yellow]a {scorer_dtype} scorer rounds like stock's own kernels, so on flat logits a "
                      "lossless kernel with another accumulation order can fail on near-ties alone; the same audit "
                      f"against a float32 scorer: cd {o.out} && {reaudit('float32')}[/]")
    if vs_ar[0] < 1:
        pilot.say("seal", f"[yellow bold]warning: the sealed system {sealed.label()} is slower than AR in this run "
                  f"({vs_ar[0]:.3f}x, lower bound {vs_ar[1]:.3f}); see the report[/]")
    ceil, _ = ceiling(pilot, sealed)
    sf = pilot.stock_forcing
    system = {"config": sealed.model_dump(), "label": sealed.label(), "seal": sealed.seal(),
              "entries": [e.id for e in entries], "deployment": pilot.deployment(),
              "commit": pilot.commit, "date": _dt.datetime.now().isoformat(timespec="seconds")}
    report = {
        "device": {"type": o.device, "name": pilot.peaks.device_name, "threads": torch.get_num_threads(),
                   "threads_reason": pilot.threads_reason, "platform": platform.platform(),
                   "peaks": pilot.peaks.to_dict()},
        "versions": versions(), "commit": system["commit"], "deployment": pilot.deployment(),
        "requests": len(pilot.reqs), "max_new_tokens": pilot.plan["max_new_tokens"], "quick": o.quick,
        "ar_tokens_per_s": final.tokens_per_s("ar"), "stock_tokens_per_s": final.tokens_per_s("stock"),
        "sealed_tokens_per_s": final.tokens_per_s("sealed"),
        "speedup_vs_ar": vs_ar[0], "speedup_ci_low": vs_ar[1],
        "speedup_vs_stock": vs_stock[0], "speedup_vs_stock_ci_low": vs_stock[1],
        "benchmarks": benchmark_table(final),
        "headline_method": "AR, stock and sealed interleaved per request on two fresh salted variants "
                           "(A S X on one, X S A on the other), a request's tokens/s the higher of its two runs; "
                           "tokens/s = geometric mean over benchmarks of per-request tokens/s",
        "headline_flags": {"threads_left_running": final.outside, "nondeterministic": final.nondeterministic},
        "phase0": p0.report,
        "sealed_label": sealed.label(), "sealed_seal": sealed.seal(), "stock_label": pilot.stock.label(),
        "tau": steps["sealed"].tau, "c": c_sealed, "ar_step_ms": steps["ar"].step_ms,
        "step_ms": steps["sealed"].step_ms, "rows": steps["sealed"].rows, "stock_c": c_stock,
        "steps": {n: st.to_dict() for n, st in steps.items()},
        "steps_method": "τ, T_AR, T_step and c from the seal's interleaved headline run itself: per system and "
                        "request the timed run with the lowest decode ms per step; T = Σ decode ms / Σ steps "
                        "(prefill excluded, engine timer); c = T_step(sealed) / T_AR",
        "cost_inputs": inputs.report,
        "ceiling": {**ceil.factors(), "value": ceil.ceiling, "detail": ceil.to_dict(),
                    "tau_best_source": pilot.tau_best_source},
        "sigma": pilot.sigma,
        "token_forcing": {**forcing.to_dict(), "stock_mismatch_rate": sf.mismatch_rate,
                          "stock_event_rate": sf.event_rate, "stock_events": sf.events,
                          "passed": passed, "reasons": reasons, "outputs": str(outputs_file),
                          "stock_outputs": p0.report["stock_outputs"],
                          "allowance": mismatch_allowance(forcing, sf),
                          "scorer_dtype": scorer_dtype,
                          "reaudit_float32_command": reaudit("float32") if scorer_dtype != "float32" else None,
                          "reaudit_command": reaudit()},
        "reproduction_check": {"entries": check.entries, "sealed": check.sealed, "ok": check.ok},
        "entries": [{"id": e.id, "title": e.title, "gain": e.evidence.gain, "lower_bound": e.evidence.lower_bound,
                     "requires": e.requires, "delta": e.delta, "reused_from": e.reused_from} for e in entries],
        "memory_source": str(pilot.source.root) if pilot.source is not None else None, "reused": search.reused,
        "candidates": search.candidates, "rounds": search.rounds, "tau_curve": {**inputs.tau_curve, **sealed_tau_curves(pilot, sealed)},
        "c_curve": inputs.c_curve, "adversarial": adversarial,
        "execution": {"mode": pilot.dispatch.mode, "slots": [list(sl) for sl in pilot.dispatch.slots],
                      "paired_devices": any(len(sl) == 2 for sl in pilot.dispatch.slots), "agent": o.agent},
        "c_curve_method": "cost model without drafting: (T_spec + T_pass(N+1)) / T_AR, the pass times made "
                          "monotone in rows, T_spec calibrated on stock's measured step (cost_inputs."
                          "spec_overhead_source), T_AR and pass times from the cost-model inputs",
        "c_measured": pilot.c_measured,
        "predictions": {**prediction_check(pilot.predictions), "screened": pilot.predictions},
        "duration": finish(pilot),
    }
    write_report(o.out, report)
    (o.out / "system.json").write_text(json.dumps(system, indent=2))
    d = report["duration"]
    pilot.say("done", f"took {d['actual_s'] / 60:.1f} min (expected {d['estimate_s'] / 60:.1f} min)")
    pilot.say("done", f"report in {o.out}/report.md")
    return report


def reaudit_command(pilot: Pilot, p0: Phase0Result, outputs_file: Path, dtype: str | None = None) -> str:
    """The ``specpilot audit`` command line that repeats the seal's audit (same target, scorer dtype and
    device, δ, stock's Phase-0 outputs as the reference), run from the report directory: the outputs' paths are
    relative to it, so the line still works where the directory was copied whole (the target's path is as this run
    was given it). ``dtype``: another scorer dtype (``float32``: the same audit against unrounded arithmetic)."""
    from specpilot.zoo import bundled_target_dir

    o, target = pilot.o, pilot.dep.target_dir
    tgt = ("$(specpilot zoo path --json | python3 -c 'import json,sys; print(json.load(sys.stdin)[\"target\"])')"
           if target.resolve() == Path(bundled_target_dir()).resolve() else str(target))
    dtype = dtype or str(pilot.scorer.model.dtype).removeprefix("torch.")
    if not target.is_absolute() and tgt == str(target):  # the outputs' paths are the report directory's
        tgt = str(target.resolve())
    return (f"specpilot audit --target {tgt} --outputs {outputs_file} "
            f"--reference {p0.report['stock_outputs']} --delta {pilot.delta:g} --dtype {dtype} "
            f"--device {o.device}")


def benchmark_table(final) -> dict:
    """Per benchmark, from the seal's interleaved run: requests, tokens/s of AR / stock / sealed (geometric
    mean over its requests) and the sealed system's gain vs AR and vs stock with its one-sided 95% lower
    bound (paired bootstrap over the benchmark's requests, :func:`.bootstrap.gain_and_bound`; None when
    the benchmark has a single request)."""
    out: dict[str, dict] = {}
    for b in dict.fromkeys(r.benchmark for r in final.requests):
        idx = [i for i, r in enumerate(final.requests) if r.benchmark == b]
        row: dict = {"requests": len(idx)}
        for n in ("ar", "stock", "sealed"):
            row[f"{n}_tokens_per_s"] = math.exp(sum(math.log(final.tps[n][i]) for i in idx) / len(idx))
        for base in ("ar", "stock"):
            _, g, low, method = gain_and_bound([b] * len(idx), [final.tps[base][i] for i in idx],
                                               [final.tps["sealed"][i] for i in idx])
            row[f"vs_{base}"], row[f"vs_{base}_low"] = g, (low if math.isfinite(low) else None)
            row[f"vs_{base}_method"] = method
        out[b] = row
    return out


def sealed_tau_curves(pilot: Pilot, sealed) -> dict:
    """The τ-vs-N curves of the sealed system's own drafter when it is not the deployment's (a run with a draft
    model that seals n-gram plots both; an eagle3 drafter's from its checkpoint at its top-K); none for AR or a block
    drafter."""
    if sealed.drafter in ("none", "block", pilot.drafter_kind):
        return {}
    if sealed.drafter == "eagle3":
        return tau_curves(pilot, "eagle3", sealed.drafter_path, sealed.top_k)
    return tau_curves(pilot, sealed.drafter)
