"""Controller (§3.3): paired runs, bootstrap lower bound, approval rule."""

import math
import time

import pytest

from specpilot.engine.types import Generation
from specpilot.pilot import controller as ctl
from specpilot.pilot.controller import PairedRun, Req, approve, noise_from_aa, paired_run


def reqs(per_bench=(4, 4)):
    return [Req(f"b{j}", i, (1, 2, 3), 8) for j, n in enumerate(per_bench) for i in range(n)]


def sleeper(seconds, tokens=lambda r: [r.index] * 8, lie=False):
    def run(req):
        time.sleep(seconds)
        return Generation(tokens=list(tokens(req)), steps=1, time_s=1e-9 if lie else seconds)
    return run


def fake(gain, lower, differ=False, nd_b=False):
    r = reqs((2,))
    return PairedRun(tuple(r), (1.0, 1.0), (gain, gain), ((1,), (2,)), ((1,), (2,)), differ,
                     False, nd_b, {"b0": gain}, gain, lower, "BCa")


def test_paired_run_measures_time_itself_abba():
    calls = []
    a = sleeper(0.004)
    b = sleeper(0.002, lie=True)  # claims ~0 s: must be ignored
    run_a = lambda r: (calls.append("A"), a(r))[1]
    run_b = lambda r: (calls.append("B"), b(r))[1]
    pr = paired_run(run_a, run_b, reqs((3, 3)))
    assert calls[:4] == ["A", "B", "B", "A"] and len(calls) == 24
    assert not pr.outputs_differ and not pr.nondeterministic_a and not pr.nondeterministic_b
    assert 1.4 < pr.gain < 2.3  # ~2x, not the 1e6x the lie would give
    assert set(pr.benchmark_gain) == {"b0", "b1"}
    assert 1.0 < pr.lower_bound <= pr.gain
    assert all(8 / 0.008 < t <= 8 / 0.004 for t in pr.tps_a)  # sleep never returns early


def test_candidate_cannot_replace_timer(monkeypatch):
    def cheat(req):
        monkeypatch.setattr(time, "perf_counter", lambda: 0.0)  # stays replaced for later calls too
        time.sleep(0.002)
        return Generation(tokens=[1] * 8, steps=1)
    pr = paired_run(sleeper(0.002, tokens=lambda r: [1] * 8), cheat, reqs((3,)))
    assert math.isfinite(pr.gain) and 0.5 < pr.gain < 2.0


def test_nondeterminism_and_output_difference_flagged():
    n = {"k": 0}
    def flaky(req):
        n["k"] += 1
        return Generation(tokens=[n["k"] % 2] * 4, steps=1)
    pr = paired_run(sleeper(0.0005, tokens=lambda r: [0] * 4), flaky, reqs((2,)))
    assert pr.nondeterministic_b and not pr.nondeterministic_a and pr.outputs_differ
    v = approve(pr, 0.0, True)
    assert not v.approved and "nondeterministic" in v.reason


def test_bound_reproducible_and_stratified():
    r = reqs((5, 4))
    a = [100.0] * 9
    b = [110, 120, 105, 115, 112, 150, 140, 160, 145]
    g1 = ctl._gain_and_bound(r, a, b)
    g2 = ctl._gain_and_bound(r, a, b)
    assert g1 == g2  # fixed rng: same bound every time
    bench, gain, low, method = g1
    b0 = math.exp(sum(math.log(x / 100) for x in b[:5]) / 5)
    b1 = math.exp(sum(math.log(x / 100) for x in b[5:]) / 4)
    assert bench["b0"] == pytest.approx(b0) and bench["b1"] == pytest.approx(b1)
    assert gain == pytest.approx(math.sqrt(b0 * b1))  # geometric mean over benchmarks, not requests
    assert method in ("BCa", "percentile") and 1.1 < low < gain


def test_single_request_benchmark_and_degenerate():
    r = [Req("solo", 0, (1,), 4)] + reqs((3,))
    bench, gain, low, method = ctl._gain_and_bound(r, [1.0] * 4, [2.0, 1.1, 1.2, 1.3])
    assert bench["solo"] == 2.0 and math.isfinite(low) and low < gain
    # all ratios equal: BCa is degenerate; bound = gain, no crash
    _, gain, low, method = ctl._gain_and_bound(reqs((3,)), [1.0] * 3, [1.05] * 3)
    assert method == "degenerate" and low == pytest.approx(gain) == pytest.approx(1.05)
    # no benchmark with two requests: no bound, and approve rejects
    _, gain, low, method = ctl._gain_and_bound(reqs((1, 1)), [1.0, 1.0], [2.0, 2.0])
    assert method == "none" and math.isnan(low)
    assert not approve(fake(2.0, low), 0.0, None).approved


def test_noise_from_aa():
    assert noise_from_aa(fake(1.002, 0.999)) == pytest.approx(0.003)
    assert noise_from_aa(fake(0.99, 0.985)) == pytest.approx(0.01)
    with pytest.raises(ValueError):
        noise_from_aa(fake(1.0, float("nan")))


def test_approve_rule():
    assert approve(fake(1.05, 1.02), 0.001, None).approved  # 2% > 1% + 0.2%
    v = approve(fake(1.05, 1.011), 0.001, None)
    assert not v.approved and v.bar == pytest.approx(0.012)
    # output changed: bar 3% and forcing must pass
    assert not approve(fake(1.06, 1.025, differ=True), 0.0, True).approved
    assert approve(fake(1.06, 1.035, differ=True), 0.0, True).approved
    assert not approve(fake(1.06, 1.035, differ=True), 0.0, False).approved
    v = approve(fake(1.06, 1.035, differ=True), 0.0, None)
    assert not v.approved and "not run" in v.reason
    v = approve(fake(1.06, 1.035, differ=True), 0.02, True)  # 1% + 2σ = 5% > 3%
    assert not v.approved and v.bar == pytest.approx(0.05)
    assert not approve(fake(1.5, 1.4, nd_b=True), 0.0, True).approved
    with pytest.raises(ValueError):
        approve(fake(1.05, 1.02), -0.1, None)
