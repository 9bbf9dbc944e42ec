"""The cost model's self-check compares like with like (§3.2): the pilot's screening measures a candidate live on
the prompts its lattices were recorded on, and the prediction recorded beside it is over the same requests; the
recording's timings cover a step's drafting work (a block drafter's observation, a draft model's depth). Float32
on the CPU, bundled toy pair, a few short requests."""

from __future__ import annotations

import random

import pytest

from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.pilot.planner import Planner
from specpilot.pilot.replay import Recording, record, replay, replay_steps, replay_trace
from specpilot.zoo import bundled_block_dir, bundled_drafter_dir, bundled_target_dir

pytestmark = pytest.mark.usefixtures("one_thread")

NGRAM = SystemConfig(drafter="ngram", tree="best_first", nodes=8, depth=6, top_k=4)
DRAFT_MODEL = SystemConfig(drafter="draft_model", tree="best_first", nodes=8, depth=5, top_k=4)


@pytest.fixture(scope="module")
def screened(tmp_path_factory):
    """A pilot on the bundled pair (and block drafter) with four requests of 16 tokens: Phase 0's replay inputs
    made as Phase 0 makes them (a salted variant per request, AR's output on it), the real cost-model inputs,
    then one screening of an n-gram, a draft-model and a block candidate."""
    from specpilot.pilot.costinputs import cost_inputs
    from specpilot.pilot.paired import _salter
    from specpilot.pilot.phase0 import Phase0Result
    from specpilot.pilot.rounds import screen
    from specpilot.pilot.setup import build_requests
    from specpilot.pilot.state import Pilot, PilotOptions

    block = bundled_block_dir()
    if not (block / "model.safetensors").is_file():
        pytest.skip("bundled block drafter not built")
    opts = PilotOptions(target=bundled_target_dir(), drafter=bundled_drafter_dir(), out=tmp_path_factory.mktemp("pq"),
                        threads=1, blocks=(block,), overrides={"depth_max": 6})
    pilot = Pilot(opts)
    pilot.reqs = build_requests(pilot.dep, per_benchmark=1, max_new_tokens=16)[:4]
    salted = _salter(pilot.dep.target.args.vocab_size, pilot.salt_kw()["avoid_ids"], random.Random(0))
    prompts = [list(salted(r.prompt_ids)) for r in pilot.reqs]
    ar = pilot.engine(pilot.ar)
    outputs = [ar.generate(p, r.max_new_tokens).tokens for p, r in zip(prompts, pilot.reqs)]
    p0 = Phase0Result({}, 1.0, prompts, outputs)
    inputs = cost_inputs(pilot, p0)
    bcfg = SystemConfig(drafter="block", drafter_path=str(block), tree="best_first", nodes=8, depth=8, top_k=16)
    proposals = [(c, pilot.planner.predict(c)) for c in (NGRAM, DRAFT_MODEL, bcfg)]
    assert all(p is not None for _, p in proposals)
    screen(pilot, proposals, {"tau": 1.0, "c": 1e9}, k=3, rnd=1)
    return pilot, p0, inputs


def test_screen_measures_the_recorded_prompts_and_replay_tau_equals_live_tau(screened):
    pilot, p0, _ = screened
    idx = pilot.spread_indices(3)
    assert len(idx) == 3 and len(pilot.predictions) == 3
    for i in idx:  # the recorded (salted) prompt and the request's own budget
        assert list(pilot.replay_reqs[i].prompt_ids) == p0.prompts[i] != list(pilot.reqs[i].prompt_ids)
        assert pilot.replay_reqs[i].max_new_tokens == pilot.reqs[i].max_new_tokens
    for row in pilot.predictions:
        assert row["requests"] == idx
        # float32 CPU: every candidate's output is AR's, so τ on the same prompts is the same, exactly
        assert row["tau_replay"] == row["tau_live"], row
        assert row["c_predicted"] > 0 and row["c_live"] > 0
    assert max(r["tau_live"] for r in pilot.predictions) > 1.2  # the drafters do accept tokens here
    # the prediction beside the live figure is over the screened requests, not over all of them
    sub = pilot.planner.predict(NGRAM, requests=idx)
    assert pilot.predictions[0]["tau_replay"] == sub.tau
    assert sub.tau == replay(pilot.planner.recording(NGRAM).subset(idx), NGRAM)[0]


def test_replay_follows_the_budget_past_a_stop_token():
    """An output that ends at a stop token before its budget: the engine still drafts as deep as the budget allows
    near the end, and replay with the budget reproduces its steps (tokens kept and rows) one by one."""
    dep = Deployment(bundled_target_dir(), bundled_drafter_dir())
    prompt = dep.tokenizer("The quick brown fox jumps over the lazy dog. The quick brown", add_special_tokens=False)[
        "input_ids"]
    n = 24
    full = dep.system(SystemConfig.ar(), eos_ids=[]).generate(prompt, n).tokens
    stop = full[13]  # a token AR emits: as a stop id, the output ends there
    ar = dep.system(SystemConfig.ar(), eos_ids=[stop]).generate(prompt, n).tokens
    assert len(ar) < n and ar[-1] == stop
    cfg = SystemConfig(drafter="draft_model", tree="best_first", nodes=6, depth=6, top_k=4)
    rec = record(dep.system(cfg).drafter, [prompt], [ar], 6, 4, max_new_tokens=[n])
    g = dep.system(cfg, eos_ids=[stop]).generate(prompt, n)
    assert g.tokens == ar
    assert replay_steps(rec, cfg) == list(zip(g.accepted, g.rows))
    with pytest.raises(ValueError, match="max_new_tokens"):
        record(dep.system(cfg).drafter, [prompt], [ar], 6, 4, max_new_tokens=[len(ar) - 1])


def test_subset_keeps_the_requests_asked_for():
    lat = [{1: None}, {1: None, 2: None}, {}]
    rec = Recording([[1], [2], [3]], [[4, 5], [6, 7, 8], [9]], lat, depth=4, top_k=2, draft_ms=0.5, observe_ms=0.1,
                    max_new=[2, 3, 4], drafter_path="d")
    sub = rec.subset([2, 0])
    assert sub.prompts == [[3], [1]] and sub.ar == [[9], [4, 5]] and sub.lattices == [{}, {1: None}]
    assert sub.max_new == [4, 2] and (sub.draft_ms, sub.observe_ms, sub.drafter_path) == (0.5, 0.1, "d")
    assert rec.prompts == [[1], [2], [3]]  # the recording itself is unchanged
    for bad in ([], [3], [-1]):
        with pytest.raises(ValueError, match="outside"):
            rec.subset(bad)


def test_recording_times_each_calls_work(screened):
    """The recordings of the real cost-model inputs time what a step does: a block drafter's ``observe`` (its
    context K/V of the accepted tokens) besides ``propose``, a draft model's one-position ``propose`` besides its
    full depth, each request's first ``propose`` apart; the n-gram drafter and the draft model observe nothing."""
    pilot, _, inputs = screened
    recs = {kind: rec for (kind, _), rec in pilot.planner.recordings.items()}
    block = next(rec for kind, rec in recs.items() if kind.startswith("block"))
    assert block.observe_ms > 0 and block.draft_ms > 0 and block.first_ms > 0 and block.draft1_ms is None
    assert recs["ngram"].observe_ms == 0.0 and recs["draft_model"].observe_ms == 0.0
    dm = recs["draft_model"]
    assert dm.draft1_ms is not None and 0 < dm.draft1_ms < dm.draft_ms  # six positions cost more than one
    bcfg = SystemConfig(drafter="block", drafter_path=block.drafter_path, tree="chain", nodes=8, depth=8, top_k=16)
    steps = replay_steps(block, bcfg)
    first_share = (block.first_ms - block.draft_ms) * len(block.ar) / len(steps)
    assert pilot.planner.draft_time(bcfg) == pytest.approx(block.draft_ms + block.observe_ms + first_share)
    # its system's exact pass also gathers the target layers it reads: timed as such, and priced for it
    from specpilot.pilot.planner import VERIFY_ROWS, monotone

    assert block.target_layers and recs["ngram"].target_layers == ()
    curve = inputs.report["verify_ms_with_features"][",".join(map(str, block.target_layers))]
    assert set(curve) == set(VERIFY_ROWS) and all(v > 0 for v in curve.values())
    fit = monotone([curve[r] for r in sorted(curve)])
    assert [pilot.planner.verify_time(r, block.target_layers) for r in sorted(curve)] == pytest.approx(list(fit))
    # moving an accepted path into place: measured plain and with the block's features gathered
    assert set(inputs.report["move_ms"]) == {"", ",".join(map(str, block.target_layers))}


def _timed(**kw) -> Planner:
    """A planner over one recording without lattices (every step keeps one token, verifies one row): requests of
    5 and 3 tokens, so 4 + 2 = 6 steps, two of them a request's first."""
    rec = Recording([[1], [2]], [[3, 4, 5, 6, 7], [8, 9, 10]], [{}, {}], depth=6, top_k=8, **kw)
    return Planner({("draft_model", 8): rec}, {1: 1.0, 2: 1.1}, 1.0)


def test_draft_time_prices_each_measured_call():
    """Per step: propose (a draft model's interpolated between its measured depths, one pass per position after a
    catch-up and a host read, instead of the deepest scaled down, which priced those at a fraction of their
    cost), the observation, and each request's first propose beyond a later one, which live falls on the
    request's first step (2 of 6 steps here)."""
    cfg = DRAFT_MODEL.model_copy(update={"depth": 3, "nodes": 3})
    p = _timed(draft_ms=1.2, draft1_ms=0.45, first_ms=1.2)
    assert p.draft_time(cfg) == pytest.approx(0.45 + 0.75 * 2 / 5)
    assert p.draft_time(cfg.model_copy(update={"depth": 6, "nodes": 6})) == pytest.approx(1.2)
    assert p.draft_time(cfg.model_copy(update={"depth": 1, "nodes": 1})) == pytest.approx(0.45)
    assert _timed(draft_ms=1.2).draft_time(cfg) == pytest.approx(0.6)  # no one-position time: scaled
    first = _timed(draft_ms=1.2, first_ms=4.2).draft_time(cfg)
    assert first == pytest.approx(0.6 + 3.0 * 2 / 6)
    assert _timed(draft_ms=1.2, first_ms=4.2).draft_time(cfg, requests=[1]) == pytest.approx(0.6 + 3.0 / 2)
    assert _timed(draft_ms=1.2, first_ms=1.2, observe_ms=0.3).draft_time(cfg) == pytest.approx(0.9)
    # the prediction prices the same figure: c = (pass + drafting + tree) / T_AR, T_AR = 1 ms, no tree here
    pred = _timed(draft_ms=1.2, first_ms=4.2).predict(cfg, requests=[1])
    assert pred.tau == 1.0 and pred.c == pytest.approx(1.0 + 0.6 + 1.5)


def test_a_drafter_reading_target_layers_is_priced_on_the_pass_that_gathers_them():
    layers = (0, 2)
    rec = Recording([[1]], [[3, 4, 5]], [{}], depth=8, top_k=16, draft_ms=0.5, first_ms=0.5, target_layers=layers,
                    drafter_path="b")
    p = Planner({("block:b", 16): rec}, {1: 1.0, 9: 1.5}, 1.0, feature_verify_ms={layers: {1: 1.25, 9: 1.75}})
    cfg = SystemConfig(drafter="block", drafter_path="b", tree="chain", nodes=8, depth=8, top_k=16)
    assert p.verify_time(1, layers) == 1.25 and p.verify_time(1) == 1.0 and p.verify_time(9, (5,)) == 1.5
    assert p.predict(cfg).c == pytest.approx(1.25 + 0.5)  # every step verifies one row here (no lattice)
    plain = Planner({("block:b", 16): rec}, {1: 1.0, 9: 1.5}, 1.0)  # not measured: the plain pass
    assert plain.predict(cfg).c == pytest.approx(1.0 + 0.5)


@pytest.mark.parametrize("static", [False, True])
def test_verify_ms_times_the_pass_with_the_features_gathered(tiny_models, static):
    from specpilot.pilot.setup import measure_verify_ms

    target = tiny_models[0]
    ms = measure_verify_ms(target, prefix_len=16, rows=(1, 3), repeats=2, static=static, feature_layers=(0, 1))
    assert set(ms) == {1, 3} and all(v > 0 for v in ms.values())


def test_replay_trace_moves_the_paths_the_engine_compacts():
    """Replay's moved rows per step (the accepted path when it is not the tree's rows 0 … k−1) are the compactions
    the engine runs, in order and by length; a chain never moves."""
    dep = Deployment(bundled_target_dir(), bundled_drafter_dir())
    prompts = [dep.tokenizer(t, add_special_tokens=False)["input_ids"] for t in
               ("Question: Tom has 3 apples and buys 4 more. How many apples does he have?", "def add(a, b):\n")]
    n = 24
    ar = [dep.system(SystemConfig.ar(), eos_ids=[]).generate(p, n).tokens for p in prompts]
    rec = record(dep.system(DRAFT_MODEL.model_copy(update={"top_k": 8})).drafter, prompts, ar, 8, 8)
    chain = SystemConfig(drafter="draft_model", tree="chain", nodes=6, depth=6, top_k=1)
    assert all(mv == 0 for *_, mv in replay_trace(rec, chain))
    for cfg in (DRAFT_MODEL, SystemConfig(drafter="draft_model", tree="best_first", nodes=16, depth=8, top_k=8)):
        eng = dep.system(cfg, eos_ids=[])
        moved, compact = [], eng.cache.compact

        def counted(start, rows, compact=compact):
            moved.append(rows.numel())
            compact(start, rows)

        eng.cache.compact = counted
        for p in prompts:
            assert eng.generate(p, n).tokens == ar[prompts.index(p)]
        trace = replay_trace(rec, cfg)
        assert [mv for *_, mv in trace if mv] == moved
        assert [(k, r) for k, r, _ in trace] == replay_steps(rec, cfg)
    assert moved  # the 16-node tree accepts off its first rows here


def test_moves_are_priced_per_step_that_moves(tiny_models):
    from specpilot.pilot.setup import measure_move_ms

    p = Planner({}, {1: 1.0}, 1.0, move_ms={(): {2: 0.1, 3: 0.2}, (0, 1): {2: 0.3, 5: 0.6}})
    assert p.move_time([0, 2, 3, 0]) == pytest.approx(0.3 / 4)
    assert p.move_time([4, 0], (0, 1)) == pytest.approx(0.5 / 2)
    assert p.move_time([2, 2], (7,)) == 0.0 and p.move_time([]) == 0.0  # not measured / no steps
    ms = measure_move_ms(tiny_models[0], prefix_len=16, lengths=(2, 4), repeats=2, feature_layers=(0, 1))
    assert set(ms) == {2, 4} and all(v > 0 for v in ms.values())
    with pytest.raises(ValueError, match="at least 2 rows"):
        measure_move_ms(tiny_models[0], prefix_len=16, lengths=(1, 2))
