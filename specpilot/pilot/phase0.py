"""Setup and Phase 0 of a pilot run (paper §3.3, §3.4).

:func:`prepare` measures the device's peaks, sizes the plan from measured step times (:mod:`.budget`), builds
the request set and prints the expected duration; :func:`run_phase0` measures AR against stock and stock
against itself (paired A B B A runs on salted prompts), which fix the stock noise σ, the near-tie threshold δ
and stock's token-forcing figures, and returns what the later phases need of them.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from specpilot.errors import SpecPilotError
from specpilot.model.checkpoint import load_model
from specpilot.pilot import controller as ctl
from specpilot.pilot.audit import write_outputs
from specpilot.pilot.budget import size_plan
from specpilot.pilot.forcing import Scorer
from specpilot.pilot.memory import Memory
from specpilot.pilot.profiler import measure_peaks
from specpilot.pilot.setup import build_requests
from specpilot.pilot.state import Pilot


@dataclass
class Phase0Result:
    """What Phase 0 hands on: ``report`` (the report's ``phase0`` section: stock vs AR, A/A, σ, δ, stock's
    forcing figures and outputs file), ``stock_vs_ar`` (stock's gain over AR; below 1, round 0 judges AR)
    and the replay inputs: ``prompts`` (the first salted variant of every request) and ``ar_outputs``
    (AR's output on it)."""

    report: dict
    stock_vs_ar: float
    prompts: list
    ar_outputs: list


RUN_MARKER = ".specpilot-pilot"  # written first into a pilot's --out (the CLI's check_report_dir reads it)


def clear_old_memory(pilot: Pilot) -> None:
    """Remove the entries an earlier run left in ``OUT/memory`` (this run rewrites the report beside them;
    left there, they would be listed, checked and reused as if this run had approved them). Only entry
    directories go (:meth:`Memory.ids`: those holding ``entry.json`` or a delta file); anything else a user
    put there stays (a rule that removed every directory once deleted a user's notes folder)."""
    pilot.o.out.mkdir(parents=True, exist_ok=True)  # marks the directory as a pilot's before any output, so a run
    (pilot.o.out / RUN_MARKER).write_text("a specpilot pilot run writes here\n")  # that fails can be rerun here
    mem = pilot.o.out / "memory"
    old = [mem / i for i in Memory(mem).ids()] if mem.is_dir() else []
    if old:
        pilot.say("setup", f"{mem}: removing {len(old)} entr{'y' if len(old) == 1 else 'ies'} of an earlier run "
                           "(this run rewrites the report)")
        for p in old:
            shutil.rmtree(p)


def requests_for(pilot: Pilot, plan: dict) -> list:
    """The request set of ``plan``: ``per_benchmark`` prompts of every benchmark (of the first ``benchmarks``
    of the mix, when set) that fit the engine's context with ``max_new_tokens`` new tokens and the salt."""
    context = min(pilot.dep.target.args.max_position_embeddings, 4096)  # the engine's max_len
    reqs = [r for r in build_requests(pilot.dep, plan["per_benchmark"], plan["max_new_tokens"], pilot.o.prompts)
            if len(r.prompt_ids) + ctl.SALT_TOKENS + r.max_new_tokens <= context]  # room for the salt
    keep = list(dict.fromkeys(r.benchmark for r in reqs))[: plan.get("benchmarks") or None]
    return [r for r in reqs if r.benchmark in keep]


def prepare(pilot: Pilot) -> None:
    """Setup: device peaks, the plan sized from measured step times (:func:`.budget.size_plan`), the request
    set and the expected duration, printed before anything long starts.

    Raises:
        SpecPilotError: no benchmark prompt fits the target's context.
    """
    o = pilot.o
    pilot.say("setup", f"target {o.target}  drafter {o.drafter or 'ngram'}  device {o.device}  dtype {o.dtype}")
    pilot.peaks = measure_peaks(o.device, pilot.dep.target.dtype, seconds_budget=1.5)
    pilot.say("setup", f"peaks: {pilot.peaks.flops_per_s / 1e9:.1f} GFLOP/s, {pilot.peaks.bytes_per_s / 1e9:.1f} GB/s")
    if pilot.dep.tokenizer is None:
        pilot.say("setup", f"{pilot.dep.target_dir} has no tokenizer: prompts fed as UTF-8 byte ids (timing only)")
    if not requests_for(pilot, pilot.plan):  # a smaller plan only lets more prompts fit
        context = min(pilot.dep.target.args.max_position_embeddings, 4096)
        raise SpecPilotError(f"no benchmark prompt fits this target (context {context} tokens, "
                             f"{pilot.plan['max_new_tokens']} new tokens): nothing to measure")
    pilot.plan, pilot.duration = size_plan(pilot, lambda plan: requests_for(pilot, plan))
    plan = pilot.plan
    pilot.reqs = requests_for(pilot, plan)
    benchmarks = sorted({r.benchmark for r in pilot.reqs})
    pilot.say("setup", f"{len(pilot.reqs)} requests from {benchmarks}")
    per = {b: sum(r.benchmark == b for r in pilot.reqs) for b in benchmarks}
    short = {b: n for b, n in per.items() if n < plan["per_benchmark"]}
    if short:
        pilot.say("setup", f"[yellow]fewer than --per-benchmark {plan['per_benchmark']} requests: "
                  + ", ".join(f"{b} {n}" for b, n in short.items())
                  + " (prompts available that fit the context)[/]")
    pilot.say("setup", pilot.duration["line"])


def scorer_model(pilot: Pilot):
    """The scorer's target (§3.4): the deployment's own (the paper: stock's target, FP32 head) or, with
    ``scorer_dtype="float32"`` on a lower-precision deployment, a float32 copy loaded from the checkpoint, so
    that stock and every candidate are compared to the unrounded arithmetic instead of to stock's own
    rounding (on flat logits a bf16 scorer shares stock's kernels and so favours stock over a lossless
    kernel with another accumulation order, e.g. W12, which then fails on near-ties alone). Costs a float32
    copy of the target in device memory (32 GB for an 8B)."""
    want = pilot.o.scorer_dtype
    if want is None or want == pilot.o.dtype:
        return pilot.dep.target
    pilot.say("setup", f"token forcing scorer: {want} copy of {pilot.dep.target_dir}")
    return load_model(pilot.dep.target_dir, want, pilot.o.device)


def run_phase0(pilot: Pilot) -> Phase0Result:
    """AR vs stock and stock A/A through :func:`.controller.phase0`; sets ``pilot.scorer`` and
    ``pilot.controller`` (σ, δ, stock's forcing figures) and writes stock's outputs for the re-audit.

    Raises:
        ValueError: as :func:`.controller.phase0` (e.g. no benchmark with two requests).
    """
    pilot.say("phase 0", "AR vs stock and stock A/A (paired A B B A on salted prompts)")
    pilot.scorer = Scorer(scorer_model(pilot))
    bar, advance = pilot.progress("phase 0 paired runs", 8 * len(pilot.reqs))
    with bar:
        p0 = ctl.phase0(pilot.factory(pilot.ar), pilot.factory(pilot.stock), pilot.reqs, pilot.scorer,
                        progress=advance, executor=pilot.dispatch.executor(0), **pilot.salt_kw())
    ar_stock, aa, pilot.controller = p0.ar_stock, p0.aa, p0.controller
    sigma = pilot.sigma
    pilot.say("phase 0", f"stock {pilot.stock.label()}: {ar_stock.gain:.3f}x AR "
                         f"(95% lower bound {ar_stock.lower_bound:.3f})")
    report = {"stock_vs_ar_gain": ar_stock.gain, "stock_vs_ar_lower_bound": ar_stock.lower_bound,
              "aa_gain": aa.gain, "aa_lower_bound": aa.lower_bound, "sigma": sigma}
    pilot.say("phase 0", f"stock A/A gain {aa.gain:.4f}: noise σ = {sigma:.4f}")
    if sigma > 0.05:
        pilot.say("phase 0", f"[yellow]warning: stock noise σ = {sigma:.1%} is high (another busy process?); "
                  f"only gains above {0.01 + 2 * sigma:.0%} can be approved in this run[/]")
    report.update({"delta": pilot.delta, "stock_forcing": pilot.stock_forcing.to_dict(),
                   "stock_outputs": str(write_outputs(pilot.o.out / "outputs" / "stock_phase0.jsonl",
                                                      ar_stock.samples("b")).relative_to(pilot.o.out))})
    sf = pilot.stock_forcing
    pilot.say("phase 0", f"δ = {pilot.delta}; stock mismatch rate {sf.mismatch_rate:.3%}, events {sf.events}")
    return Phase0Result(report, ar_stock.gain, prompts=[list(ps[0]) for ps in ar_stock.prompts],
                        ar_outputs=[list(os_[0]) for os_ in ar_stock.outputs_a])
