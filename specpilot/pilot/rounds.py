"""The search rounds of a pilot run (paper §3.1–§3.3, §3.5).

``--memory`` first re-tunes and re-measures the entries of an earlier run (:mod:`.reuse`). Round 0 judges
AR (speculation off) when stock lost to AR in Phase 0. Each round then: the incumbent's ceiling
(:func:`.ceiling.ceiling`), the planner's candidates aimed at the largest factor (the next factor when
a direction has none), live screening (:func:`screen`), judgement of every candidate through the
controller and token forcing (concurrently on the device slots), and the round's best approval becomes a
memory entry and the incumbent. With ``--agent`` the agent is called once per round after the config
candidates (:mod:`.dispatch`).
"""

from __future__ import annotations

import datetime as _dt
import math
from dataclasses import dataclass, field

from specpilot.config import SystemConfig
from specpilot.pilot.ceiling import ceiling
from specpilot.pilot.dispatch import AgentContext, agent_round, stock_commit
from specpilot.pilot.memory import Memory
from specpilot.pilot.phase0 import Phase0Result
from specpilot.pilot.reuse import reuse_memory
from specpilot.pilot.state import Pilot


@dataclass
class Search:
    """Where the rounds ended: the ``incumbent`` to seal, its approved ``entries`` (in order) in ``memory``,
    every judged ``candidates`` row, the ``rounds`` table and the ``reused`` rows of ``--memory``."""

    incumbent: SystemConfig
    memory: Memory
    entries: list = field(default_factory=list)
    candidates: list = field(default_factory=list)
    rounds: list = field(default_factory=list)
    reused: list = field(default_factory=list)
    tried: set = field(default_factory=set)


def run_rounds(pilot: Pilot, p0: Phase0Result) -> Search:
    """Reuse (``--memory``), round 0 and rounds 1 … ``plan["rounds"]`` (module doc); returns the search state."""
    s = Search(pilot.stock, Memory(pilot.o.out / "memory"), tried={pilot.stock.seal()})
    if pilot.source is not None:  # a new deployment starts from stock + memory, re-tuned and re-measured (§3.5)
        pilot.say("memory", f"starting from stock + the entries of {pilot.source.root} ({len(pilot.source.ids())})")
        s.incumbent, s.reused = reuse_memory(pilot, pilot.source, s.incumbent, s.memory, s.entries, s.candidates,
                                             s.tried)
    if p0.stock_vs_ar < 1.0 and pilot.ar.seal() not in s.tried:  # stock loses to AR: speculation off is a candidate
        pilot.say("round 0", f"stock is {p0.stock_vs_ar:.3f}x AR: candidate AR (no drafter) against "
                             f"{s.incumbent.label()}")
        ceil, inc_m = ceiling(pilot, s.incumbent)
        s.rounds.append(round_row(pilot, 0, ceil, inc_m, s.incumbent, "speculation (stock loses to AR in phase 0)"))
        s.incumbent = round0_ar(pilot, s)
        s.rounds[-1]["approved"] = s.incumbent.label() if s.incumbent == pilot.ar else None
    for rnd in range(1, pilot.plan["rounds"] + 1):
        one_round(pilot, s, rnd)
    return s


def one_round(pilot: Pilot, s: Search, rnd: int) -> None:
    """Round ``rnd``: ceiling, proposals of the largest factor with candidates, screening, judgements, the
    best approval as entry and incumbent, then the agent (``--agent``)."""
    k = pilot.plan["candidates"]
    ceil, inc_m = ceiling(pilot, s.incumbent)
    f = ceil.factors()
    order = sorted(f, key=f.get, reverse=True)
    pilot.say(f"round {rnd}", "ceiling " + ", ".join(f"{n} {v:.2f}" for n, v in f.items()) + f"  (largest: {order[0]})")
    proposals, attacked = [], order[0]
    for direction in order:
        proposals = screen(pilot, pilot.planner.propose(s.incumbent, direction, s.tried, k), inc_m, k, rnd)
        if proposals:
            attacked = direction
            break
        why = ((pilot.planner.kernel_why_not(s.incumbent) if direction == "kernel" else None)
               or "no untried candidate is predicted to beat the incumbent")
        pilot.say(f"round {rnd}", f"{direction}: {why}; next factor")
    if not proposals:  # every direction came up empty: say so, not the first one tried
        attacked = "none (no candidate: " + ", ".join(order) + ")"
    s.rounds.append(round_row(pilot, rnd, ceil, inc_m, s.incumbent, attacked))
    for i, (cand, pred) in enumerate(proposals, 1):
        s.tried.add(cand.seal())
        pilot.say(f"round {rnd}", f"candidate {i}/{len(proposals)}: {cand.label()} (replay τ {pred.tau:.2f}, "
                  f"screened c {pred.c_screened:.2f}: {pred.speedup_screened:.2f}x AR predicted)")
    judged = pilot.judge_many(s.incumbent, [c for c, _ in proposals])
    best = None
    for (cand, pred), j in zip(proposals, judged):
        if isinstance(j, Exception):  # a worker died or could not build it: rejected, go on
            reason = f"rejected: {str(j).splitlines()[0] if str(j) else type(j).__name__}"
            pilot.say(f"round {rnd}", f"[red]{cand.label()}: {reason}[/]")
            s.candidates.append({"round": rnd, "name": cand.label(), "config": cand.model_dump(),
                                 "predicted": pred.to_dict(), "approved": False, "reason": reason})
            continue
        run, forcing, v = j.run, j.forcing, j.verdict
        pilot.say(f"round {rnd}", f"{cand.label()}: " + ("[green]" if v.approved else "[red]") + v.reason + "[/]")
        row = {"round": rnd, "name": cand.label(), "config": cand.model_dump(), "predicted": pred.to_dict(),
               "gain": run.gain, "lower_bound": run.lower_bound, "bar": v.bar, "outputs_differ": run.outputs_differ,
               "forcing_passed": j.forcing_passed, "forcing_reasons": list(j.forcing_reasons),
               "mismatch_rate": forcing.mismatch_rate, "approved": v.approved, "reason": v.reason}
        s.candidates.append(row)
        if v.approved and (best is None or run.lower_bound > best[1].lower_bound):
            best = (cand, run, forcing, row)
    for row in s.candidates:  # only the best approval of a round becomes an entry (§3.3)
        if best is not None and row["round"] == rnd and row["approved"] and row is not best[3]:
            row["superseded_by"] = best[3]["name"]
    if best is not None:
        cand, run, forcing, row = best
        entry = pilot.entry(rnd, s.incumbent, cand, run, forcing, [e.id for e in s.entries])
        s.memory.add(entry, overwrite=True)
        s.entries.append(entry)
        row["entry"] = entry.id
        pilot.say(f"round {rnd}", f"approved {entry.id}: {s.incumbent.label()} -> {cand.label()}")
        s.incumbent = cand
    s.rounds[-1]["approved"] = best[3]["name"] if best else None
    if pilot.o.agent:  # after the round's config candidates (see specpilot.pilot.dispatch)
        call_agent(pilot, s, rnd, ceil)
        if pilot.code_entries and pilot.code_entries[-1].id == f"r{rnd}-agent-patch":
            s.rounds[-1]["approved_patch"] = pilot.code_entries[-1].id


def round0_ar(pilot: Pilot, s: Search) -> SystemConfig:
    """Judge AR (no drafter) against the incumbent (stock, or stock + reused entries) like any candidate;
    approved, it becomes the incumbent (and a memory entry), so no later candidate is approved unless it
    beats AR. Returns the incumbent."""
    ar, incumbent = pilot.ar, s.incumbent
    s.tried.add(ar.seal())
    j = pilot.judge(incumbent, ar, ar.label())
    v = j.verdict
    pilot.say("round 0", ("[green]" if v.approved else "[red]") + v.reason + "[/]")
    row = {"round": 0, "name": ar.label(), "config": ar.model_dump(), "predicted": None,
           "gain": j.run.gain, "lower_bound": j.run.lower_bound, "bar": v.bar, "outputs_differ": j.run.outputs_differ,
           "forcing_passed": j.forcing_passed, "forcing_reasons": list(j.forcing_reasons),
           "mismatch_rate": j.forcing.mismatch_rate, "approved": v.approved, "reason": v.reason}
    s.candidates.append(row)
    if not v.approved:
        return incumbent
    entry = pilot.entry(0, incumbent, ar, j.run, j.forcing, [e.id for e in s.entries])
    s.memory.add(entry, overwrite=True)
    s.entries.append(entry)
    row["entry"] = entry.id
    pilot.say("round 0", f"approved {entry.id}: {incumbent.label()} -> {ar.label()}")
    return ar


#: Requests each candidate is screened on (live, interleaved with AR).
SCREEN_REQUESTS = 3


def screen(pilot: Pilot, proposals, inc_m: dict, k: int, rnd: int | None = None):
    """Time each proposal's decode steps live on a few requests, interleaved with AR (c); keep the ``k``
    whose replay τ / c beats the incumbent's measured τ / c. The cost model's c misses per-step
    overheads that only a live step shows; the controller still decides.

    The live run is on the very prompts the cost model's lattices were recorded on (``pilot.replay_reqs``:
    Phase 0's first salted variant of each screened request, with its budget), and the prediction recorded
    beside it in ``pilot.predictions`` (``tau_replay``, ``c_predicted``) is over the same requests' replayed
    steps, so the self-check (:func:`.predictions.prediction_check`) compares like with like: on float32 CPU
    outputs, replay τ equals live τ exactly. The ranking (``speedup_screened``) keeps the replay τ over every
    request, the better estimate of τ."""
    inc = inc_m["tau"] / inc_m["c"]
    idx = pilot.spread_indices(SCREEN_REQUESTS)
    reqs = [pilot.replay_reqs[i] for i in idx]
    kept = []
    for cfg, pred in proposals:
        m = pilot.measure(cfg, reqs=reqs)
        same = pilot.planner.predict(cfg, requests=idx)  # None only if no screened request has a step
        if same is not None:
            pilot.predictions.append({"round": rnd, "name": cfg.label(), "tau_replay": same.tau, "tau_live": m["tau"],
                                      "c_predicted": same.c, "c_live": m["c"], "requests": idx})
        pred.c_screened = m["c"]
        pred.speedup_screened = pred.tau / pred.c_screened
        if pred.speedup_screened > inc:
            kept.append((cfg, pred))
    kept.sort(key=lambda cp: -cp[1].speedup_screened)
    return kept[:k]


def round_row(pilot: Pilot, rnd: int, ceil, inc_m: dict, incumbent: SystemConfig, attacked: str) -> dict:
    """One row of the rounds table: the incumbent's ceiling factors, τ, c (interleaved with AR) and the
    tokens/s of its decode steps (1000 · τ / step ms). Appends the incumbent's c to ``pilot.c_measured``."""
    pilot.c_measured.append({"label": f"round {rnd} incumbent {incumbent.label()}", "N": inc_m["rows"] - 1,
                             "c": inc_m["c"], "source": "ceiling measurement"})
    return {"round": rnd, "ceiling": ceil.factors(), "attacked": attacked, "incumbent": incumbent.label(),
            "tau": inc_m["tau"], "c": inc_m["c"], "ar_step_ms": inc_m["ar_step_ms"], "step_ms": inc_m["step_ms"],
            "tokens_per_s": 1e3 * inc_m["tau"] / inc_m["step_ms"], "detail": ceil.to_dict(),
            "tau_best_source": pilot.tau_best_source}


def call_agent(pilot: Pilot, s: Search, rnd: int, ceil) -> None:
    """Call the external agent on the incumbent and judge its patch (:func:`.dispatch.agent_round`);
    approved, it becomes a ``patch`` memory entry and the incumbent's code."""
    from specpilot.pilot.memory import default_repo

    repo = default_repo()
    commit, dirty = stock_commit(repo)
    if dirty:
        pilot.say(f"round {rnd}", "[yellow]warning: tracked files under specpilot/ differ from HEAD: the agent's "
                  "tree starts from HEAD, stock workers run the files on disk[/]")
    f = ceil.factors()
    brief = {"cost_model": {"factors": f, "detail": ceil.to_dict()}, "gap": math.prod(f.values()),
             "memory": [f"{e.id}: {e.title} (gain {e.evidence.gain:.3f})" for e in s.entries]}
    ctx = AgentContext(pilot.o.agent, pilot.o.agent_timeout, (pilot.o.out / "agent" / f"round-{rnd}").resolve(), repo,
                       commit, list(pilot.code_entries), [e.id for e in s.entries], s.incumbent, pilot.code_tree,
                       pilot.controller, pilot.reqs, pilot.sigma, brief, pilot.deployment())
    pilot.say(f"round {rnd}", f"agent: {pilot.o.agent}")
    bar, advance = pilot.progress("paired run agent patch", 4 * len(pilot.reqs))
    with bar:
        res = agent_round(rnd, ctx, pilot.dispatch, advance, _dt.date.today().isoformat())
    s.candidates.append(res.row)
    pilot.say(f"round {rnd}", "agent patch: " + ("[green]" if res.row["approved"] else "[red]") + res.row["reason"] + "[/]")
    if res.entry is not None:
        s.memory.add(res.entry, overwrite=True)
        s.entries.append(res.entry)
        pilot.code_entries.append(res.entry)
        pilot.code_tree = str(res.patch.worktree)
        pilot.say(f"round {rnd}", f"approved {res.entry.id}: the incumbent now runs {res.patch.worktree}")
