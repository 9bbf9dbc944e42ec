"""How long a pilot run will take, and the ``--quick`` plan sized to fit a few minutes.

The run's work is counted from its plan (paper §3: Phase 0, cost-model inputs, rounds, seal) and priced
with step times measured on this deployment right after loading: an AR decode step, a stock step (and its
τ), the prefill per prompt token, and one recorded lattice position per drafter kind (:class:`StepCosts`).
A generation of M new tokens after a P-token prompt costs ``P · prefill + M · T_AR`` (AR) or
``P · prefill + M / τ · T_stock`` (speculative: screened proposals are priced like stock; incumbents,
judged candidates and the sealed system like the faster of AR and stock, since each must beat its
incumbent); a paired judgement runs each system ``2R + 2`` times (two salted variants per request, a
warm-up, a determinism re-run) and token-forces B's ``2R`` outputs (one scorer pass over prompt and output
each). :func:`estimate_s` adds these up per phase (:data:`PHASES`); the time already spent (loading,
peaks, this measurement) is counted as ``setup``.

**Sizing rule** (:func:`size_plan`): ``--quick`` shrinks its plan through :data:`QUICK_LEVERS`, in order,
until the estimate fits :data:`QUICK_TARGET_S` (new tokens 32 → 24 → 16, candidates 2 → 1, benchmarks
4 → 3 → 2, new tokens 16 → 12 → 8); a key given on the command line is never changed, and requests per
benchmark stay at the bootstrap's minimum of 2. The full run is not shrunk. Either way the expected
duration is printed before Phase 0, and the report's ``duration`` holds the estimate (total and per
phase), the measured step costs and the actual wall time per phase, so the two can be compared.

**What the estimate leaves out:** one direction's screening per round (a round whose first direction
screens out every proposal screens the next one too), the agent (``--agent``: up to its timeout per
round), worker start-up (``--devices``), outputs that stop early at EOS (counted as full length) and the
report's plots (a few seconds).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from specpilot.errors import SpecPilotError
from specpilot.pilot.paired import SALT_TOKENS
from specpilot.pilot.planner import EAGLE3_TOP_K, VERIFY_ROWS
from specpilot.pilot.steps import fastest, step_stats

#: Phases of a run, in order (the keys of :func:`estimate_s` and of the report's per-phase wall times).
PHASES = ("setup", "phase0", "cost_inputs", "rounds", "adversarial", "seal")
#: ``--quick`` aims at this wall time (s), loading included.
QUICK_TARGET_S = 180.0
#: ``(plan key, value)`` tried in order while the ``--quick`` estimate is above the target.
QUICK_LEVERS = (("max_new_tokens", 24), ("max_new_tokens", 16), ("candidates", 1), ("benchmarks", 3),
                ("benchmarks", 2), ("max_new_tokens", 12), ("max_new_tokens", 8))
VERIFY_PASSES = 15  # warm-up + timed passes per row count in :func:`.setup.measure_verify_ms`
ADVERSARIES = 7  # A vs A and the six cheats of :func:`.adversarial.adversaries`
RETUNED = 3  # variants screened per reused entry (:data:`.reuse.SCREENED`)


@dataclass(frozen=True)
class StepCosts:
    """Unit costs measured on this deployment (ms), the inputs of :func:`estimate_s`.

    Attributes:
        ar_ms: one AR decode step. spec_step_ms: one stock speculative step (drafting included).
        tau: stock's tokens per step (≥ 1). prefill_ms_per_token: prefill time per prompt token.
        record_ms: ms per recorded lattice position of each drafter kind (``ngram`` at top-8, ``draft_model``
            at top-8 and the plan's depth, ``block`` at its block), as :func:`.replay.record` runs them.
        measured_s: seconds the measurement itself took.
    """

    ar_ms: float
    spec_step_ms: float
    tau: float
    prefill_ms_per_token: float
    record_ms: dict
    measured_s: float = 0.0

    def gen_ms(self, prompt_tokens: float, new_tokens: int, spec: bool = True) -> float:
        """ms of one generation of ``new_tokens`` after ``prompt_tokens``, AR or speculative (module doc)."""
        decode = new_tokens / max(self.tau, 1.0) * self.spec_step_ms if spec else new_tokens * self.ar_ms
        return prompt_tokens * self.prefill_ms_per_token + decode


@dataclass(frozen=True)
class RunShape:
    """What, besides the plan, sets a run's work.

    Attributes:
        requests: requests in the set. prompt_tokens: their mean prompt length (salt included).
        draft_model: the deployment has a draft model. blocks / eagle3: block and EAGLE-3 drafters (``--block``,
            ``--eagle3``).
        round0: AR is judged in round 0 (stock predicted slower than AR). adversarial: ``--adversarial``.
        reuse_entries: entries of ``--memory`` to re-measure. elapsed_s: seconds already spent (setup).
    """

    requests: int
    prompt_tokens: float
    draft_model: bool = False
    blocks: int = 0
    eagle3: int = 0
    round0: bool = False
    adversarial: bool = False
    reuse_entries: int = 0
    elapsed_s: float = 0.0


def estimate_s(plan: dict, shape: RunShape, costs: StepCosts) -> dict[str, float]:
    """Expected seconds per phase of a run of ``plan`` (keys :data:`PHASES`; formulas in the module doc).

    Args:
        plan: ``max_new_tokens``, ``rounds``, ``candidates``, ``depth_max`` (others ignored).
        shape: :class:`RunShape`. costs: :class:`StepCosts`.
    Returns:
        ``{phase: seconds}``; their sum is the run's expected wall time.
    """
    R, M, P, c = shape.requests, plan["max_new_tokens"], shape.prompt_tokens, costs
    ar, sp = c.gen_ms(P, M, spec=False), c.gen_ms(P, M)
    forcing = 2 * R * (P + M) * c.prefill_ms_per_token  # one scorer pass over prompt + output per variant

    def judge(a: float, b: float) -> float:
        return (2 * R + 2) * (a + b) + forcing

    def measure(n: int, x: float) -> float:  # interleaved AR X X AR on n requests
        return n * 2 * (ar + x)

    def ceiling(x: float) -> float:  # measured interleaved, then profiled on the same 4 requests
        return measure(4, x) + 4 * x

    verify = 200 * c.prefill_ms_per_token + VERIFY_PASSES * sum(
        c.ar_ms + (r - 1) * c.prefill_ms_per_token for r in VERIFY_ROWS)
    per_position = 4 * c.record_ms.get("ngram", 0.0) + shape.draft_model * c.record_ms.get("draft_model", 0.0) \
        + shape.blocks * c.record_ms.get("block", 0.0) + shape.eagle3 * len(EAGLE3_TOP_K) * c.record_ms.get("eagle3", 0.0)
    learned = shape.blocks + shape.eagle3 * len(EAGLE3_TOP_K)  # recordings that run the target over each sequence
    record = R * (M - 1) * per_position + learned * R * (P + M) * c.prefill_ms_per_token
    families = 1 + shape.draft_model + shape.blocks + shape.eagle3  # the planner proposes up to `candidates` each
    best = min(ar, sp)  # incumbents, judged candidates and the sealed system: at least as fast as AR or stock
    rounds = (ceiling(sp) + judge(sp, ar)) if shape.round0 else 0.0
    rounds += shape.reuse_entries * (RETUNED * measure(3, sp) + judge(sp, sp))
    rounds += plan["rounds"] * (ceiling(best) + families * plan["candidates"] * measure(3, sp)
                                + plan["candidates"] * judge(best, best))
    ms = {"phase0": (2 * R + 2) * (ar + sp) + (2 * R + 2) * 2 * sp + 2 * forcing,
          "cost_inputs": measure(4, sp) + (1 + shape.blocks + shape.eagle3) * verify + record,  # passes with features
          "rounds": rounds,
          "adversarial": ADVERSARIES * judge(sp, sp) if shape.adversarial else 0.0,
          "seal": (2 * R + 2) * (ar + sp + best) + forcing + ceiling(best)}
    return {"setup": shape.elapsed_s, **{k: v / 1e3 for k, v in ms.items()}}


def shrink(plan: dict, estimate, target_s: float, fixed=()) -> tuple[dict, float, list[str]]:
    """Apply :data:`QUICK_LEVERS` to ``plan`` in order while ``estimate(plan)`` (seconds) is above ``target_s``.

    A lever lowers its key only (``benchmarks`` None = all of them) and is kept only when it lowers the
    estimate (fewer benchmarks than there are change nothing); keys in ``fixed`` are never changed.
    Returns:
        ``(plan, its estimate, ["key old -> new", ...])``, one change per key in the order first applied; the
        smallest plan when even it does not fit.
    """
    start, est = plan, estimate(plan)
    for key, value in QUICK_LEVERS:
        if est <= target_s:
            break
        old = plan.get(key)
        if key in fixed or (old is not None and old <= value):
            continue
        smaller = {**plan, key: value}
        smaller_est = estimate(smaller)
        if smaller_est < est:
            plan, est = smaller, smaller_est
    changed = dict.fromkeys(k for k, _ in QUICK_LEVERS if plan.get(k) != start.get(k))
    return plan, est, [f"{k} {'all' if start.get(k) is None else start[k]} -> {plan[k]}" for k in changed]


def measure_step_costs(pilot, reqs: list, new_tokens: int = 16) -> StepCosts:
    """Time AR and stock on a request of ``reqs`` (the middle one; the next when its output ends at the first
    token), and one recorded lattice position per drafter kind of the deployment (:func:`.replay.record`).

    After a short untimed warm-up of each engine, AR and stock run A S S A and each keeps its faster run, as
    :func:`.steps.interleaved_steps` does (the first calls of a draft model ran several times slower than
    the later ones).

    Raises:
        SpecPilotError: no request of ``reqs`` gives a decode step (every output ends at its first token).
    """
    from specpilot.config import SystemConfig
    from specpilot.pilot.replay import record

    t0 = time.perf_counter()
    engines = {"ar": pilot.engine(pilot.ar), "stock": pilot.engine(pilot.stock)}
    for i in range(len(reqs)):
        probe = list(reqs[(len(reqs) // 2 + i) % len(reqs)].prompt_ids)
        for eng in engines.values():
            eng.generate(probe, 4)  # warm-up (allocators, lazy init)
        gens = {n: [] for n in engines}
        for n in ("ar", "stock", "stock", "ar"):
            gens[n].append(engines[n].generate(probe, new_tokens))
        if all(g.steps for gs in gens.values() for g in gs):
            break
    else:
        raise SpecPilotError("no benchmark prompt gives a decode step to time: every output ends at its first token")
    ar, sp = fastest(gens["ar"]), fastest(gens["stock"])
    ar_st, sp_st = step_stats([ar]), step_stats([sp])
    dep, depth = pilot.dep, pilot.plan["depth_max"]
    drafters = {"ngram": (SystemConfig(drafter="ngram", top_k=8, depth=depth, nodes=depth), depth, 8)}
    if dep.draft_model is not None:
        drafters["draft_model"] = (SystemConfig(drafter="draft_model", top_k=8, depth=depth, nodes=depth), depth, 8)
    if dep.block_dirs:
        drafters["block"] = (SystemConfig(drafter="block", drafter_path=str(dep.block_dirs[0]), top_k=16), None, 16)
    if dep.eagle3_dirs:
        k = max(EAGLE3_TOP_K)
        drafters["eagle3"] = (SystemConfig(drafter="eagle3", drafter_path=str(dep.eagle3_dirs[0]), top_k=k, depth=depth,
                                           nodes=depth), depth, k)
    record_ms = {}
    for kind, (cfg, d, k) in drafters.items():
        drafter = dep.system(cfg).drafter
        d = d or drafter.cfg.block_size
        rec = record(drafter, [probe], [list(ar.tokens)], d, k, target=dep.target if drafter.target_layers else None)
        # a position's recording: its propose, a draft model's second one-position propose, the observation
        record_ms[kind] = rec.draft_ms + (rec.draft1_ms or 0.0) + rec.observe_ms
    return StepCosts(ar_ms=ar_st.step_ms, spec_step_ms=sp_st.step_ms, tau=sp_st.tau,
                     prefill_ms_per_token=1e3 * min(ar.prefill_s, sp.prefill_s) / len(probe),
                     record_ms=record_ms, measured_s=time.perf_counter() - t0)


def size_plan(pilot, requests_for) -> tuple[dict, dict]:
    """The run's plan and its ``duration`` record: step costs measured here (:func:`measure_step_costs`),
    the ``--quick`` plan shrunk to fit :data:`QUICK_TARGET_S` (module doc; the full plan as it is), and the
    expected duration with the console line that announces it (``duration["line"]``).

    Args:
        pilot: the run's :class:`~specpilot.pilot.state.Pilot` (``plan``, ``o``, ``dep``, ``t0``).
        requests_for: ``plan -> list[Req]``, the request set a plan gives.
    Returns:
        ``(plan, duration)``.
    """
    o, plan = pilot.o, dict(pilot.plan)
    costs = measure_step_costs(pilot, requests_for(plan), new_tokens=min(16, plan["max_new_tokens"]))
    src = pilot.source
    base = {"draft_model": pilot.dep.draft_model is not None, "blocks": len(pilot.dep.block_dirs),
            "eagle3": len(pilot.dep.eagle3_dirs),
            "round0": costs.spec_step_ms / max(costs.tau, 1.0) > costs.ar_ms, "adversarial": o.adversarial,
            "reuse_entries": len(src.ids()) if src is not None else 0}

    def shape_of(p: dict) -> RunShape:
        reqs = requests_for(p)
        prompt = sum(len(r.prompt_ids) for r in reqs) / max(1, len(reqs)) + SALT_TOKENS
        return RunShape(len(reqs), prompt, elapsed_s=time.perf_counter() - pilot.t0, **base)

    target, changes = (QUICK_TARGET_S if o.quick else None), []
    if o.quick:
        plan, _, changes = shrink(plan, lambda p: sum(estimate_s(p, shape_of(p), costs).values()), target,
                                  fixed=set(o.overrides or {}))
    shape = shape_of(plan)
    by_phase = estimate_s(plan, shape, costs)
    est = sum(by_phase.values())
    line = (f"expected duration {est / 60:.1f} min (AR {costs.ar_ms:.1f} ms/step, stock {costs.spec_step_ms:.1f} "
            f"ms/step at τ {costs.tau:.2f}, prefill {costs.prefill_ms_per_token:.2f} ms/token")
    if not o.quick:
        line += ")"
    elif est <= target:
        line += f"; --quick sized to fit {target / 60:.0f} min: {', '.join(changes) or 'plan unchanged'})"
    else:
        line = (f"[yellow]{line}; above the {target / 60:.0f} min --quick target even at the smallest plan allowed"
                + (f": {', '.join(changes)}" if changes else "") + ")[/]")
    duration = {"estimate_s": est, "estimate_by_phase_s": by_phase, "target_s": target, "plan_changes": changes,
                "step_costs": asdict(costs), "shape": asdict(shape), "line": line}
    return plan, duration


def mark(pilot, phase: str) -> None:
    """Record the wall time (s) of ``phase``, which ends now (the previous one ended where it starts), in
    ``pilot.duration["actual_by_phase_s"]``."""
    actual = pilot.duration.setdefault("actual_by_phase_s", {})
    actual[phase] = time.perf_counter() - pilot.t0 - sum(actual.values())


def finish(pilot) -> dict:
    """The report's ``duration``: the estimate, the wall time per phase (the seal's up to now, before the
    report is written) and in total since the run's state was created, and their ratio."""
    mark(pilot, "seal")
    d = {k: v for k, v in pilot.duration.items() if k != "line"}
    d["actual_s"] = time.perf_counter() - pilot.t0
    if d.get("estimate_s"):
        d["actual_over_estimate"] = d["actual_s"] / d["estimate_s"]
    return d
