"""The run's expected duration and the ``--quick`` plan sized from measured step times (specpilot.pilot.budget):
the estimate on synthetic timings, the shrinking rule, the printed line, and the measurement on the bundled pair."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from specpilot.pilot import budget
from specpilot.pilot.budget import QUICK_LEVERS, QUICK_TARGET_S, RunShape, StepCosts, estimate_s, shrink, size_plan

PLAN = {"per_benchmark": 2, "max_new_tokens": 32, "rounds": 1, "candidates": 2, "depth_max": 8, "benchmarks": None}


def costs(**kw) -> StepCosts:
    return StepCosts(**{"ar_ms": 10.0, "spec_step_ms": 20.0, "tau": 2.0, "prefill_ms_per_token": 0.0,
                        "record_ms": {"ngram": 0.0}, **kw})


def test_estimate_counts_the_runs_of_every_phase():
    """No prefill and speculation as fast per token as AR (20 ms / τ 2 = 10 ms): every generation costs
    M · 10 ms, so each phase is a count of generations that can be checked by hand."""
    R, M, g = 4, 10, 0.1  # a generation: 10 tokens · 10 ms = 0.1 s
    plan = {**PLAN, "max_new_tokens": M, "rounds": 2, "candidates": 3}
    e = estimate_s(plan, RunShape(R, 50.0, elapsed_s=7.0), costs())
    assert set(e) == set(budget.PHASES) and e["setup"] == 7.0
    runs = 2 * R + 2  # two salted variants per request, a warm-up, a determinism re-run
    assert e["phase0"] == pytest.approx(runs * 2 * g + runs * 2 * g)  # AR vs stock, stock A/A
    verify = budget.VERIFY_PASSES * len(budget.VERIFY_ROWS) * 10.0 / 1e3  # every row count at T_AR (no prefill)
    assert e["cost_inputs"] == pytest.approx(4 * 2 * 2 * g + verify)
    ceiling = 4 * 2 * 2 * g + 4 * g
    per_round = ceiling + 1 * 3 * 3 * 2 * 2 * g + 3 * runs * 2 * g  # one drafter family, 3 screened, 3 judged
    assert e["rounds"] == pytest.approx(2 * per_round)
    assert e["adversarial"] == 0.0
    assert e["seal"] == pytest.approx(runs * 3 * g + ceiling)


def test_estimate_grows_with_the_plan_and_prices_prefill_forcing_and_extras():
    c = costs(prefill_ms_per_token=0.5, record_ms={"ngram": 0.1, "draft_model": 2.0, "block": 1.0})
    shape = RunShape(8, 100.0)
    base = sum(estimate_s(PLAN, shape, c).values())
    for key, more in (("max_new_tokens", 64), ("candidates", 3), ("rounds", 2)):
        assert sum(estimate_s({**PLAN, key: more}, shape, c).values()) > base, key
    assert sum(estimate_s(PLAN, RunShape(16, 100.0), c).values()) > base
    assert sum(estimate_s(PLAN, RunShape(8, 400.0), c).values()) > base  # longer prompts: prefill and forcing
    e = estimate_s(PLAN, RunShape(8, 100.0, draft_model=True, blocks=2, round0=True, adversarial=True,
                                  reuse_entries=2), c)
    plain = estimate_s(PLAN, shape, c)
    assert e["cost_inputs"] > plain["cost_inputs"]  # draft-model and block recordings
    assert e["rounds"] > plain["rounds"] and e["adversarial"] > 0  # round 0, reuse, more drafter families
    slow = estimate_s(PLAN, RunShape(8, 0.0), costs(spec_step_ms=60.0))  # stock 30 ms per token, AR 10
    ar, sp, runs = 0.32, 0.96, 18  # seconds per generation of 32 tokens; runs per system
    assert slow["seal"] == pytest.approx(runs * (ar + sp + ar) + 4 * 2 * 2 * ar + 4 * ar)  # sealed priced as AR


def test_shrink_applies_the_levers_in_order_until_it_fits():
    est = lambda p: p["max_new_tokens"] * p["candidates"] * (p["benchmarks"] or 4)  # noqa: E731
    plan, e, changes = shrink(PLAN, est, target_s=1e9)
    assert plan == PLAN and changes == [] and e == 32 * 2 * 4  # fits: unchanged
    plan, e, changes = shrink(PLAN, est, target_s=16 * 2 * 4)
    assert (plan["max_new_tokens"], plan["candidates"], plan["benchmarks"]) == (16, 2, None)
    assert changes == ["max_new_tokens 32 -> 16"] and e <= 16 * 2 * 4
    plan, e, changes = shrink(PLAN, est, target_s=16 * 1 * 2)
    assert (plan["max_new_tokens"], plan["candidates"], plan["benchmarks"]) == (16, 1, 2)
    assert changes == ["max_new_tokens 32 -> 16", "candidates 2 -> 1", "benchmarks all -> 2"]
    plan, e, changes = shrink(PLAN, est, target_s=0)  # never fits: the smallest quick plan
    assert plan == {**PLAN, **{k: v for k, v in QUICK_LEVERS if k != "max_new_tokens"}, "max_new_tokens": 8}
    assert e == est(plan) and changes[0] == "max_new_tokens 32 -> 8"
    plan, _, changes = shrink(PLAN, est, target_s=0, fixed={"max_new_tokens", "benchmarks"})
    assert plan["max_new_tokens"] == 32 and plan["benchmarks"] is None and changes == ["candidates 2 -> 1"]
    plan, _, _ = shrink({**PLAN, "max_new_tokens": 10, "candidates": 1}, est, target_s=0)
    assert plan["max_new_tokens"] == 8 and plan["candidates"] == 1  # never raised
    plan, _, changes = shrink(PLAN, lambda p: p["max_new_tokens"] * p["candidates"], target_s=0)
    assert plan["benchmarks"] is None and not any(c.startswith("benchmarks") for c in changes)  # no effect: kept


def fake_pilot(quick: bool, ar_ms: float, overrides=None):
    """What :func:`size_plan` reads of a pilot, with requests of 100 prompt tokens (2 per benchmark, 4 benchmarks)."""
    o = SimpleNamespace(quick=quick, overrides=overrides, adversarial=False)
    dep = SimpleNamespace(draft_model=None, block_dirs=(), eagle3_dirs=())
    return SimpleNamespace(o=o, plan=dict(PLAN), dep=dep, source=None, t0=time.perf_counter(), ar_ms=ar_ms)


def requests_for(plan):
    n = plan["per_benchmark"] * (plan["benchmarks"] or 4)
    return [SimpleNamespace(prompt_ids=(1,) * 100, benchmark=f"b{i % 4}") for i in range(n)]


@pytest.fixture
def timed(monkeypatch):
    monkeypatch.setattr(budget, "measure_step_costs",
                        lambda pilot, reqs, new_tokens=16: costs(ar_ms=pilot.ar_ms, spec_step_ms=2 * pilot.ar_ms,
                                                                 prefill_ms_per_token=0.1))


def test_size_plan_prints_the_expected_duration_and_shrinks_only_quick(timed):
    plan, d = size_plan(fake_pilot(True, ar_ms=1.0), requests_for)  # fast: the quick plan fits as it is
    assert plan == PLAN and d["plan_changes"] == [] and d["estimate_s"] <= QUICK_TARGET_S
    assert d["line"].startswith("expected duration ") and "--quick sized to fit 3 min: plan unchanged" in d["line"]
    assert "AR 1.0 ms/step, stock 2.0 ms/step at τ 2.00, prefill 0.10 ms/token" in d["line"]
    assert d["estimate_s"] == pytest.approx(sum(d["estimate_by_phase_s"].values()))
    assert d["shape"]["requests"] == 8 and d["shape"]["prompt_tokens"] == 104  # the salt counted

    plan, d = size_plan(fake_pilot(True, ar_ms=60.0), requests_for)  # slower: shrunk until it fits
    assert d["estimate_s"] <= QUICK_TARGET_S and d["plan_changes"] and plan["max_new_tokens"] < 32
    assert "--quick sized to fit 3 min: max_new_tokens 32 -> " in d["line"] and not d["line"].startswith("[yellow]")
    assert d["shape"]["requests"] == len(requests_for(plan))

    plan, d = size_plan(fake_pilot(True, ar_ms=5000.0), requests_for)  # hopeless: smallest plan, said in yellow
    assert d["estimate_s"] > QUICK_TARGET_S and plan["max_new_tokens"] == 8 and plan["benchmarks"] == 2
    assert d["line"].startswith("[yellow]expected duration ") and "above the 3 min --quick target" in d["line"]

    plan, d = size_plan(fake_pilot(True, ar_ms=5000.0, overrides={"max_new_tokens": 32}), requests_for)
    assert plan["max_new_tokens"] == 32  # a size given on the command line is kept

    plan, d = size_plan(fake_pilot(False, ar_ms=60.0), requests_for)  # the full run: estimated, never shrunk
    assert plan == PLAN and d["target_s"] is None and d["plan_changes"] == []
    assert d["line"].startswith("expected duration ") and d["line"].endswith("ms/token)")


def test_step_costs_measured_on_the_bundled_pair():
    from specpilot.pilot.phase0 import requests_for as reqs_of
    from specpilot.pilot.run import PilotOptions
    from specpilot.pilot.state import Pilot
    from specpilot.zoo import bundled_block_dir, bundled_drafter_dir, bundled_target_dir

    pilot = Pilot(PilotOptions(target=bundled_target_dir(), drafter=bundled_drafter_dir(), quick=True,
                               blocks=(bundled_block_dir(),)))
    c = budget.measure_step_costs(pilot, reqs_of(pilot, pilot.plan), new_tokens=12)
    assert c.ar_ms > 0 and c.spec_step_ms > 0 and c.tau >= 1 and c.prefill_ms_per_token > 0
    assert set(c.record_ms) == {"ngram", "draft_model", "block"} and all(v > 0 for v in c.record_ms.values())
    assert 0 < c.measured_s < 60
    assert pilot.ar.seal() in pilot.engines and pilot.stock.seal() in pilot.engines  # reused by the run
