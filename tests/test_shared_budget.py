"""The shared node budget (§4.4): the multi-request builder against best_first and a plain reference, its shares
(prefix-closed, within depth and top-K, within the budget, more nodes to a confident lattice), and the batched
engine with it: spec == AR in float32 for batches of random makeup, n-gram and block drafters."""

from __future__ import annotations

import math
import random

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.engine.batch import BatchEngine, Request
from specpilot.spec.block import BlockDrafter
from specpilot.spec.lattice import MarkovLattice, PositionalLattice, TrieLattice
from specpilot.spec.ngram import NgramDrafter
from specpilot.spec.trees import build_best_first, build_tree
from specpilot.spec.trees_batch import build_shared, build_shared_reference

from .blockutil import trained_pair
from .test_batch import ar, cache_matches_prefill, random_requests


def positional(rng: random.Random, depth: int, k: int, temp: float = 1.0) -> PositionalLattice:
    """Random positional lattice: distinct tokens per position, log-softmax of random logits / ``temp``."""
    toks = torch.tensor([rng.sample(range(100), k) for _ in range(depth)])
    logits = torch.tensor([[rng.gauss(0, 1) / temp for _ in range(k)] for _ in range(depth)])
    lp = torch.log_softmax(logits, -1).sort(-1, descending=True).values
    return PositionalLattice(toks, lp)


def markov(rng: random.Random, depth: int, k: int) -> MarkovLattice:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    toks = torch.stack([torch.randperm(100, generator=g)[:k] for _ in range(depth)])
    marg = torch.log_softmax(torch.randn(depth, k, generator=g), -1)
    cond = torch.log_softmax(torch.randn(depth, k, k, generator=g), -1)
    return MarkovLattice(toks, marg, cond, anchor=7, top_k=k)


def check_share(tree, lat):
    """Prefix-closed (parents precede children), depth within the lattice's, every node a lattice candidate of its
    parent's path (so at most top-K children per node), path scores consistent."""
    for i, (tok, p, d) in enumerate(zip(tree.tokens, tree.parents, tree.depths)):
        assert p < i and d == (1 if p < 0 else tree.depths[p] + 1) and d <= lat.depth
        kids = dict(lat.children(tree.path(p) if p >= 0 else ()))
        assert tok in kids
        assert math.isclose(tree.scores[i], (tree.scores[p] if p >= 0 else 0.0) + kids[tok], abs_tol=1e-9)
    for p in set(tree.parents):
        assert tree.parents.count(p) <= len(lat.children(tree.path(p) if p >= 0 else ()))
    assert len({tree.path(i) for i in range(len(tree))}) == len(tree)


@pytest.mark.parametrize("seed", range(6))
def test_one_request_is_best_first(seed):
    rng = random.Random(seed)
    lats = [positional(rng, 5, 3), markov(rng, 4, 4),
            TrieLattice([[rng.randrange(6) for _ in range(6)] for _ in range(5)], 5)]
    for lat in lats:
        for n in (0, 1, 5, 16, 40, 500):
            got = build_shared([lat], n)[0]
            want = build_tree("best_first", lat, n)
            assert (got.tokens, got.parents, got.scores) == (want.tokens, want.parents, want.scores)


@pytest.mark.parametrize("seed", range(8))
def test_shares_against_reference_and_budget(seed):
    rng = random.Random(100 + seed)
    n = rng.randint(2, 6)
    lats = [None if rng.random() < 0.15 else
            (positional(rng, rng.randint(1, 5), rng.randint(2, 4), rng.choice([0.3, 1, 3])) if rng.random() < 0.6
             else markov(rng, rng.randint(1, 4), rng.randint(2, 3))) for _ in range(n)]  # k >= 2: no score ties
    for budget in (0, 1, 7, 8 * n, 1000):
        trees = build_shared(lats, budget)
        ref = build_shared_reference(lats, budget)
        assert sum(len(t) for t in trees) <= budget
        for t, r, lat in zip(trees, ref, lats):
            assert (t.tokens, t.parents) == (r.tokens, r.parents)
            if lat is None:
                assert len(t) == 0
                continue
            check_share(t, lat)
            assert t.tokens == build_best_first(lat, len(t)).tokens  # each share: its own best-first prefix
        # best-first across requests: no node left out scores above a node kept
        if 0 < budget < 1000 and sum(len(t) for t in trees) == budget:
            kept = min(s for t in trees for s in t.scores)
            for t, lat in zip(trees, lats):
                if lat is not None:
                    left = build_best_first(lat, len(t) + 1)
                    if len(left) > len(t):
                        assert left.scores[-1] <= kept + 1e-12


def test_confident_request_gets_more_nodes():
    """A steep lattice (p(top) = 0.97 at each of 12 positions) beside a flat one (4 equal candidates): at 16 nodes
    for two requests the confident one takes its whole 12-node chain (path log-prob down to 12 log 0.97 = -0.37),
    the flat one its 4 first-position nodes (log 0.25 = -1.39 each) where an equal split gives 8 each."""
    d, k = 12, 4
    toks = torch.arange(d * k).view(d, k)
    steep = PositionalLattice(toks, torch.log(torch.tensor([[0.97, 0.01, 0.01, 0.01]] * d)))
    flat = PositionalLattice(toks + 100, torch.log(torch.full((d, k), 0.25)))
    a, b = build_shared([steep, flat], 16)
    assert (len(a), len(b)) == (12, 4)
    assert a.tokens == toks[:, 0].tolist() and b.depths == [1] * 4
    b2, a2 = build_shared([flat, steep], 16)  # order does not change who gets what here (no ties across)
    assert (len(a2), len(b2)) == (len(a), len(b))


def test_config_switch():
    c = SystemConfig(drafter="ngram", tree="best_first", nodes=4, top_k=2, row_selection="shared_budget",
                     shared_budget=(5, 9))
    assert [c.step_budget(n) for n in (1, 2, 3)] == [5, 9, 12]
    assert c.seal() != c.model_copy(update={"row_selection": "per_request", "shared_budget": ()}).seal()
    assert SystemConfig().seal() == SystemConfig(row_selection="per_request").seal()
    for bad in ({"tree": "chain"}, {"shared_budget": (0,)}):
        with pytest.raises(ValueError) as e:
            SystemConfig(**{**c.model_dump(), **bad})
        assert "shared_budget" in str(e.value)
    with pytest.raises(ValueError, match="row_selection is not shared_budget"):
        SystemConfig(tree="best_first", shared_budget=(4,))


def drafter_for(kind, target, cfg, slots):
    if kind == "ngram":
        return NgramDrafter(cfg.ngram_max, cfg.ngram_min, max_matches=cfg.top_k, max_slots=slots)
    return BlockDrafter(trained_pair(target)["block"][0], target, top_k=cfg.top_k, max_len=16, max_slots=slots)


@pytest.mark.parametrize("kind,seed,padded", [("ngram", 0, False), ("ngram", 1, False), ("ngram", 2, False),
                                              ("block", 0, False), ("block", 1, False), ("ngram", 3, True),
                                              ("block", 2, True)])
def test_shared_budget_batch_equals_ar(tiny_models, kind, seed, padded):
    """Random prompt lengths and budgets (requests join, finish at different times, stop ids); every step's rows
    within the step's budget; outputs equal AR greedy token for token. ``padded``: every decode step through the
    BatchRunner's buckets and the Triton batched tree attention (the interpreter here: the CUDA-graph path, eagerly),
    one request taking up to the whole budget."""
    target, _ = tiny_models
    rng = random.Random(1000 * seed + len(kind))
    budgets = tuple(rng.randint(1, 30) for _ in range(rng.choice([0, 2])))
    cfg = SystemConfig(drafter=kind, tree="best_first", nodes=rng.choice([3, 6]), depth=rng.choice([3, 5]),
                       top_k=3, row_selection="shared_budget", shared_budget=budgets)
    slots = rng.choice([2, 3, 4])
    eng = BatchEngine(target, cfg, drafter_for(kind, target, cfg, slots), eos_ids=[], max_num_seqs=slots,
                      padded=padded)
    eng.step_hook = cache_matches_prefill
    reqs = random_requests(rng, 8)
    for i, (p, n, stops) in enumerate(reqs):
        eng.add_request(Request(f"r{i}", p, n, stops))
    got = {f"r{i}": [] for i in range(len(reqs))}
    steps = []  # (requests in the step, nodes per request)
    draft = eng._draft
    eng._draft = lambda rs: (lambda out: steps.append((len(rs), [len(t) for t in out[0]])) or out)(draft(rs))
    while eng.has_work():
        for o in eng.step():
            got[o.request_id] += o.new_tokens
    assert len(steps) == eng.exact_passes and sum(sum(s) for _, s in steps) > 0
    assert all(sum(s) <= cfg.step_budget(n) for n, s in steps)
    if kind == "ngram":  # some step gave one request more than an equal split would
        assert any(max(s) > cfg.step_budget(n) // n for n, s in steps if n > 1) or budgets
    for i, (p, n, stops) in enumerate(reqs):
        assert got[f"r{i}"] == ar(target, p, n, stops), (i, p, n, sorted(stops))
    assert eng.free_slots() == slots
    if padded:  # every decode step fit a bucket: none fell back to the eager pass
        assert eng.runner.passes == eng.exact_passes > 0
        assert eng.runner.max_rows == 1 + max(cfg.step_budget(n) for n in range(1, slots + 1))
