"""Controller (§3.3): paired runs on salted variants, timing it owns, bootstrap lower bound, approval rule."""

import math
import random
import threading
import time

import pytest

from specpilot.engine.types import Generation
from specpilot.pilot import controller as ctl
from specpilot.pilot.bootstrap import gain_and_bound
from specpilot.pilot.controller import SALT_TOKENS, PairedRun, Req, approve, noise_from_aa, paired_run

V = 50


def reqs(per_bench=(4, 4)):
    return [Req(f"b{j}", i, (10 + j, 20 + i, 30), 8) for j, n in enumerate(per_bench) for i in range(n)]


class Sleeper:
    """A fake system: sleeps, returns tokens that are a function of the prompt; may lie about its time."""

    def __init__(self, seconds, name="", log=None, lie=False):
        self.seconds, self.name, self.log, self.lie = seconds, name, log, lie

    def generate(self, prompt, max_new_tokens):
        if self.log is not None:
            self.log.append((self.name, tuple(prompt)))
        time.sleep(self.seconds)
        return Generation(tokens=[sum(prompt) % V] * max_new_tokens, steps=1, time_s=1e-9 if self.lie else self.seconds)


def fake(gain, lower, differ=False, nd_b=False, outside_b=()):
    r = reqs((2,))
    out = (((1,),), ((2,),))
    return PairedRun(tuple(r), out, out, out, (1.0, 1.0), (gain, gain), differ, False, nd_b, (), tuple(outside_b),
                     {"b0": gain}, gain, lower, "BCa")


def test_abba_on_fresh_salted_variants_and_own_timing():
    log = []
    rs = reqs((3, 3))
    pr = paired_run(lambda: Sleeper(0.004, "A", log), lambda: Sleeper(0.002, "B", log, lie=True), rs, V,
                    avoid_ids=range(5), rng=random.Random(1))
    warm, timed, rerun = log[:2], log[2:-2], log[-2:]
    assert [w[0] for w in warm] == ["A", "B"] and [r[0] for r in rerun] == ["A", "B"]
    assert len(timed) == 4 * len(rs)
    for k in range(0, len(timed), 4):
        block = timed[k : k + 4]
        assert [b[0] for b in block] == ["A", "B", "B", "A"]
        assert block[0][1] == block[1][1] and block[2][1] == block[3][1] != block[0][1]  # A and B: same variant
        base = block[0][1][SALT_TOKENS:]
        assert base in {r.prompt_ids for r in rs} and block[2][1][SALT_TOKENS:] == base
        assert all(5 <= t < V for b in block for t in b[1][:SALT_TOKENS])  # salt avoids ids 0..4
    assert len({p for _, p in timed}) == 2 * len(rs)  # no system ever runs a timed prompt twice
    order = [timed[k][1][SALT_TOKENS:] for k in range(0, len(timed), 4)]
    assert order != [r.prompt_ids for r in rs]  # shuffled (this seed)
    assert pr.prompts[0][0][SALT_TOKENS:] == rs[0].prompt_ids  # results in the caller's order
    assert not pr.outputs_differ and not pr.nondeterministic_a and not pr.nondeterministic_b
    assert pr.outside_a == pr.outside_b == ()
    assert 1.4 < pr.gain < 2.3  # ~2x, not the 1e6x B's reported time would give
    assert set(pr.benchmark_gain) == {"b0", "b1"} and 1.0 < pr.lower_bound <= pr.gain
    assert all(8 / 0.008 < t <= 8 / 0.004 for t in pr.tps_a)  # sleep never returns early
    assert len(pr.samples("b")) == 2 * len(rs) and pr.samples("a")[0][0] == pr.prompts[0][0]


def test_default_salt_comes_from_os_entropy():
    logs = []
    for _ in range(2):
        log = []
        random.seed(0)  # a candidate seeding the global RNG cannot fix the salts
        paired_run(lambda: Sleeper(0, "A", log), lambda: Sleeper(0, "B", log), reqs((2,)), 1000)
        logs.append([p for _, p in log])
    assert not set(logs[0]) & set(logs[1])


def test_candidate_cannot_replace_timer(monkeypatch):
    class Cheat(Sleeper):
        def generate(self, prompt, n):
            monkeypatch.setattr(time, "perf_counter", lambda: 0.0)  # stays replaced for later calls too
            return super().generate(prompt, n)

    pr = paired_run(lambda: Sleeper(0.002), lambda: Cheat(0.002), reqs((3,)), V)
    assert math.isfinite(pr.gain) and 0.5 < pr.gain < 2.0


def test_lazy_output_is_timed():
    class Lazy:
        """Returns at once; the tokens are computed when read."""

        def generate(self, prompt, n):
            class Tokens:
                def __iter__(self):
                    time.sleep(0.006)
                    return iter([sum(prompt) % V] * n)

            return Generation(tokens=Tokens(), steps=1)

    pr = paired_run(lambda: Sleeper(0.003), Lazy, reqs((3,)), V)
    assert 0.3 < pr.gain < 0.7  # ~0.5: the lazy work is charged to B


def test_threads_left_running_are_flagged():
    stop = threading.Event()

    class Spinner(Sleeper):
        def __init__(self):
            super().__init__(0.001)
            threading.Thread(target=stop.wait, name="spinner", daemon=True).start()

    try:
        pr = paired_run(lambda: Sleeper(0.001), Spinner, reqs((2,)), V)
    finally:
        stop.set()
    assert pr.outside_b == ("spinner",) and pr.outside_a == ()
    v = approve(pr, 0.0, True)
    assert not v.approved and "threads" in v.reason and "spinner" in v.reason


def test_nondeterminism_and_output_difference_flagged():
    n = {"k": 0}

    class Flaky:
        def generate(self, prompt, max_new):
            n["k"] += 1
            return Generation(tokens=[n["k"]] * 4, steps=1)  # never the same twice

    pr = paired_run(lambda: Sleeper(0.0005), Flaky, reqs((2,)), V)
    assert pr.nondeterministic_b and not pr.nondeterministic_a and pr.outputs_differ
    v = approve(pr, 0.0, True)
    assert not v.approved and "nondeterministic" in v.reason


def test_empty_output_and_bad_arguments():
    class Empty:
        def generate(self, prompt, n):
            return Generation(tokens=[], steps=0)

    with pytest.raises(ValueError, match="no tokens"):
        paired_run(lambda: Sleeper(0), Empty, reqs((2,)), V)
    with pytest.raises(ValueError):
        paired_run(lambda: Sleeper(0), lambda: Sleeper(0), [], V)
    with pytest.raises(ValueError, match="salt"):
        paired_run(lambda: Sleeper(0), lambda: Sleeper(0), reqs((2,)), 3, avoid_ids=[0, 1])


def test_bound_reproducible_and_stratified():
    b = [110, 120, 105, 115, 112, 150, 140, 160, 145]
    names = ["b0"] * 5 + ["b1"] * 4
    g1 = gain_and_bound(names, [100.0] * 9, b)
    assert g1 == gain_and_bound(names, [100.0] * 9, b)  # fixed rng: same bound every time
    bench, gain, low, method = g1
    b0 = math.exp(sum(math.log(x / 100) for x in b[:5]) / 5)
    b1 = math.exp(sum(math.log(x / 100) for x in b[5:]) / 4)
    assert bench["b0"] == pytest.approx(b0) and bench["b1"] == pytest.approx(b1)
    assert gain == pytest.approx(math.sqrt(b0 * b1))  # geometric mean over benchmarks, not requests
    assert method in ("BCa", "percentile") and 1.1 < low < gain


def test_single_request_benchmark_and_degenerate():
    bench, gain, low, method = gain_and_bound(["solo", "b0", "b0", "b0"], [1.0] * 4, [2.0, 1.1, 1.2, 1.3])
    assert bench["solo"] == 2.0 and math.isfinite(low) and low < gain
    _, gain, low, method = gain_and_bound(["b0"] * 3, [1.0] * 3, [1.05] * 3)  # all ratios equal
    assert method == "degenerate" and low == pytest.approx(gain) == pytest.approx(1.05)
    _, gain, low, method = gain_and_bound(["b0", "b1"], [1.0, 1.0], [2.0, 2.0])  # no benchmark with two
    assert method == "none" and math.isnan(low)
    assert not approve(fake(2.0, low), 0.0, None).approved
    with pytest.raises(ValueError):
        gain_and_bound(["b0"], [0.0], [1.0])


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
    v = approve(fake(1.06, 1.035, differ=True), 0.0, False)
    assert not v.approved and "token forcing failed" in v.reason
    v = approve(fake(1.06, 1.035, differ=True), 0.0, None)
    assert not v.approved and "not run" in v.reason
    v = approve(fake(1.06, 1.035, differ=True), 0.02, True)  # 1% + 2σ = 5% > 3%
    assert not v.approved and v.bar == pytest.approx(0.05)
    assert not approve(fake(1.5, 1.4, nd_b=True), 0.0, True).approved
    assert not approve(fake(1.5, 1.4, outside_b=("t",)), 0.0, True).approved
    with pytest.raises(ValueError):
        approve(fake(1.05, 1.02), -0.1, None)


def test_ar_as_candidate_is_not_bound_by_forcing_but_keeps_the_changed_output_bar():
    """AR's output is the reference forcing audits against: when it differs from the incumbent's (bf16 drift of the
    incumbent's verify rows), a failed or absent forcing does not reject AR; the 3% bar still applies, and so do the
    other rules."""
    assert approve(fake(1.06, 1.035, differ=True), 0.0, False, b_is_ar=True).approved
    assert approve(fake(1.06, 1.035, differ=True), 0.0, None, b_is_ar=True).approved
    v = approve(fake(1.06, 1.025, differ=True), 0.0, False, b_is_ar=True)
    assert not v.approved and "below the bar" in v.reason and v.bar == pytest.approx(0.03)
    assert not approve(fake(1.5, 1.4, nd_b=True, differ=True), 0.0, True, b_is_ar=True).approved


def test_interleaved_run_palindrome():
    log = []
    makers = {n: (lambda n=n, s=s: Sleeper(s, n, log)) for n, s in (("ar", 0.003), ("stock", 0.002), ("x", 0.001))}
    res = ctl.interleaved_run(makers, reqs((2, 2)), V, rng=random.Random(0))
    timed = log[3:-3]
    for k in range(0, len(timed), 6):
        assert [b[0] for b in timed[k : k + 6]] == ["ar", "stock", "x", "x", "stock", "ar"]
    g, low = res.gain("ar", "x")
    assert 2.0 < g < 4.0 and g == pytest.approx(res.tokens_per_s("x") / res.tokens_per_s("ar"))
    assert len(res.samples("x")) == 8 and res.outside == {"ar": (), "stock": (), "x": ()}
