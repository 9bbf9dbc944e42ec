"""Shared budgets by exact replay where the batched pass is not flat (§2.4, §4.4): pass prices from a measured table,
the budget with the cheapest replayed run, the break-even bound on the pass-cost measurement, and the pilot's
per-drafter budgets (recorded along AR outputs, journaled for a resumed run)."""

from __future__ import annotations

import pytest

from specpilot.config import SystemConfig
from specpilot.pilot.batch_budget import EXTRA_ROWS, flat_budget, measure_pass_ms
from specpilot.pilot.batch_budget_replay import (Replays, break_even, cycled, pass_cost, replay_budget,
                                                 replayed_shapes)
from specpilot.pilot.batch_runs import BatchMeasured
from specpilot.pilot.replay import record
from specpilot.spec.ngram import NgramDrafter

from .test_batch import ar

pytestmark = pytest.mark.usefixtures("one_thread")

NGRAM = SystemConfig(drafter="ngram", tree="best_first", nodes=6, depth=6, top_k=4)


def test_pass_cost_interpolates_and_extends_the_last_slope():
    t = {4: 10.0, 5: 11.0, 8: 17.0}
    assert pass_cost(t, 4) == 10.0 and pass_cost(t, 2) == 10.0  # below the table: its smallest total's cost
    assert pass_cost(t, 5) == 11.0 and pass_cost(t, 6) == pytest.approx(13.0)  # linear between 5 and 8
    assert pass_cost(t, 11) == pytest.approx(23.0)  # past 8: the slope of 5 -> 8 (2 ms a row)
    assert pass_cost({4: 3.0}, 9) == 3.0
    with pytest.raises(ValueError):
        pass_cost({}, 3)


def test_the_budget_is_the_cheapest_replayed_run_over_measured_totals_floored_by_the_flat_region():
    shapes = {0: [(2, 2)] * 10, 1: [(2, 3)] * 8, 4: [(2, 6)] * 6, 8: [(2, 10)] * 5, 16: [(2, 18)] * 4}
    tables = {2: {2: 10.0, 3: 11.0, 6: 12.0, 10: 20.0}}  # 16 + 2 rows never measured: not a candidate
    b, pred = replay_budget(shapes, tables, 2)
    assert pred == pytest.approx({1: 100 / 88, 4: 100 / 72, 8: 1.0})  # AR: 10 steps x 10 ms
    assert b == 4
    assert replay_budget(shapes, tables, 2, floor=8)[0] == 8  # never below the flat region's edge
    assert break_even(shapes) == {1: 10 / 8, 4: 10 / 6, 8: 2.0, 16: 2.5}  # the steps' ratio (equal loads)
    assert break_even({0: [(4, 4), (4, 4), (2, 2)], 2: [(4, 8), (1, 3), (1, 3)]}) == {2: 10 / 6}  # τ's


def test_replayed_shapes_cycle_the_requests_and_fewer_steps_never_cost_more_rows_than_the_budget(tiny_models):
    target, _ = tiny_models
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [3, 4] * 6]
    outs = [ar(target, p, 12) for p in prompts]
    rec = record(NgramDrafter(NGRAM.ngram_max, NGRAM.ngram_min, max_matches=4), prompts, outs, 6, 4)
    assert [len(p) for p in cycled(rec, 7).prompts] == [16, 15, 12, 16, 15, 12, 16]
    shapes = replayed_shapes(rec, NGRAM, 4, (1, 4, 8))
    assert set(shapes) == {0, 1, 4, 8}
    assert sum(k for k, _ in shapes[0]) == sum(len(o) - 1 for o in outs) + len(outs[0]) - 1  # 4 requests, 1 token each
    assert all(k == rows for k, rows in shapes[0]) and max(k for k, _ in shapes[0]) == 4
    for b in (1, 4, 8):
        assert all(k <= rows <= k + b for k, rows in shapes[b]) and any(rows > k for k, rows in shapes[b])
        assert len(shapes[b]) <= len(shapes[0])  # an accepted node only removes steps
    assert all(x >= 1 for x in break_even(shapes).values())


class _Journal:
    def __init__(self):
        self.entries = {}

    def get(self, key):
        return self.entries.get(key)

    def put(self, key, value):
        self.entries[key] = value


def _p0(prompts, outs, n0=1):
    cell = ("b", n0, 0)
    return BatchMeasured({"ar": {cell: 1.0}}, {"ar": {cell: (outs, outs)}}, {cell: (prompts, prompts)},
                         {"ar": ()}, {"ar": False})


def test_the_pilot_replays_each_drafter_once_and_journals_its_budgets(tiny_dirs):
    from specpilot.engine.deployment import Deployment

    dep = Deployment(tiny_dirs[0])
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5]
    outs = [ar(dep.target, p, 10) for p in prompts]
    j = _Journal()
    reps = Replays(dep, _p0(prompts, outs), (1, 3), j)
    tables = {m: {m + e: 1.0 + 0.02 * e for e in (0,) + EXTRA_ROWS} for m in range(1, 4)}  # 2% a row: not flat
    flat = tuple(flat_budget(tables[m], m) for m in range(1, 4))
    assert flat == (2, 2, 2)
    got = reps.budgets(NGRAM, tables, flat)
    assert len(got) == 3 and all(g >= f for g, f in zip(got, flat))
    entry = j.get(f"replay budgets {Replays.key(NGRAM)}")
    assert entry["budgets"] == list(got) and set(entry["predicted"]) == {"1", "3"}
    for n in (1, 3):  # each size's budget: the best predicted of those at or above the floor
        pred = {int(b): x for b, x in entry["predicted"][str(n)].items()}
        assert set(pred) == {e for e in EXTRA_ROWS if n + e in tables[n]}
        assert pred[got[n - 1]] == max(x for b, x in pred.items() if b >= flat[n - 1]) or got[n - 1] == flat[n - 1]
    # a resumed run builds the candidate it measured: the journal's budgets, whatever the tables say now
    again = Replays(dep, _p0(prompts, outs), (1, 3), j)
    assert again.budgets(NGRAM, {m: {m: 1.0} for m in range(1, 4)}, flat) == got
    assert reps.budgets(SystemConfig.ar(), tables, flat) is flat  # nothing to replay: the flat region's budgets
    worth = reps.worth([NGRAM], 3)
    assert set(worth) == set(EXTRA_ROWS) and all(x >= 1 for x in worth.values())


def test_the_pass_cost_measurement_goes_on_while_a_total_could_pay(tiny_dirs):
    from specpilot.engine.deployment import Deployment

    target = Deployment(tiny_dirs[0]).target
    kw = dict(extras=(1, 2, 3, 4), prefix=8, repeats=1)
    assert set(measure_pass_ms(target, 2, tolerance=-1.0, **kw)) == {2, 3, 4}  # every total "over": two, then stop
    assert set(measure_pass_ms(target, 2, tolerance=-1.0, worth={e: 1e9 for e in (1, 2, 3, 4)}, **kw)) == {
        2, 3, 4, 5, 6}
