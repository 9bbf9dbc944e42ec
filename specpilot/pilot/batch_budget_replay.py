"""Per-batch-size shared budgets by exact replay, where the batched pass is not flat (§2.4, §4.4).

The flat-region rule (:mod:`specpilot.pilot.batch_budget`) gives a step the drafted rows its pass adds for free.
Where the pass is not flat (a CPU: a 9-row SmolLM2 pass cost 6% more than the 8-row one), that rule gives one node,
yet a 4-8 node budget ran ~7% faster than AR at 8 requests (``results/compiled_spec_cpu_2026-12-06_1fd6b64/``):
rows that cost a little can still pay when they are accepted. So each budget ``B`` of the grid is priced as the cost
model prices a system (§3.1): the steps of a batched run replayed exactly (:func:`~specpilot.pilot.replay_batch.
replay_batch`, the drafter's lattices recorded along Phase 0's AR outputs, the requests cycled to fill ``m`` slots as
a batch run does), each step priced by the measured pass at its load and total rows (:func:`pass_cost`), against
AR's steps priced the same way. The budget at ``m`` requests is the one with the cheapest replayed run, never below
the flat region's edge (rows there are free; the measured cost's noise must not take them away). The paired runs
judge the candidate built from it, as every candidate.

What the price leaves out: prefill (the same for every budget and for AR), the drafter's own time (the same for every
budget: it proposes its depth whatever the budget keeps; it counts against AR, which the paired runs see), and the
host's tree building.

:func:`break_even` bounds the pass-cost measurement: a total of ``m + B`` rows can pay only while its pass costs
less than AR's steps over its replayed steps times the ``m``-row pass, so ``measure_pass_ms(worth=...)`` stops
there instead of at the flat region's edge.
"""

from __future__ import annotations

from specpilot.config import SystemConfig
from specpilot.pilot.replay import Recording, record
from specpilot.pilot.replay_batch import replay_batch

#: ``(load, rows)`` of every replayed decode step: requests in it and total rows verified (roots included)
Shapes = list[tuple[int, int]]


def pilot_recording(dep, cfg: SystemConfig, prompts: list[list[int]], outputs: list[list[int]],
                    max_new: int) -> Recording | None:
    """The lattices of ``cfg``'s drafter (its depth and top-K) along AR's ``outputs`` of ``prompts`` (each made with
    ``max_new`` new tokens), or None for a drafter this cannot record (AR).

    Raises:
        CalibrationError: an unreadable calibration file (``calibrated``).
    """
    budgets = [max_new] * len(prompts)
    if cfg.drafter == "none":
        return None
    if cfg.drafter == "calibrated":
        from specpilot.pilot.costinputs import record_calibrated

        return record_calibrated(dep, cfg.drafter_path, prompts, outputs, budgets)[1]
    drafter = dep.system(cfg).drafter
    return record(drafter, prompts, outputs, cfg.depth, cfg.top_k, target=dep.target, max_new_tokens=budgets)


def cycled(rec: Recording, n: int) -> Recording:
    """``rec``'s requests cycled to ``max(n, len)`` requests, as a batch run cycles its prompts to fill ``n`` slots
    (:func:`~specpilot.pilot.batch_runs.variant_set`). Raises ValueError: an empty recording."""
    if not rec.prompts:
        raise ValueError("an empty recording has no requests to cycle")
    return rec.subset([i % len(rec.prompts) for i in range(max(n, len(rec.prompts)))])


def replayed_shapes(rec: Recording, cfg: SystemConfig, m: int, extras) -> dict[int, Shapes]:
    """Per budget, the ``(load, rows)`` of every decode step of ``rec`` (cycled to ``m``) served with ``m`` slots:
    key 0 is AR (one row a request), key ``B`` for ``B`` in ``extras`` the shared budget of ``B`` nodes at every load
    (``cfg``'s drafter, tree and depth; budgets above ``cfg.nodes * load`` are not capped).

    Raises:
        ValueError: ``m < 1``; ``cfg`` asks for more depth or top-K than recorded.
    """
    r = cycled(rec, m)
    out = {0: [(len(s.requests), len(s.requests)) for s in replay_batch(r, SystemConfig.ar(), m)]}
    for b in sorted({int(e) for e in extras if e >= 1}):
        shared = cfg.apply({"row_selection": "shared_budget", "shared_budget": (b,) * m})
        out[b] = [(len(s.requests), len(s.requests) + sum(s.nodes)) for s in replay_batch(r, shared, m)]
    return out


def break_even(shapes: dict[int, Shapes]) -> dict[int, float]:
    """Per budget ``B``, a bound on how much more than AR's its pass may cost and still pay: the larger of AR's
    steps over ``B``'s (a run's time is its steps times their cost: the outputs are the same tokens) and AR's
    request-steps over ``B``'s (τ: where a step's cost follows its load, the run's tail of fewer requests is cheap
    and the slowest request no longer sets the run's time)."""
    def load(s: Shapes) -> int:
        return max(sum(k for k, _ in s), 1)

    return {b: max(len(shapes[0]) / max(len(s), 1), load(shapes[0]) / load(s)) for b, s in shapes.items() if b}


def pass_cost(table: dict[int, float], rows: int) -> float:
    """Ms of a pass of ``rows`` total rows from a measured table (total rows -> ms at one load): linear between the
    measured totals, the smallest total's cost below it, the last two totals' slope above the largest.

    Raises:
        ValueError: an empty table.
    """
    if not table:
        raise ValueError("an empty cost table prices nothing")
    totals = sorted(table)
    if rows <= totals[0]:
        return table[totals[0]]
    for lo, hi in zip(totals, totals[1:]):
        if rows <= hi:
            return table[lo] + (table[hi] - table[lo]) * (rows - lo) / (hi - lo)
    if len(totals) == 1:
        return table[totals[0]]
    lo, hi = totals[-2], totals[-1]
    return table[hi] + max(table[hi] - table[lo], 0.0) * (rows - hi) / (hi - lo)


def replay_budget(shapes: dict[int, Shapes], tables: dict[int, dict[int, float]], m: int,
                  floor: int = 1) -> tuple[int, dict[int, float]]:
    """The budget of steps over ``m`` requests (module doc) and the predicted speedup over AR of every budget
    priced: ``(budget, {B: AR's run time / B's})``. Only budgets whose ``m + B`` total was measured at load ``m``
    are candidates (priced past the table, a total would be a guess); ``floor``: the flat region's budget.

    Raises:
        KeyError: a step's load without a table.
    """
    def run_ms(steps: Shapes) -> float:
        return sum(pass_cost(tables[k], rows) for k, rows in steps)

    ar = run_ms(shapes[0])
    pred = {b: ar / run_ms(s) for b, s in shapes.items() if b and m + b in tables[m]}
    best = max(pred, key=lambda b: (pred[b], -b)) if pred else floor  # a tie: the fewer rows
    return max(best, floor), pred



class Replays:
    """The replayed budgets of one batched pilot: each drafter's lattices recorded once along Phase 0's AR outputs
    at the smallest size (round 0, first variant set: every benchmark prompt, salted), its steps replayed at every
    load ``1..max(sizes)`` and budget of :data:`~specpilot.pilot.batch_budget.EXTRA_ROWS`; each drafter's budgets
    journaled (``replay budgets <key>``) so that a resumed run builds the candidates it measured.

    Args:
        dep: the pilot's :class:`~specpilot.engine.deployment.Deployment`. p0: Phase 0's
            :class:`~specpilot.pilot.batch_runs.BatchMeasured` (systems ``ar`` and ``stock``). sizes: the pilot's
            sizes. journal: its :class:`~specpilot.pilot.batch_journal.BatchJournal`.
    Attributes:
        report: per drafter key, ``{"budgets": [...], "predicted": {size: {B: speedup over AR}}}``.
    """

    def __init__(self, dep, p0, sizes, journal):
        from specpilot.pilot.batch_budget import EXTRA_ROWS

        self.dep, self.sizes, self.journal, self.extras = dep, tuple(sizes), journal, EXTRA_ROWS
        n0 = min(sizes)
        cells = sorted(c for c in p0.prompts if c[1] == n0 and c[2] == 0)
        self.prompts = [list(p) for c in cells for p in p0.prompts[c][0]]
        self.outputs = [list(o) for c in cells for o in p0.outputs["ar"][c][0]]
        self.max_new = max(len(o) for o in self.outputs)  # the plan's max_new_tokens unless every output stopped
        self._shapes: dict[str, dict[int, dict[int, Shapes]]] = {}
        self.report: dict[str, dict] = {}

    @staticmethod
    def key(cfg: SystemConfig) -> str:
        """What a replay depends on: the drafter, its file, tree, depth and top-K."""
        return f"{cfg.drafter}:{cfg.drafter_path or ''} {cfg.tree} D={cfg.depth} k={cfg.top_k}"

    def shapes(self, cfg: SystemConfig, m: int) -> dict[int, Shapes] | None:
        """:func:`replayed_shapes` of ``cfg`` at load ``m`` (recorded on first use; None: a drafter not recorded)."""
        k = self.key(cfg)
        if k not in self._shapes:
            rec = pilot_recording(self.dep, cfg, self.prompts, self.outputs, self.max_new)
            self._shapes[k] = {} if rec is None else {
                n: replayed_shapes(rec, cfg, n, self.extras) for n in range(1, max(self.sizes) + 1)}
        return self._shapes[k].get(m)

    def worth(self, bases: list[SystemConfig], m: int) -> dict[int, float]:
        """Per budget, the most a pass at ``m + B`` rows may cost relative to the ``m``-row pass and still pay for
        any drafter of ``bases`` (:func:`break_even`, the largest)."""
        out: dict[int, float] = {}
        for cfg in bases:
            for b, x in break_even(self.shapes(cfg, m) or {0: []}).items():
                out[b] = max(out.get(b, 0.0), x)
        return out

    def budgets(self, cfg: SystemConfig, tables: dict[int, dict[int, float]], flat: tuple) -> tuple:
        """``cfg``'s drafter's budget at every load ``1..len(flat)`` (:func:`replay_budget`, floored by the flat
        region's ``flat``); ``flat`` itself for a drafter that cannot be replayed."""
        if self.shapes(cfg, 1) is None:
            return flat
        k = self.key(cfg)
        if self.journal.get(f"replay budgets {k}") is None:
            picks = [replay_budget(self.shapes(cfg, m), tables, m, flat[m - 1]) for m in range(1, len(flat) + 1)]
            self.journal.put(f"replay budgets {k}", {
                "budgets": [b for b, _ in picks],
                "predicted": {str(n): {str(b): x for b, x in picks[n - 1][1].items()} for n in self.sizes}})
        self.report[k] = self.journal.get(f"replay budgets {k}")
        return tuple(self.report[k]["budgets"])


__all__ = ["Replays", "Shapes", "pilot_recording", "cycled", "replayed_shapes", "break_even", "pass_cost", "replay_budget"]
