"""``specpilot pilot --batch SIZES``: a first batched pilot (paper §3.3, §4.4, §5.1).

In batching every verified row costs, so the system that wins at one request can lose at sixteen; this procedure
judges systems by batch runs at every asked size (:mod:`specpilot.pilot.batch_runs`):

1. **Phase 0.** AR vs stock (stock batching: each request verifies its own top-1 chain of the stock drafter) and
   stock vs stock (A/A), each A B B A per (benchmark, size) over a few rounds with fresh salts. Stock's gain over
   AR is reported per size; the noise σ comes from the A/A as in the single-request Phase 0
   (:func:`specpilot.pilot.controller.noise_from_aa`). In float32 stock's outputs must equal AR's.
2. **Round 0.** When the A/A-bounded Phase 0 shows AR faster than stock over the sizes (the same approval rule,
   B = AR against A = stock, on the Phase 0 runs themselves), AR becomes the incumbent.
3. **Candidates**, a fixed list judged greedily against the incumbent, each built from the incumbent of that
   moment (from stock while AR is the incumbent, except prompt admission, which AR can use too): :data:`MECHANISMS`;
   the cost-model planner for batches is not built yet. All are lossless row choices.
4. **Seal.** AR, stock and the last incumbent measured interleaved (A S X, X S A) per (benchmark, size, round):
   tokens/s and speedups vs AR and vs stock with their lower bounds, per size; every output compared with AR's.

**Approval rule** (:func:`specpilot.pilot.controller.approve`, the single-request rule): the one-sided 95% lower
bound of the gain (geometric mean over benchmarks and sizes, paired bootstrap over the (benchmark, size, round)
cells) minus 1 must exceed 1% + 2σ; no thread left running, no nondeterminism. In float32 a candidate whose
output differs from the incumbent's on any variant is rejected outright: the incumbent's outputs equal AR's
(stock's are checked against AR in Phase 0, and each approved candidate equalled its incumbent), so it differs
from AR, which a lossless system never does in float32. In bfloat16 / float16 rounding may differ with the rows a
pass holds, so a candidate whose output differs is token-forced (§3.4: every output of its batch runs against the
scorer, δ and stock's figures fixed in Phase 0 from the batched AR and stock outputs) and faces the bar for
changed output, max(3%, 1% + 2σ), as in the single-request pilot; the seal audits the sealed system's outputs.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import platform
import time

import torch

from specpilot.config import SystemConfig
from specpilot.errors import SpecPilotError
from specpilot.pilot import controller as ctl
from specpilot.pilot.batch_runs import compare, measure_batches
from specpilot.pilot.forcing import Scorer, audit, delta_from_phase0, forcing_verdict
from specpilot.pilot.phase0 import RUN_MARKER, requests_for, scorer_model
from specpilot.pilot.state import Pilot, PilotOptions
from specpilot.provenance import versions

PROMPT_ADMISSION_ROWS = 256  # prompt rows a step may carry (the paper's FP8 systems admit prompts up to 384 rows)
BEST_FIRST_TOP_K = 4  # candidates per position of the best-first tree


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"1,4,16"`` -> ``(1, 4, 16)``: distinct batch sizes of at least 1, in the given order.

    Raises:
        SpecPilotError: anything else.
    """
    try:
        sizes = tuple(int(s) for s in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(n < 1 for n in sizes) or len(set(sizes)) != len(sizes):
        raise SpecPilotError(f"--batch {text!r}: give distinct batch sizes of at least 1, comma-separated, e.g. 1,4,16")
    return sizes


def _best_first(inc: SystemConfig):
    if inc.drafter == "none" or inc.tree != "chain":
        return None
    return inc.apply({"tree": "best_first", "top_k": BEST_FIRST_TOP_K})  # same nodes: the chain's rows, rearranged


def _shared(inc: SystemConfig):
    if inc.drafter == "none" or inc.row_selection == "shared_budget":
        return None
    inc = _best_first(inc) or inc  # the shared budget fills best-first trees: a chain incumbent gets one too
    return inc.apply({"row_selection": "shared_budget"})  # budget nodes x n: the equal split's total, redistributed


def _block(inc: SystemConfig):
    if inc.drafter == "none" or inc.drafter_block:
        return None
    d = inc.depth
    depths = (16, 12, 8) if d >= 16 else tuple(dict.fromkeys((d, math.ceil(3 * d / 4), math.ceil(d / 2))))
    return inc.apply({"drafter_block": depths}) if len(depths) > 1 else None


def _admission(inc: SystemConfig):
    return None if inc.prompt_admission else inc.apply({"prompt_admission": PROMPT_ADMISSION_ROWS})


#: the candidate mechanisms, in the order judged: (name, why, incumbent -> candidate or None when it does not apply)
MECHANISMS = (
    ("best_first", "the stock drafter's top-4 lattice verified as a best-first tree of the same nodes as the "
                   "chain (§4.2): no more rows per request, more accepted tokens where the drafter is unsure",
     _best_first),
    ("shared_budget", "one node budget of nodes x n per step filled best-first across requests (§4.4); on a chain "
                      "incumbent it comes with the best-first tree it needs", _shared),
    ("drafter_block", "each request drafts one of (16, 12, 8) positions, picked from its own acceptance (§4.4); a "
                      "drafter of depth D < 16 gets (D, 3D/4, D/2) rounded up", _block),
    ("prompt_admission", f"prompts admitted while requests run ride in the step's exact pass, up to "
                         f"{PROMPT_ADMISSION_ROWS} rows (§4.4)", _admission),
)


def calibrated_mechanism(path, stock: SystemConfig) -> tuple:
    """The ``calibrated`` entry of the candidate list when the run has a calibration (``--calibration``): the
    SIMULATED drafter of that file as a best-first tree of stock's node count (its depth and top-K capped at what
    the calibration measured), judged first so that the row-selection mechanisms then apply to it. Its figures are
    a simulation of the real pair's acceptance at the real drafter's cost (docs/calibrated-drafter.md).

    Raises:
        SpecPilotError: an unreadable calibration (CalibrationError).
    """
    from specpilot.spec.calibration import load_calibration

    cal = load_calibration(path)
    cfg = SystemConfig(drafter="calibrated", drafter_path=str(path), tree="best_first", nodes=max(stock.nodes, 2),
                       depth=min(cal.depth, max(stock.depth, 2)), top_k=min(cal.top_k, BEST_FIRST_TOP_K),
                       dtype=stock.dtype)
    why = (f"the calibrated drafter of {path} (SIMULATED acceptance) as a best-first tree of {cfg.nodes} nodes, depth "
           f"{cfg.depth}, top-{cfg.top_k}")
    return "calibrated", why, lambda inc: None if inc.drafter == "calibrated" else cfg


def run_batch_pilot(opts: PilotOptions, sizes: tuple[int, ...], rounds: int | None = None, rng=None) -> dict:
    """The batched pilot end to end (module doc); writes ``batch_report.json``, ``batch_report.md`` and the sealed
    ``system.json`` into ``opts.out`` and returns the report dict.

    Args:
        opts: the pilot's options (target, drafter, out, dtype, plan: per_benchmark, max_new_tokens, benchmarks).
        sizes: batch sizes. rounds: A B B A rounds per (benchmark, size), at least 2 (default: ``--rounds``, else
            3, ``--quick`` 2).
        rng: salts and order (default OS entropy; a seeded Random only for tests).
    Raises:
        SpecPilotError: an option the batched pilot does not take (agent, memory, devices, adversarial, worker
            executor), fewer than 2 rounds, no prompt that fits, float32 stock output not AR's.
    """
    unsupported = [f for f, on in (("--agent", opts.agent), ("--memory", opts.memory), ("--devices", opts.devices),
                                   ("--adversarial", opts.adversarial), ("--executor workers", opts.executor == "workers"))
                   if on]
    if unsupported:
        raise SpecPilotError(f"--batch does not take {', '.join(unsupported)} yet (the batched pilot runs in this "
                             "process, one device, a fixed candidate list)")
    if rounds is None:  # --rounds: the A B B A rounds here (the single-request pilot's planner rounds)
        rounds = (opts.overrides or {}).get("rounds") or (2 if opts.quick else 3)
    if rounds < 2:
        raise SpecPilotError(f"the batched pilot needs at least 2 rounds for a lower bound, got {rounds}")
    t0 = time.perf_counter()
    pilot = Pilot(opts)
    torch.manual_seed(opts.seed)
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / RUN_MARKER).write_text("a specpilot pilot run writes here\n")
    plan = opts.plan
    reqs = requests_for(pilot, plan)
    if not reqs:
        raise SpecPilotError("no benchmark prompt fits this target's context: nothing to measure")
    groups: dict = {}
    for r in reqs:
        groups.setdefault(r.benchmark, []).append(r)
    kw = {**pilot.salt_kw(), "rng": rng}

    def measure(systems: dict, label: str):
        pilot.say("batch", f"{label}: {len(sizes)} sizes x {len(groups)} benchmarks x {rounds} rounds")
        makers = {k: (lambda n, c=c: pilot.dep.batch_system(c, max_num_seqs=n)) for k, c in systems.items()}
        return measure_batches(makers, groups, sizes, rounds, **kw)

    pilot.say("batch", f"sizes {list(sizes)}; {len(reqs)} requests from {sorted(groups)}; stock {pilot.stock.label()}")
    p0 = measure({"ar": pilot.ar, "stock": pilot.stock}, "phase 0: AR vs stock")
    ar_stock = compare(p0, "ar", "stock")
    aa = compare(measure({"a": pilot.stock, "b": pilot.stock}, "phase 0: stock A/A"), "a", "b")
    sigma = ctl.noise_from_aa(aa)
    stock_equal = p0.equal_outputs("ar", "stock")
    pilot.say("batch", f"stock {ar_stock.gain:.3f}x AR (lower bound {ar_stock.lower_bound:.3f}); A/A {aa.gain:.4f}: "
                       f"σ = {sigma:.4f}; stock outputs {'equal' if stock_equal else 'DIFFER FROM'} AR")
    exact = opts.dtype == "float32"
    if exact and not stock_equal:
        raise SpecPilotError("stock's batched outputs differ from AR's in float32: the engine is broken, nothing to judge")
    if not exact:
        pilot.say("batch", "token forcing: δ and stock's figures from Phase 0's batched outputs")
    forcing = None if exact else BatchForcing(Scorer(scorer_model(pilot)), p0)
    verdicts, entries, incumbent = [], [], pilot.stock
    back = compare(p0, "stock", "ar")  # round 0: AR against stock on Phase 0's own runs
    audited = forcing.check(p0, "ar") if forcing is not None and back.outputs_differ else None
    v = judge_batch(back, sigma, exact, audited and audited["passed"])
    verdicts.append(_verdict("ar", "round 0: AR against stock (Phase 0's runs)", pilot.stock, pilot.ar, back, v,
                             audited))
    if v.approved:
        incumbent = pilot.ar
    mechanisms = MECHANISMS if opts.calibration is None else (calibrated_mechanism(opts.calibration, pilot.stock),
                                                                  *MECHANISMS)
    for name, why, make in mechanisms:  # with AR the incumbent, the drafter's mechanisms start from stock
        cand = make(incumbent if incumbent.drafter != "none" or name == "prompt_admission" else pilot.stock)
        if cand is None:
            verdicts.append({"mechanism": name, "why": why, "skipped": f"does not apply to {incumbent.label()}"})
            continue
        m = measure({"a": incumbent, "b": cand}, f"{cand.label()} vs {incumbent.label()}")
        run = compare(m, "a", "b")
        audited = forcing.check(m, "b") if forcing is not None and run.outputs_differ else None
        v = judge_batch(run, sigma, exact, audited and audited["passed"])
        verdicts.append(_verdict(name, why, incumbent, cand, run, v, audited))
        pilot.say("batch", f"{name}: {v.reason}")
        if v.approved:
            entries.append({"mechanism": name, "delta": cand.delta(incumbent)})
            incumbent = cand
    final = measure({"ar": pilot.ar, "stock": pilot.stock, "sealed": incumbent}, "seal: AR, stock, sealed")
    report = _report(pilot, sizes, rounds, groups, plan, ar_stock, aa, sigma, verdicts, entries, incumbent, final, t0)
    report["token_forcing"] = None if forcing is None else {**forcing.phase0, "sealed": forcing.check(final, "sealed")}
    _write(opts.out, report, incumbent, entries, pilot)
    pilot.say("done", f"sealed {incumbent.label()}; report in {opts.out}/batch_report.md")
    return report


def judge_batch(run, sigma: float, exact: bool = True, forcing_passed: bool | None = None) -> ctl.Verdict:
    """The batched pilot's approval rule (module doc) for a :class:`~specpilot.pilot.batch_runs.BatchPaired` of B
    against the incumbent A. ``exact`` (float32): output different from A's rejects (A's equals AR's). Otherwise
    :func:`specpilot.pilot.controller.approve`: bar 1% + 2σ, or max(3%, 1% + 2σ) with token forcing passed
    (``forcing_passed``; None = not run = reject) when the output differs; threads, nondeterminism reject.

    Raises:
        ValueError: negative or non-finite ``sigma``.
    """
    if exact and run.outputs_differ:
        return ctl.Verdict(False, "rejected: output differs from the incumbent's, so from AR's (float32)", run.gain,
                           run.lower_bound, ctl.BASE_BAR + 2 * sigma)
    return ctl.approve(run, sigma, forcing_passed)


class BatchForcing:
    """Token forcing of batch runs (§3.4, outside float32): ``scorer`` (a :class:`~specpilot.pilot.forcing.Scorer`),
    δ from the batched AR and stock outputs of ``p0`` (a :class:`~specpilot.pilot.batch_runs.BatchMeasured` with
    systems ``ar`` and ``stock``; :func:`~specpilot.pilot.forcing.delta_from_phase0`), stock's figures, and
    :meth:`check`."""

    def __init__(self, scorer: Scorer, p0):
        self.scorer = scorer
        ar, st = p0.samples("ar"), p0.samples("stock")
        self.delta = delta_from_phase0(self.scorer, [p for p, _, _ in ar], [o for _, o, _ in ar], [o for _, o, _ in st])
        self.stock = audit(self.scorer, st, self.delta)
        self.phase0 = {"delta": self.delta, "scorer_dtype": str(self.scorer.model.dtype).removeprefix("torch."),
                       "stock": self.stock.to_dict()}

    def check(self, m, name: str) -> dict:
        """Every output ``name`` produced in ``m`` against the scorer; ``{passed, reasons, figures}``."""
        fs = audit(self.scorer, m.samples(name), self.delta)
        passed, reasons = forcing_verdict(fs, self.stock)
        return {"passed": passed, "reasons": reasons, "mismatch_rate": fs.mismatch_rate, "events": fs.events,
                "tokens": fs.tokens, "stock_mismatch_rate": self.stock.mismatch_rate}


def _verdict(name, why, inc, cand, run, v, forcing=None) -> dict:
    return {"mechanism": name, "why": why, "incumbent": inc.label(), "candidate": cand.label(),
            "delta": cand.delta(inc), "run": run.to_dict(), "token_forcing": forcing, "approved": v.approved,
            "reason": v.reason,
            "gain": v.gain, "lower_bound": v.lower_bound if math.isfinite(v.lower_bound) else None, "bar": v.bar}


def _report(pilot, sizes, rounds, groups, plan, ar_stock, aa, sigma, verdicts, entries, sealed, final, t0) -> dict:
    vs_ar, vs_stock, st_ar = compare(final, "ar", "sealed"), compare(final, "stock", "sealed"), compare(final, "ar", "stock")
    fin = lambda x: x if math.isfinite(x) else None  # noqa: E731
    per_size = {}
    for n in sizes:
        row = {f"{k}_tokens_per_s": final.tokens_per_s(k, n) for k in ("ar", "stock", "sealed")}
        for key, run in (("sealed_vs_ar", vs_ar), ("sealed_vs_stock", vs_stock), ("stock_vs_ar", st_ar),
                         ("phase0_stock_vs_ar", ar_stock), ("phase0_aa", aa)):
            row[key], row[f"{key}_low"] = run.per_size[n]["gain"], fin(run.per_size[n]["lower_bound"])
        per_size[str(n)] = row
    dev = torch.device(pilot.o.device)
    return {
        "device": {"type": pilot.o.device, "name": torch.cuda.get_device_name(dev) if dev.type == "cuda"
                   else (platform.processor() or platform.machine()), "threads": torch.get_num_threads(),
                   "threads_reason": pilot.threads_reason, "platform": platform.platform()},
        "versions": versions(), "commit": pilot.commit,
        "deployment": {**pilot.deployment(), "batch": list(sizes)},
        "sizes": list(sizes), "rounds": rounds, "benchmarks": {b: len(r) for b, r in groups.items()},
        "max_new_tokens": plan["max_new_tokens"],
        "stock_label": pilot.stock.label(), "sealed_label": sealed.label(), "sealed_seal": sealed.seal(),
        "sigma": sigma,
        "phase0": {"stock_vs_ar": ar_stock.to_dict(), "aa": aa.to_dict(), "sigma": sigma},
        "per_size": per_size,
        "speedup_vs_ar": vs_ar.gain, "speedup_vs_ar_low": fin(vs_ar.lower_bound),
        "speedup_vs_stock": vs_stock.gain, "speedup_vs_stock_low": fin(vs_stock.lower_bound),
        "sealed_is": next((k for k, c in (("ar", pilot.ar), ("stock", pilot.stock)) if c == sealed), None),
        "outputs_equal_ar": {"stock": final.equal_outputs("ar", "stock"), "sealed": final.equal_outputs("ar", "sealed")},
        "seal_flags": {"threads_left_running": final.outside, "nondeterministic": final.nondeterministic},
        "verdicts": verdicts, "entries": entries,
        "approval_rule": "approve iff the 95% lower bound of the gain - 1 > 1% + 2σ (lossless row choices); a "
                         "candidate whose output differs from the incumbent's (= AR's) on any variant is rejected "
                         "in float32, token-forced and held to max(3%, 1% + 2σ) otherwise; threads left running or "
                         "nondeterminism reject",
        "method": "batch run = a benchmark's requests (salted variants, cycled to at least n) queued at once in a "
                  "BatchEngine of n slots; tokens/s = generated tokens / wall s of generate_all (device synced); "
                  "per (benchmark, size, round) two fresh variant sets in a palindrome (A B, B A), a system's "
                  "figure the higher of its two; gain = geometric mean over benchmarks and sizes of the geometric "
                  "mean over rounds; lower bound: paired bootstrap, (benchmark, size) strata, rounds resampled",
        "duration_s": time.perf_counter() - t0,
    }


def _write(out, report: dict, sealed: SystemConfig, entries: list, pilot: Pilot) -> None:
    system = {"config": sealed.model_dump(), "label": sealed.label(), "seal": sealed.seal(),
              "entries": [e["mechanism"] for e in entries], "deployment": report["deployment"],
              "commit": report["commit"], "date": _dt.datetime.now().isoformat(timespec="seconds")}
    (out / "batch_report.json").write_text(json.dumps(report, indent=2))
    (out / "system.json").write_text(json.dumps(system, indent=2))
    (out / "batch_report.md").write_text(render_md(report))


def render_md(report: dict) -> str:
    """The batch report as Markdown: a table per size, the verdicts, σ and the method."""
    f = lambda g, lo: f"{g:.3f}x" + (f" (≥ {lo:.3f})" if lo is not None else "")  # noqa: E731
    lines = [f"# Batched pilot: {report['sealed_label']}", "",
             f"Device {report['device']['type']} ({report['device']['name']}), commit {report['commit']}, sizes "
             f"{report['sizes']}, {report['rounds']} rounds, benchmarks {report['benchmarks']}, "
             f"{report['max_new_tokens']} new tokens; stock {report['stock_label']}; σ = {report['sigma']:.4f}.", "",
             f"Over all sizes: sealed {f(report['speedup_vs_ar'], report['speedup_vs_ar_low'])} AR, "
             f"{f(report['speedup_vs_stock'], report['speedup_vs_stock_low'])} stock (95% lower bounds); outputs "
             f"equal AR: {report['outputs_equal_ar']}."]
    if report["sealed_is"]:
        lines.append(f"The sealed system is {report['sealed_is']}'s own config: its ratio to {report['sealed_is']} is an "
                     "A/A of the seal run (noise).")
    tf = report.get("token_forcing")
    if tf:
        lines.append(f"Token forcing ({tf['scorer_dtype']} scorer, δ = {tf['delta']}): stock mismatch rate "
                     f"{tf['stock']['mismatch_rate']:.3%}; sealed {tf['sealed']['mismatch_rate']:.3%}, "
                     f"{'passed' if tf['sealed']['passed'] else 'FAILED: ' + '; '.join(tf['sealed']['reasons'])}.")
    lines.append("")
    for n, r in report["per_size"].items():
        lines += [f"## {n} request{'s' if n != '1' else ''} at once", "",
                  "| system | tokens/s | vs AR | vs stock |", "|---|---|---|---|",
                  f"| AR | {r['ar_tokens_per_s']:.1f} | 1 | |",
                  f"| stock | {r['stock_tokens_per_s']:.1f} | {f(r['stock_vs_ar'], r['stock_vs_ar_low'])} | 1 |",
                  f"| sealed | {r['sealed_tokens_per_s']:.1f} | {f(r['sealed_vs_ar'], r['sealed_vs_ar_low'])} | "
                  f"{f(r['sealed_vs_stock'], r['sealed_vs_stock_low'])} |", "",
                  f"Phase 0: stock {f(r['phase0_stock_vs_ar'], r['phase0_stock_vs_ar_low'])} AR; A/A "
                  f"{f(r['phase0_aa'], r['phase0_aa_low'])}.", ""]
    lines += ["## Verdicts", "", "| mechanism | candidate | gain | lower bound | bar | verdict |", "|---|---|---|---|---|---|"]
    for v in report["verdicts"]:
        if "skipped" in v:
            lines.append(f"| {v['mechanism']} | | | | | skipped: {v['skipped']} |")
        else:
            lo = "n/a" if v["lower_bound"] is None else f"{v['lower_bound']:.4f}"
            lines.append(f"| {v['mechanism']} | {v['candidate']} | {v['gain']:.4f} | {lo} | +{v['bar']:.2%} | "
                         f"{v['reason']} |")
    lines += ["", f"Rule: {report['approval_rule']}.", "", f"Method: {report['method']}.", ""]
    return "\n".join(lines)
