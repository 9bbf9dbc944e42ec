"""``specpilot pilot --batch SIZES``: the batched pilot, one incumbent and one seal per batch size (paper §2.2,
§3.3, §4.4, §5.1, §6).

In batching every verified row costs, so the system that wins at one request can lose at sixteen; this procedure
judges systems by batch runs (:mod:`specpilot.pilot.batch_runs`) at every asked size, and at each size separately:

1. **Phase 0.** AR vs stock (stock batching: each request verifies its own top-1 chain of the stock drafter) and
   stock vs stock (A/A), each A B B A per (benchmark, size) over a few rounds with fresh salts. Per size: stock's
   gain over AR, and the noise σ of that size's A/A (:func:`specpilot.pilot.controller.noise_from_aa` over that
   size's cells). In float32 stock's outputs must equal AR's up to rounding ties (below).
2. **Round 0.** Per size, stock against AR on Phase 0's runs at that size; approved, stock is that size's
   incumbent, else AR is: speculation must pay for its rows before any of it is sealed, so a size where no drafted
   row earns its cost seals AR (the batched pilot is never slower than AR beyond its noise).
3. **Shared budgets.** The target's batched pass is measured untimed by total rows at every size up to the largest
   (:mod:`specpilot.pilot.batch_budget`): the budget of a step over m requests is the drafted rows the pass can add
   within its flat region; the ``shared_budget`` candidate carries them (``SystemConfig.shared_budget``).
4. **Candidates**: the drafters given (``--calibration``'s, each ``--block`` / ``--eagle3`` checkpoint:
   :func:`~specpilot.pilot.batch_mechanisms.learned_mechanism`), then a fixed list
   (:func:`~specpilot.pilot.batch_mechanisms.mechanisms_for` the device), each judged
   at each size against that size's incumbent of that moment, built from it (from stock while AR is the incumbent,
   except prompt admission and the certified head, which AR can use too), measured at that size only; approved at a
   size, it becomes that size's incumbent. A candidate can be approved at 1 and rejected at 16. All are lossless:
   row choices, and on the CPU the certified head (§4.1).
5. **Seal.** Per size, AR, stock and that size's incumbent measured interleaved (A S X, X S A) per (benchmark,
   round): tokens/s and speedups vs AR and vs stock with their lower bounds; every output compared with AR's. An
   incumbent slower than AR there, or whose lower bound against AR is under :data:`SEAL_FLOOR`, gives way to AR
   (measured in the same runs; the report says so). One sealed system per size (:mod:`specpilot.pilot.batch_report`: ``system_n{n}.json``, ``system.json`` the
   smallest size's).

**Resume.** Every finished measurement (Phase 0's, the pass-cost tables, each candidate's, each seal's) is journaled
in ``--out`` as it ends (:mod:`specpilot.pilot.batch_journal`); the same command again in the same directory reads
them back and measures only what is left, so a pilot longer than one GPU call completes over several.

**Approval rule** at size n (:func:`judge_batch`, :func:`specpilot.pilot.controller.approve`): the one-sided 95%
lower bound of the gain over that size's cells (geometric mean over benchmarks, paired bootstrap over the
(benchmark, round) cells) minus 1 must exceed 1% + 2σ_n; no thread left running, no nondeterminism. In float32 a
candidate whose output differs from the incumbent's is rejected unless every token of each differing output is the
float32 scorer's argmax up to rounding (:func:`specpilot.pilot.forcing.rounding_ties`, margin at most
:data:`~specpilot.pilot.forcing.F32_TIE`): a CPU pass's GEMMs round by its row count, so a lossless tree may part
from AR's one row at an exact tie; such a candidate faces the lossless bar. In bfloat16 / float16 rounding may differ with the
rows a pass holds, so a candidate whose output differs is token-forced (§3.4: every output of its batch runs
against the scorer, δ and stock's figures fixed in Phase 0 from the batched AR and stock outputs) and faces the bar
for changed output, max(3%, 1% + 2σ_n); the seal audits every size's sealed outputs.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from specpilot.errors import SpecPilotError
from specpilot.pilot import controller as ctl
from specpilot.pilot.batch_budget import FLAT_TOLERANCE, measure_pass_ms, shared_budgets
from specpilot.pilot.batch_journal import BatchJournal, machine_name, run_header
from specpilot.pilot.batch_budget_replay import Replays
from specpilot.pilot.batch_mechanisms import (MECHANISMS, best_first_tree, calibrated_mechanism, learned_mechanism,
                                              mechanisms_for)
from specpilot.pilot.batch_report import build_report, forcing_reasons, verdict_record, write_outputs
from specpilot.pilot.batch_runs import BatchMeasured, compare, measure_batches
from specpilot.pilot.forcing import ForcingStats, Scorer, audit, delta_from_phase0, forcing_verdict, rounding_ties
from specpilot.pilot.phase0 import RUN_MARKER, requests_for, scorer_model
from specpilot.pilot.state import Pilot, PilotOptions

#: a size's sealed system must run at least this against AR in the seal's own runs (95% lower bound, and a gain of
#: at least 1), the bar ``specpilot bench --batch`` holds the seals to; else that size seals AR, measured in the
#: same runs. Approvals are judged on earlier runs, perhaps on another GPU of the same name (a journal is resumed on
#: whatever "cuda" the next call gets: an H100's approvals at 2 and 4 requests ran 0.98x and 0.85x AR on an H200).
SEAL_FLOOR = 0.98
#: the candidates built on AR itself when AR is a size's incumbent (the others start from stock)
AR_TOO = ("prompt_admission", "lm_head_int8")

__all__ = ["MECHANISMS", "BatchForcing", "calibrated_mechanism", "judge_batch", "parse_sizes", "run_batch_pilot"]


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


def run_batch_pilot(opts: PilotOptions, sizes: tuple[int, ...], rounds: int | None = None, rng=None, *,
                    pass_ms=None, adjust=None) -> dict:
    """The batched pilot end to end (module doc); writes ``batch_report.json``, ``batch_report.md``,
    ``system_n{n}.json`` per size and ``system.json`` into ``opts.out`` and returns the report dict.

    Args:
        opts: the pilot's options (target, drafter, out, dtype, plan: per_benchmark, max_new_tokens, benchmarks).
        sizes: batch sizes. rounds: A B B A rounds per (benchmark, size), at least 2 (default: ``--rounds``, else
            3, ``--quick`` 2).
        rng: salts and order (default OS entropy; a seeded Random only for tests).
        pass_ms: ``m -> {total rows: ms}``, the batched pass's cost table at m requests (default
            :func:`~specpilot.pilot.batch_budget.measure_pass_ms` on the deployment's target; tests give a table).
        adjust: test seam: ``adjust(systems, measured)`` after every measurement (``systems``: name ->
            :class:`SystemConfig`, ``measured``: its :class:`BatchMeasured`), e.g. to set throughputs by config so
            that verdicts do not depend on timing; None in every real run.
    Raises:
        SpecPilotError: an option the batched pilot does not take (agent, memory, devices, adversarial, worker
            executor), fewer than 2 rounds, no prompt that fits, float32 stock output not AR's.
    """
    unsupported = [f for f, on in (("--agent", opts.agent), ("--memory", opts.memory), ("--devices", opts.devices),
                                   ("--adversarial", opts.adversarial), ("--executor workers", opts.executor == "workers"))
                   if on]
    if unsupported:
        raise SpecPilotError(f"--batch does not take {', '.join(unsupported)} yet (the batched pilot runs in this "
                             "process, one device, a fixed candidate list and the drafters given)")
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
    # each slot holds the longest request, not the target's whole context: at 32 slots of SmolLM2's 4,096 positions
    # in float32 an engine held 6 GB of K/V, and a seal holds three engines at once
    max_len = max(len(r.prompt_ids) + r.max_new_tokens for r in reqs) + ctl.SALT_TOKENS + 1

    journal = BatchJournal(opts.out, run_header(opts, sizes, rounds), machine_name(opts.device))
    if journal.resumed:
        made = journal.machines()
        pilot.say("batch", f"resuming: {journal.resumed} finished measurements from {journal.path}"
                  + (f"; measured on {made}, this run on {journal.machine}: its verdicts mix machines"
                     if set(made) - {journal.machine} else ""))

    def measure(systems: dict, label: str, at=sizes) -> BatchMeasured:
        makers = {k: (lambda n, c=c: pilot.dep.batch_system(c, max_num_seqs=n, max_len=max_len,
                                                             compile_cpu=opts.compile_cpu))
                  for k, c in systems.items()}
        key = f"{label} @ {list(at)} :: " + ", ".join(f"{k}={c.seal()}" for k, c in systems.items())
        m, old = journal.measured(key, lambda: measure_batches(makers, groups, at, rounds, **kw))
        pilot.say("batch", f"{label}: sizes {list(at)} x {len(groups)} benchmarks x {rounds} rounds"
                           + (" (from the journal)" if old else ""))
        if adjust is not None:
            adjust(systems, m)
        return m

    pilot.say("batch", f"sizes {list(sizes)}; {len(reqs)} requests from {sorted(groups)}; stock {pilot.stock.label()}")
    t_p0 = time.perf_counter()
    p0 = measure({"ar": pilot.ar, "stock": pilot.stock}, "phase 0: AR vs stock")
    ar_stock = compare(p0, "ar", "stock")
    aa_m = measure({"a": pilot.stock, "b": pilot.stock}, "phase 0: stock A/A")
    if journal.get("phase0_s") is None:
        journal.put("phase0_s", time.perf_counter() - t_p0)
    drafters = ([calibrated_mechanism(opts.calibration, pilot.stock)] if opts.calibration is not None else []) + [
        learned_mechanism("block", d, pilot.stock, pilot.dep.block_net(d).cfg.block_size) for d in opts.blocks] + [
        learned_mechanism("eagle3", d, pilot.stock) for d in opts.eagle3]  # drafter swaps first: the rest apply to them
    listed = mechanisms_for(pilot.dep.device, pilot.dep.target.lm_head.weight)
    n_mech = len(listed) + len(drafters)
    held = "; less what the journal holds" if journal.resumed else ""
    pilot.say("batch", f"expected duration: about {expected_rest_s(journal.get('phase0_s'), n_mech) / 60:.1f} "
                       f"min more ({n_mech} candidates a size and the seal, priced by Phase 0's own runs{held})")
    aa = compare(aa_m, "a", "b")
    sigma = {n: ctl.noise_from_aa(compare(aa_m.at(n), "a", "b")) for n in sizes}  # each size's own noise
    stock_equal = p0.equal_outputs("ar", "stock")
    pilot.say("batch", f"stock vs AR by size {_by_size(ar_stock)}; σ by size "
                       f"{ {n: round(s, 4) for n, s in sigma.items()} }; stock outputs "
                       f"{'equal' if stock_equal else 'DIFFER FROM'} AR")
    exact = opts.dtype == "float32"
    if not exact:
        pilot.say("batch", "token forcing: δ and stock's figures from Phase 0's batched outputs")
    forcing = None if exact else BatchForcing(Scorer(scorer_model(pilot)), p0)
    ties = Scorer(pilot.dep.target) if exact else None  # float32: outputs may part from AR's at rounding ties only
    if exact and not stock_equal:
        got = rounding_ties(ties, p0.differing("ar", "stock"))
        if not got["passed"]:
            raise SpecPilotError("stock's batched outputs differ from AR's in float32 beyond rounding ties ("
                                 f"{got['reasons'][0]}): the engine is broken, nothing to judge")
        pilot.say("batch", f"stock's outputs part from AR's at float32 rounding ties only (largest margin "
                           f"{got['largest_margin']:.2g} nats over {got['tokens']} tokens): the lossless bar holds")
    stack = pilot.dep.compiled_stack() if opts.compile_cpu else None  # the flat region of the pass served
    bases = [best_first_tree(pilot.stock) or pilot.stock] + [make(pilot.ar) for _, _, make in drafters]  # the
    # drafters a shared budget's candidate can have
    replays = Replays(pilot.dep, p0, sizes, journal)
    worth = {m: replays.worth(bases, m) for m in range(1, max(sizes) + 1)}  # how far a pass's cost is worth timing
    pass_fn = pass_ms or (lambda m: measure_pass_ms(pilot.dep.target, m, stack=stack, worth=worth[m]))

    def table(m: int) -> dict[int, float]:  # journaled like every measurement
        if journal.get(f"pass_ms m={m}") is None:
            journal.put(f"pass_ms m={m}", {str(r): t for r, t in pass_fn(m).items()})
        return {int(r): t for r, t in journal.get(f"pass_ms m={m}").items()}

    budgets, tables = shared_budgets(max(sizes), table)
    pilot.say("batch", f"shared budget by batch size 1..{max(sizes)} (flat region of the batched pass): {list(budgets)}")

    def budgets_for(inc) -> tuple:  # the shared budget of inc's drafter: replayed over the measured pass
        said = len(replays.report)
        got = replays.budgets(best_first_tree(inc) or inc, tables, budgets)
        if len(replays.report) > said:
            pilot.say("batch", f"shared budget of {inc.drafter} by replay, sizes {list(sizes)}: "
                               f"{[got[n - 1] for n in sizes]}")
        return got
    verdicts, incumbent, entries = [], {n: pilot.ar for n in sizes}, {n: [] for n in sizes}
    for n in sizes:  # round 0: stock against AR on Phase 0's own runs at that size; speculation pays for its rows
        p0n = p0.at(n)
        fwd = compare(p0n, "ar", "stock")
        audited = _audit(forcing, ties, p0n, "ar", "stock", n) if fwd.outputs_differ else None
        v = judge_batch(fwd, sigma[n], exact, audited and audited["passed"])
        verdicts.append(verdict_record("stock", "round 0: stock against AR (Phase 0's runs)", n, pilot.ar,
                                       pilot.stock, fwd, v, audited))
        pilot.say("batch", f"n={n} stock: {v.reason}{forcing_reasons(audited)}")
        if v.approved:
            incumbent[n] = pilot.stock
    mechanisms = (*drafters, *listed)
    for name, why, make in mechanisms:
        for n in sizes:
            inc = incumbent[n]  # with AR the incumbent, the drafter's mechanisms start from stock
            base = inc if inc.drafter != "none" or name in AR_TOO else pilot.stock
            cand = make(base, budgets_for(base) if name == "shared_budget" else budgets)
            if cand is None:
                verdicts.append({"mechanism": name, "why": why, "size": n,
                                 "skipped": f"does not apply to {inc.label()}"})
                continue
            m = measure({"a": inc, "b": cand}, f"n={n}: {cand.label()} vs {inc.label()}", (n,))
            run = compare(m, "a", "b")
            audited = _audit(forcing, ties, m, "a", "b", n) if run.outputs_differ else None
            v = judge_batch(run, sigma[n], exact, audited and audited["passed"])
            verdicts.append(verdict_record(name, why, n, inc, cand, run, v, audited))
            pilot.say("batch", f"n={n} {name}: {v.reason}{forcing_reasons(audited)}")
            if v.approved:
                entries[n].append({"mechanism": name, "delta": cand.delta(inc)})
                incumbent[n] = cand
    seals, fell_back = [], {}
    for n in sizes:
        s = measure({"ar": pilot.ar, "stock": pilot.stock, "sealed": incumbent[n]},
                    f"seal n={n}: AR, stock, {incumbent[n].label()}", (n,))
        held = compare(s, "ar", "sealed")
        if incumbent[n] != pilot.ar and not (held.gain >= 1 and held.lower_bound >= SEAL_FLOOR):
            fell_back[n] = {"label": incumbent[n].label(), "entries": [e["mechanism"] for e in entries[n]],
                            "gain_vs_ar": held.gain, "lower_bound_vs_ar": held.lower_bound}
            pilot.say("batch", f"seal n={n}: {incumbent[n].label()} ran {held.gain:.3f}x AR (95% lower bound "
                               f"{held.lower_bound:.3f}) in the seal's own runs: AR sealed at {n} instead")
            incumbent[n], entries[n], s = pilot.ar, [], s.aliased("sealed", "ar")
        seals.append(s)
    final = BatchMeasured.merged(seals)
    report = build_report(pilot, sizes, rounds, groups, plan, ar_stock, aa, sigma, verdicts, entries, incumbent,
                          final, {"budgets": list(budgets), "tolerance": FLAT_TOLERANCE,
                                  "pass_ms": {str(m): {str(r): t for r, t in c.items()} for m, c in tables.items()},
                                  "replay": replays.report},
                          t0)
    for n, fb in fell_back.items():
        report["per_size"][str(n)]["fell_back"] = fb
    report["journal_machines"] = journal.machines()  # whose measurements the verdicts rest on
    report["token_forcing"] = ({**forcing.phase0, "sealed": forcing.check(final, "sealed")} if forcing is not None
                               else {"sealed": rounding_ties(ties, final.differing("ar", "sealed"))})
    write_outputs(opts.out, report, incumbent, entries)
    pilot.say("done", "sealed " + "; ".join(f"n={n}: {incumbent[n].label()}" for n in sizes)
              + f"; report in {opts.out}/batch_report.md")
    return report


def expected_rest_s(phase0_s: float, candidates: int) -> float:
    """Seconds the batched pilot has left after Phase 0, from Phase 0's own wall time ``phase0_s`` (two paired
    measurements of two systems at every size): each candidate is one such measurement (two systems, summed over the
    sizes), the seal one of three systems. An upper estimate: a mechanism that does not apply to a size's incumbent
    is skipped, and a candidate's speed is not the incumbent's."""
    return phase0_s / 2 * (candidates + 1.5)


def _by_size(run) -> dict:
    return {n: round(v["gain"], 3) for n, v in run.per_size.items()}


def judge_batch(run, sigma: float, exact: bool = True, forcing_passed: bool | None = None) -> ctl.Verdict:
    """The batched pilot's approval rule (module doc) for a :class:`~specpilot.pilot.batch_runs.BatchPaired` of B
    against the incumbent A. ``exact`` (float32): an output different from A's rejects unless it parts from A's at
    rounding ties only (``forcing_passed``: :func:`~specpilot.pilot.forcing.rounding_ties` passed), and then faces the
    lossless bar 1% + 2σ, as an equal output does. Otherwise :func:`specpilot.pilot.controller.approve`: bar 1% + 2σ,
    or max(3%, 1% + 2σ) with token forcing passed (``forcing_passed``; None = not run = reject) when the output
    differs; threads, nondeterminism reject.

    Raises:
        ValueError: negative or non-finite ``sigma``.
    """
    if exact and run.outputs_differ:
        if not forcing_passed:
            return ctl.Verdict(False, "rejected: output differs from the incumbent's beyond float32 rounding ties, so "
                                      "from AR's", run.gain, run.lower_bound, ctl.BASE_BAR + 2 * sigma)
        run = dataclasses.replace(run, outputs_differ=False)  # ties only: a lossless system's float32 output
    return ctl.approve(run, sigma, forcing_passed)


def _audit(forcing, ties, m, a: str, b: str, size: int) -> dict:
    """The check of ``b``'s outputs that differ from ``a``'s in ``m`` at batch size ``size``: in float32 (``ties``, a
    :class:`Scorer` of the float32 target) :func:`~specpilot.pilot.forcing.rounding_ties` of the differing variants,
    otherwise token forcing (``forcing``, a :class:`BatchForcing`)."""
    return rounding_ties(ties, m.differing(a, b)) if ties is not None else forcing.check(m, b, size)


class BatchForcing:
    """Token forcing of batch runs (§3.4, outside float32): ``scorer`` (a :class:`~specpilot.pilot.forcing.Scorer`),
    δ from the batched AR and stock outputs of ``p0`` (a :class:`~specpilot.pilot.batch_runs.BatchMeasured` with
    systems ``ar`` and ``stock``; :func:`~specpilot.pilot.forcing.delta_from_phase0`), stock's figures at every batch
    size of ``p0`` and over all of them, and :meth:`check`.

    A candidate measured at one size is judged against stock's figures *at that size*: the same prompts, so as many
    tokens. The mismatch rule's allowance is stock's sampling error (:func:`~specpilot.pilot.forcing.mismatch_allowance`),
    which the single-request pilot sizes on equal samples; judged against stock pooled over six sizes (9,216 tokens
    on the Qwen3-8B shape) that error shrank to a third while a one-size candidate's own rate (512 tokens at one
    request) kept its full noise, and a lossless tree whose bf16 output had parted from AR's at a near tie failed
    on that noise (random weights: ~11% of any output's tokens are mismatches)."""

    def __init__(self, scorer: Scorer, p0):
        self.scorer = scorer
        ar, st = p0.samples("ar"), p0.samples("stock")
        self.delta = delta_from_phase0(self.scorer, [p for p, _, _ in ar], [o for _, o, _ in ar], [o for _, o, _ in st])
        sizes = sorted({cell[1] for cell in p0.prompts})
        self.by_size = {n: audit(self.scorer, p0.at(n).samples("stock"), self.delta) for n in sizes}
        self.stock = ForcingStats.merged(list(self.by_size.values()))
        self.phase0 = {"delta": self.delta, "scorer_dtype": str(self.scorer.model.dtype).removeprefix("torch."),
                       "stock": self.stock.to_dict(),
                       "stock_by_size": {str(n): f.to_dict() for n, f in self.by_size.items()}}

    def check(self, m, name: str, size: int | None = None) -> dict:
        """Every output ``name`` produced in ``m`` against the scorer; ``{passed, reasons, figures}``. ``size``: the
        batch size ``m`` was measured at, judged against stock's figures there; None (the sealed plan over every
        size): against stock's over all sizes.

        Raises:
            KeyError: ``size`` not measured in Phase 0."""
        fs = audit(self.scorer, m.samples(name), self.delta)
        base = self.stock if size is None else self.by_size[size]
        passed, reasons = forcing_verdict(fs, base)
        return {"passed": passed, "reasons": reasons, "mismatch_rate": fs.mismatch_rate, "events": fs.events,
                "tokens": fs.tokens, "stock_mismatch_rate": base.mismatch_rate, "stock_tokens": base.tokens}
