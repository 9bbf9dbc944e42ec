"""Load plans: one sealed system per batch size, each batched step running the system of the size nearest its load.
The rule, the plan's checks, and the engine under a plan: every output equal to AR in float32 while the load moves
across sizes and the step's system (and drafter) changes with it; each drafter asked only at its sizes; a drafter
that reads target features observing every pass, also the passes another system ran."""

from __future__ import annotations

import random
import zlib

import pytest

from specpilot.config import SystemConfig
from specpilot.engine.batch import BatchEngine, Request
from specpilot.engine.deployment import Deployment
from specpilot.engine.load_plan import LoadPlan
from specpilot.errors import DrafterError, SpecPilotError
from specpilot.zoo import bundled_drafter_dir, bundled_target_dir

from .test_batch import ar, cache_matches_prefill, drafter_of, random_requests

NGRAM_SHARED = SystemConfig(drafter="ngram", tree="best_first", nodes=2, depth=4, top_k=3,
                            row_selection="shared_budget", shared_budget=(3, 4, 5))


def test_a_step_runs_the_system_of_the_nearest_size_on_a_log_scale():
    plan = LoadPlan.from_sizes({32: SystemConfig.ar(), 1: SystemConfig(), 8: NGRAM_SHARED})
    assert plan.sizes == (1, 8, 32)
    got = {m: plan.sizes[plan.index_for(m)] for m in (1, 2, 3, 4, 8, 11, 12, 16, 17, 100)}
    # 2: log 2 < log 4; 3: log 3 > log 8/3; 4: a tie with 1 and 8 -> the larger; 16: a tie between 8 and 32 -> 32
    assert got == {1: 1, 2: 1, 3: 8, 4: 8, 8: 8, 11: 8, 12: 8, 16: 32, 17: 32, 100: 32}
    assert plan.config_for(100) == SystemConfig.ar() and plan.config_for(1) == SystemConfig()
    with pytest.raises(ValueError, match="at least one request"):
        plan.index_for(0)
    for a, b, m in ((9, 16, 12), (4, 9, 6), (1, 49, 7), (8, 18, 12)):  # exact log-midpoints: float logs split them
        two = LoadPlan((a, b), (SystemConfig(), SystemConfig.ar()))
        assert two.sizes[two.index_for(m)] == b and two.sizes[two.index_for(m - 1)] == a, (a, b, m)
    assert LoadPlan.single(NGRAM_SHARED).config_for(1000) == NGRAM_SHARED
    assert "1: ngram/chain" in plan.describe() and "32: AR" in plan.describe()


def test_pool_rows_follow_the_largest_tree_a_step_can_run():
    plan = LoadPlan.from_sizes({1: SystemConfig(tree="best_first", nodes=6, top_k=2), 4: NGRAM_SHARED,
                                16: SystemConfig.ar()})
    assert plan.tree_rows(3) == 6  # the per-request tree of 6 beats the shared budget's 5 at 3 requests
    assert [plan.index_for(m) for m in range(1, 9)] == [0, 1, 1, 1, 1, 1, 1, 2]
    assert plan.tree_rows(8) == 2 * 7  # past the budget's entries a shared step gets nodes x n; at 8 AR runs
    assert plan.step_extra_rows(8) is None  # a per-request system drafts: rows per request bound a step
    assert LoadPlan.from_sizes({1: NGRAM_SHARED, 8: SystemConfig.ar()}).step_extra_rows(3) == 4  # loads 1, 2
    assert LoadPlan.single(SystemConfig.ar()).tree_rows(8) == 0
    assert LoadPlan.single(NGRAM_SHARED).tree_rows(8) == 16  # one system runs at every load
    assert plan.tree_rows(3, drafts=[False, True, False]) == 5


def test_a_budget_for_loads_another_system_runs_sizes_nothing():
    """A pilot's size-1 seal carries the shared budget of every load (32 nodes at 32 requests), but past one request
    the plan runs AR: neither the pool nor the CUDA graphs' rows are sized for budgets no step can run."""
    shared = NGRAM_SHARED.apply({"shared_budget": (8,) * 8 + (32,) * 24})
    plan = LoadPlan.from_sizes({1: shared, 2: SystemConfig.ar(), 32: SystemConfig.ar()})
    assert plan.tree_rows(32) == 8 and plan.step_extra_rows(32) == 8
    assert LoadPlan.single(shared).tree_rows(32) == 32


@pytest.mark.parametrize("systems,match", [
    ({1: SystemConfig(), 8: SystemConfig(dtype="bfloat16")}, "dtype values differ"),
    ({1: SystemConfig(w12=True), 8: SystemConfig()}, "w12 values differ"),
    ({1: SystemConfig(tlv=True), 8: SystemConfig()}, "tlv runs single requests"),
    ({1: SystemConfig(drafter="block", top_k=2), 8: SystemConfig(drafter="block", top_k=4)}, "one drafter that reads"),
])
def test_a_plan_whose_systems_cannot_share_an_engine_is_refused(systems, match):
    with pytest.raises(SpecPilotError, match=match):
        LoadPlan.from_sizes(systems)


def test_sizes_must_increase_and_match_the_systems():
    with pytest.raises(SpecPilotError, match="increase"):
        LoadPlan((4, 2), (SystemConfig(), SystemConfig()))
    with pytest.raises(SpecPilotError, match="one system per size"):
        LoadPlan((1, 2), (SystemConfig(),))
    with pytest.raises(SpecPilotError, match="one system per size"):
        LoadPlan((), ())


def _spy(drafter, calls, label, eng_ref):
    real = drafter.propose

    def propose(batch):
        calls.append((label, len(eng_ref[0]._running)))
        return real(batch)

    drafter.propose = propose


@pytest.mark.parametrize("small_kind,padded", [("draft_model", False), ("block", False), ("block", True)])
def test_outputs_equal_ar_while_the_load_moves_across_sizes(tiny_models, small_kind, padded):
    """Sizes 1 / 3 / 5: one request runs ``small_kind``'s best-first tree, 2-3 share an n-gram budget, 4-5 run AR.
    Requests arrive in waves so the load climbs and falls through every size several times (a request that met a
    step of another system drafts no more with a block drafter: the first runs alone first). ``padded``: the
    BatchRunner's path (the interpreter here), where the AR steps run the one-row layout without features."""
    target, small = tiny_models
    rng = random.Random(zlib.crc32(small_kind.encode()))
    one = SystemConfig(drafter=small_kind, tree="best_first", nodes=6, depth=4, top_k=2)
    plan = LoadPlan.from_sizes({1: one, 3: NGRAM_SHARED, 5: SystemConfig.ar()})
    drafters = [drafter_of(small_kind, target, small, 5, one), drafter_of("ngram", target, small, 5, NGRAM_SHARED),
                None]
    eng = BatchEngine(target, plan, drafters, eos_ids=[], max_num_seqs=5, padded=padded)
    assert eng.drafters == tuple(drafters[:2]) and eng.feature_drafter is (drafters[0] if small_kind == "block" else None)
    eng.step_hook = cache_matches_prefill
    calls, ref = [], [eng]
    _spy(drafters[0], calls, small_kind, ref)
    _spy(drafters[1], calls, "ngram", ref)
    reqs = [([3, 1, 4, 1, 5, 9, 2, 6], 20, frozenset())] + random_requests(rng, 14)
    got, i, loads = {f"r{k}": [] for k in range(len(reqs))}, 1, set()
    eng.add_request(Request("r0", *reqs[0]))  # alone for its first steps: a block drafter's context follows it
    for _ in range(4):
        for o in eng.step():
            got[o.request_id] += o.new_tokens
    while i < len(reqs) or eng.has_work():
        if i < len(reqs) and (not eng.has_work() or rng.random() < 0.3):  # a wave of 1-4 arrivals
            for _ in range(rng.randint(1, 4)):
                if i < len(reqs):
                    p, n, stops = reqs[i]
                    eng.add_request(Request(f"r{i}", p, n, stops))
                    i += 1
        loads.add(len(eng._running) + min(eng.free_slots(), eng.num_waiting()))  # this step's running requests
        for o in eng.step():
            got[o.request_id] += o.new_tokens
    assert {1, 2, 3, 4, 5} <= loads  # every size's range was visited
    assert sum(eng.plan_steps) == eng.exact_passes and min(eng.plan_steps) > 0  # every system ran decode steps
    assert {lbl for lbl, _ in calls} == {small_kind, "ngram"}  # both systems drafted in this run
    assert all(m == 1 for lbl, m in calls if lbl == small_kind) and all(m in (2, 3) for lbl, m in calls if lbl == "ngram")
    for k, (p, n, stops) in enumerate(reqs):
        assert got[f"r{k}"] == ar(target, p, n, stops), (k, p, n, sorted(stops))
    assert eng.free_slots() == 5 and not eng.has_work()
    if padded:  # trees with the features for the block drafter, AR / n-gram steps without; one-row steps laid out so
        assert eng.runner.plain_steps and eng.runner.passes == eng.exact_passes
        assert eng.runner.layouts.get((1, False), 0) > 0 and eng.runner.layouts.get((eng.runner.max_rows, True), 0) > 0
        assert (eng.runner.max_rows, False) in eng.runner.layouts  # the shared n-gram trees: no features


def test_ar_steps_draft_nothing_and_two_feature_readers_are_refused(tiny_models):
    target, small = tiny_models
    plan = LoadPlan.from_sizes({1: NGRAM_SHARED, 2: SystemConfig.ar()})
    eng = BatchEngine(target, plan, [drafter_of("ngram", target, small, 4, NGRAM_SHARED), None], eos_ids=[],
                      max_num_seqs=4)
    for k in range(4):
        eng.add_request(Request(f"r{k}", [3, 4, 5, 3, 4, 5, 3, 4], 12))
    drafted = []
    while eng.has_work():
        running = len(eng._running)
        outs = eng.step()
        drafted += [(running, o.drafted, o.draft_depth) for o in outs if running > 0]
    assert all(d == 0 and depth == 0 for m, d, depth in drafted if m >= 2)
    block = SystemConfig(drafter="block", tree="best_first", nodes=4, depth=4, top_k=2)
    two = LoadPlan((1, 2), (block, block))  # equal configs: one key, but two drafter objects given
    with pytest.raises(DrafterError, match="one drafter may read target features"):
        BatchEngine(target, two, [drafter_of("block", target, small, 2, block), drafter_of("block", target, small, 2,
                                                                                             block)], max_num_seqs=2)
    with pytest.raises(ValueError, match="2 systems in the plan, 1 drafters"):
        BatchEngine(target, two, [None], max_num_seqs=2)


def test_deployment_builds_one_drafter_per_distinct_drafter_and_serves_the_plan():
    dep = Deployment(bundled_target_dir(), bundled_drafter_dir(), dtype="float32", device="cpu")
    chain = SystemConfig.stock("ngram", depth=4)
    plan = LoadPlan.from_sizes({1: SystemConfig(drafter="draft_model", tree="best_first", nodes=4, depth=4, top_k=2),
                                2: chain, 4: chain.model_copy(update={"nodes": 2, "depth": 2}), 8: SystemConfig.ar()})
    eng = dep.batch_system(plan, max_num_seqs=8, max_len=256)
    assert [d.kind for d in eng.drafters] == ["draft_model", "ngram"]  # sizes 2 and 4 share the n-gram drafter
    prompts = [list(range(5, 5 + 3 * k)) * 2 for k in range(1, 7)]
    gens = eng.generate_all(prompts, 10)
    ref = dep.batch_system(SystemConfig.ar(), max_num_seqs=1, max_len=256)
    assert [g.tokens for g in gens] == [g.tokens for g in ref.generate_all(prompts, 10)]


def test_server_metrics_count_each_sealed_size_steps():
    """``specpilot:load_plan_steps_total{sealed_size}`` follows the engine's running totals."""
    from prometheus_client.parser import text_string_to_metric_families

    from specpilot.serve.metrics import ServerMetrics

    m = ServerMetrics("m")
    m.plan((1, 8), [2, 0])
    m.plan((1, 8), [5, 4])
    m.plan((1, 8), [5, 4])  # no new steps: nothing added
    fam = {f.name: f for f in text_string_to_metric_families(m.render()[0].decode())}["specpilot:load_plan_steps"]
    got = {s.labels["sealed_size"]: s.value for s in fam.samples if s.name.endswith("_total")}
    assert got == {"1": 5.0, "8": 4.0}


def test_steps_of_a_system_without_the_feature_drafter_leave_it_unfed_and_their_requests_undrafted(tiny_models):
    """Plan {1: block, 3: AR}: the prefill and AR steps of three requests do not feed the block drafter (no
    observe), so those requests never draft, even alone; a request that arrives alone drafts; outputs equal AR."""
    target, small = tiny_models
    block = SystemConfig(drafter="block", tree="best_first", nodes=6, depth=4, top_k=2)
    drafter = drafter_of("block", target, small, 3, block)
    eng = BatchEngine(target, LoadPlan.from_sizes({1: block, 3: SystemConfig.ar()}), [drafter, None], eos_ids=[],
                      max_num_seqs=3)
    fed, observe = [], drafter.observe
    drafter.observe = lambda slot, feats, start: fed.append(len(eng._running)) or observe(slot, feats, start)
    reqs = [([5, 9, 2, 7, 5, 9], 6), ([11, 3, 8], 30), ([4, 4, 6, 1, 2], 8)]
    for k, (p, n) in enumerate(reqs):
        eng.add_request(Request(f"r{k}", p, n))
    got, drafted = {f"r{k}": [] for k in range(4)}, {f"r{k}": 0 for k in range(4)}
    while eng.has_work():
        for o in eng.step():
            got[o.request_id] += o.new_tokens
            drafted[o.request_id] += o.drafted
    assert fed == [] and drafted["r1"] == 0  # prefilled together at 3 (AR); r1 ran alone after the others ended
    late = [7, 1, 7, 1, 7, 1]
    eng.add_request(Request("r3", late, 20))
    while eng.has_work():
        for o in eng.step():
            got[o.request_id] += o.new_tokens
            drafted[o.request_id] += o.drafted
    assert drafted["r3"] > 0 and len(fed) > 1 and set(fed) <= {0, 1}
    for k, (p, n) in enumerate(reqs + [(late, 20)]):
        assert got[f"r{k}"] == ar(target, p, n, frozenset()), k
