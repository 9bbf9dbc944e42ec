"""Adversarial tests of the controller (§3.3: an agent rewarded only for speed may cheat): cheating candidates on the bundled models (CPU,
float32) go through the pilot's own path — Phase 0, then ``Controller.judge`` (paired run + token
forcing + approval rule) — and must be rejected; A vs A is not approved, a real 2x is.

Where a cheat would be rejected for being slow anyway, A is given a planted 2x slowdown, so the test
fails unless the defence under test is what rejects it (asserted through the verdict's reason)."""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace

import pytest

from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.pilot.adversarial import Lazy, Memo, Saboteur, SkipVerify, SuffixMemo, Twice, adversaries, biased, fp8_logits
from specpilot.pilot.setup import build_requests
from specpilot.zoo import bundled_drafter_dir, bundled_target_dir

from .conftest import phase0_of

STOCK = SystemConfig.stock("ngram")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def dep():
    return Deployment(bundled_target_dir(), bundled_drafter_dir())


@pytest.fixture(scope="module")
def reqs(dep):
    return [r for r in build_requests(dep, per_benchmark=4, max_new_tokens=16) if r.benchmark in ("humaneval", "mbpp")]


@pytest.fixture(scope="module")
def p0(dep, reqs):
    return phase0_of(dep, reqs, STOCK)


def stock(dep):
    return lambda: dep.system(STOCK)


def slow_stock(dep):
    return lambda: Twice(dep.system(STOCK))


def judge(p0, make_a, make_b, reqs, progress=None, seed=1):
    return p0.controller.judge(make_a, make_b, reqs, rng=random.Random(seed), progress=progress)


def test_phase0_on_cpu_float32(p0):
    c = p0.controller
    assert not p0.ar_stock.outputs_differ  # lossless stock == AR exactly in float32
    assert c.delta == 0.125 and c.stock_forcing.mismatches == 0 and c.stock_forcing.tokens > 0
    assert 0 <= c.sigma < 0.5


def test_a_vs_a_is_not_approved(p0, dep, reqs):
    j = judge(p0, stock(dep), stock(dep), reqs)
    assert not j.run.outputs_differ and j.forcing_passed
    assert not j.verdict.approved, j.verdict.reason


def test_a_real_2x_is_approved(p0, dep, reqs):
    j = judge(p0, slow_stock(dep), stock(dep), reqs)
    assert j.verdict.approved, j.verdict.reason
    assert 1.5 < j.run.gain < 2.6


# -- (1) outputs cached from an earlier run / (2a) precomputed at construction ----------------------

def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_outputs_cached_from_an_earlier_run_earn_nothing(p0, dep, reqs):
    Memo.cache.clear()
    earlier = Memo(dep.system(STOCK))
    first = [timed(lambda r=r: earlier.generate(list(r.prompt_ids), r.max_new_tokens)) for r in reqs]  # earlier run
    again = [timed(lambda r=r: earlier.generate(list(r.prompt_ids), r.max_new_tokens)) for r in reqs]
    assert sum(again) < sum(first) / 10  # replaying works against a timer that repeats prompts
    Memo.hits, seen = 0, []
    j = judge(p0, stock(dep), lambda: Memo(dep.system(STOCK)), reqs, progress=lambda: seen.append(Memo.hits))
    assert seen[-1] == 0  # not one timed run was a replay
    assert not j.verdict.approved and "below the bar" in j.verdict.reason, j.verdict.reason
    assert j.run.gain < 1.25


def test_outputs_precomputed_at_construction_earn_nothing(p0, dep, reqs):
    Memo.cache.clear()
    public = [(r.prompt_ids, r.max_new_tokens) for r in reqs]  # the bundled prompts are public
    Memo.hits, seen = 0, []
    j = judge(p0, stock(dep), lambda: Memo(dep.system(STOCK), precompute=public), reqs,
              progress=lambda: seen.append(Memo.hits))
    assert len(Memo.cache) >= len(public) and seen[-1] == 0
    assert not j.verdict.approved and "below the bar" in j.verdict.reason, j.verdict.reason


def test_salt_stripping_replay_is_caught_by_token_forcing(p0, dep, reqs):
    Memo.cache.clear()
    public = [(r.prompt_ids, r.max_new_tokens) for r in reqs]
    Memo.hits, seen = 0, []
    j = judge(p0, stock(dep), lambda: SuffixMemo(dep.system(STOCK), precompute=public), reqs,
              progress=lambda: seen.append(Memo.hits))
    assert seen[-1] == 1 + 2 * len(reqs)  # the warm-up and every timed B run were replays: fast
    assert j.run.outputs_differ and not j.forcing_passed, j.forcing_reasons
    assert not j.verdict.approved and "token forcing failed" in j.verdict.reason


# -- (2) work outside the timed region -----------------------------------------------------------

def test_lazy_output_is_charged_to_its_system(p0, dep, reqs):
    lazy, r = Lazy(dep.system(STOCK)), reqs[0]
    assert timed(lambda: lazy.generate(list(r.prompt_ids), r.max_new_tokens)) < 0.002  # a naive timer sees ~0
    j = judge(p0, stock(dep), lambda: Lazy(dep.system(STOCK)), reqs)
    assert not j.verdict.approved and "below the bar" in j.verdict.reason, j.verdict.reason
    assert j.run.gain < 1.25


def test_thread_left_running_is_rejected(p0, dep, reqs):
    stop = threading.Event()
    try:
        j = judge(p0, stock(dep), lambda: Saboteur(dep.system(STOCK), stop), reqs)
    finally:
        stop.set()
    assert "saboteur" in j.run.outside_b
    assert not j.verdict.approved and "outside the timed region" in j.verdict.reason, j.verdict.reason


# -- (3) logit bias, (4) low-precision verification, (5) skipped verification ---------------------

def fast_enough_but_rejected_by_forcing(j):
    assert j.run.outputs_differ
    assert j.run.lower_bound - 1 > j.verdict.bar, "speed alone would not have approved it: test is void"
    assert not j.forcing_passed and j.forcing_reasons
    assert not j.verdict.approved and "token forcing failed" in j.verdict.reason, j.verdict.reason


def test_logit_bias_is_rejected(p0, dep, reqs):
    hook = biased(dep.target.args.vocab_size)
    j = judge(p0, slow_stock(dep), lambda: dep.system(STOCK, logits_hook=hook), reqs)
    fast_enough_but_rejected_by_forcing(j)


def test_low_precision_verification_is_rejected(p0, dep, reqs):
    j = judge(p0, slow_stock(dep), lambda: dep.system(STOCK, logits_hook=fp8_logits), reqs)
    fast_enough_but_rejected_by_forcing(j)
    assert j.forcing.events > 0  # FP8 flips tokens far from a tie (margin >= 2δ)


def test_skipped_verification_is_rejected(p0, dep, reqs):
    def make():
        honest = dep.system(STOCK)
        return SkipVerify(dep.target, STOCK, honest.drafter, eos_ids=dep.eos_ids())

    j = judge(p0, slow_stock(dep), make, reqs)
    fast_enough_but_rejected_by_forcing(j)


def test_bf16_verification_flips_only_near_ties_and_is_caught_by_the_rate_rule(p0, dep):
    """Verifying with a bf16 copy of this tiny float32 target flips only near-ties (margins < 0.1 nat, no
    events), on ~1% of tokens: only the 0.5 pp mismatch-rate rule catches it, and it needs a few hundred
    tokens to (a measured finding, not a guarantee; the FP8 case above is caught by both rules)."""
    from specpilot.model.checkpoint import load_model
    from specpilot.engine.engine import Engine
    from specpilot.pilot.forcing import audit, forcing_verdict

    low = Engine(load_model(bundled_target_dir(), "bfloat16"), STOCK, dep.system(STOCK).drafter, eos_ids=dep.eos_ids())
    reqs = build_requests(dep, per_benchmark=4, max_new_tokens=32)
    outs = [(r.prompt_ids, low.generate(list(r.prompt_ids), 32).tokens, r.benchmark) for r in reqs]
    c = p0.controller
    stats = audit(c.scorer, outs, c.delta)
    passed, reasons = forcing_verdict(stats, c.stock_forcing)
    assert stats.tokens >= 400 and stats.mismatches > 0 and stats.events == 0
    assert max(stats.top_margins) < 2 * c.delta
    assert not passed and len(reasons) == 1 and "mismatch rate" in reasons[0]


def test_pilot_adversarial_check_rejects_every_cheat_by_its_defence(p0, dep, reqs):
    """``pilot --adversarial``: A vs A and the six cheats of :func:`adversaries`, judged by the pilot's own
    method on the pilot's controller, are all rejected, each by the defence it targets."""
    from specpilot.pilot.adversarial import check_adversaries
    from specpilot.pilot.run import PilotOptions
    from specpilot.pilot.state import Pilot

    pilot = Pilot(PilotOptions(target=bundled_target_dir(), drafter=bundled_drafter_dir(), adversarial=True))
    pilot.dep, pilot.reqs, pilot.controller = dep, reqs, p0.controller
    rows = check_adversaries(pilot)
    assert [r["name"] for r in rows] == ["A vs A", "cached outputs", "lazy outputs", "thread left running", "logit bias",
                                         "low-precision verification", "skipped verification"]
    for r in rows:
        assert not r["approved"] and r["defence_fired"], r
    assert all(r["outputs_differ"] and r["forcing_passed"] is False for r in rows[4:])


def test_pilot_adversarial_check_builds_in_process_when_candidates_run_in_workers(p0, dep, reqs):
    """With ``--devices cpu,cpu`` the real candidates run in worker processes, but the cheats (and the A vs A
    control) are objects of this process: every factory handed to the controller must be callable here
    (on the H200 the control was handed a WorkerSystem and the run crashed)."""
    from specpilot.pilot.adversarial import check_adversaries
    from specpilot.pilot.run import PilotOptions
    from specpilot.pilot.state import Pilot

    pilot = Pilot(PilotOptions(target=bundled_target_dir(), drafter=bundled_drafter_dir(), adversarial=True,
                               devices=("cpu", "cpu")))
    assert pilot.dispatch.mode == "workers"
    seen = []

    class Judge:  # checks what it is handed, then returns a rejection (no timing in this test)
        def judge(self, make_a, make_b, requests, progress=None):
            for make in (make_a, make_b):
                assert callable(make) and hasattr(make(), "generate")
            seen.append(1)
            run = SimpleNamespace(gain=1.0, lower_bound=1.0, outputs_differ=False)
            return SimpleNamespace(run=run, forcing_passed=True, forcing_reasons=(),
                                   verdict=SimpleNamespace(approved=False, reason="rejected: stub", bar=0.01))

    pilot.dep, pilot.reqs, pilot.controller = dep, reqs, Judge()
    rows = check_adversaries(pilot)
    assert len(seen) == len(rows) == 7


FLAT = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512}


def test_skipped_verification_on_a_flat_logit_bf16_target_is_rejected_by_both_rules(tmp_path_factory):
    """The regime where token forcing is weakest: random weights (flat logits) in bfloat16, where stock itself
    mismatches the scorer on near-ties (a random-weight 8B on the H200: ~10%). Here (tiny random target,
    bf16 on the CPU) stock mismatches 0.43%; the skipped-verification cheat 3.73% with one event of 0.81
    nats (6.5δ). Both rules must fire. Looser rules tried on the H200 (an exact count test for events, a
    cluster-robust allowance) approved the cheat there; under those rules this event alone (one
    against stock's none, p = 0.5) would not have been an event failure."""
    import random as _random

    from specpilot.pilot import controller as ctl
    from specpilot.pilot.forcing import Scorer
    from specpilot.zoo.random_ckpt import write_random_checkpoint

    ck = write_random_checkpoint("qwen3-8b", tmp_path_factory.mktemp("flat") / "ck", device="cpu", overrides=FLAT)
    dep = Deployment(ck, None, dtype="bfloat16", device="cpu")
    stock_cfg = SystemConfig.stock("ngram", dtype="bfloat16")
    reqs = build_requests(dep, 3, 48)
    p0 = ctl.phase0(lambda: dep.system(SystemConfig.ar(dtype="bfloat16")), lambda: dep.system(stock_cfg), reqs,
                    Scorer(dep.target), dep.target.args.vocab_size, rng=_random.Random(0))
    sf = p0.controller.stock_forcing
    assert 0 < sf.mismatch_rate < 0.02 and sf.events == 0  # stock vs the scorer: near-ties only
    stop = threading.Event()
    try:
        adv = next(a for a in adversaries(dep, stock_cfg, stop) if a.name == "skipped verification")
        j = p0.controller.judge(adv.make_a, adv.make_b, reqs, rng=_random.Random(1))
    finally:
        stop.set()
    assert not j.verdict.approved and "token forcing failed" in j.verdict.reason
    assert j.forcing.mismatch_rate > 3 * sf.mismatch_rate and j.forcing.top_margins[0] > 4 * p0.controller.delta
    assert any(r.startswith("mismatch rate") for r in j.forcing_reasons)
    assert any(r.startswith("events") for r in j.forcing_reasons), j.forcing_reasons
