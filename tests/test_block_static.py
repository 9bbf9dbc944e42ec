"""A block drafter's step as one static pass (the CUDA-graph form, run eagerly on the CPU) with the target features
captured by the row-bucket runner: the same lattices as the eager drafter, and spec == AR."""

from __future__ import annotations

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.engine.engine import Engine
from specpilot.spec.block import BlockDrafter
from specpilot.spec.drafter import propose_one
from specpilot.spec.lattice import MarkovLattice
from specpilot.spec.trees import BUILDERS

from .blockutil import trained_pair
from .conftest import random_prompts
from .test_engine import ar_tokens, cache_matches_prefill


@pytest.fixture(scope="module")
def pair(tiny_models):
    return trained_pair(tiny_models[0])


@pytest.mark.parametrize("kind", ["block", "block_markov"])
@pytest.mark.parametrize("tree", ["chain", "best_first", "ddtree_marginal"])
def test_static_step_with_bucket_features_equals_ar(tiny_models, pair, kind, tree):
    """Row buckets (features from the runner's static buffer) + the drafter's static step: spec == AR, the cache
    equal to a fresh prefill after every step, some drafts accepted."""
    target = tiny_models[0]
    cfg = SystemConfig(drafter="block", tree=tree, nodes=12, depth=6, top_k=16)
    eng = Engine(target, cfg, BlockDrafter(pair[kind][0], target, static_step=True), eos_ids=[], buckets=True)
    assert eng.runner is not None and eng.runner.features is not None
    eng.step_hook = cache_matches_prefill
    accepted = []
    for p in random_prompts(3, length=10, seed=23):
        gen = eng.generate(p, 30)
        assert gen.tokens == ar_tokens(target, p, 30)
        accepted += gen.accepted
    assert max(accepted) > 1


def test_long_prompt_chunks_observed(tiny_models, pair):
    """A prompt longer than the largest row bucket is prefilled in chunks, each chunk's features observed: the
    drafter's context equals that of an eager engine, and the outputs equal AR."""
    from specpilot.engine.runner import BUCKETS

    target = tiny_models[0]
    net = pair["block"][0]
    cfg = SystemConfig(drafter="block", tree="best_first", nodes=8, depth=6, top_k=16)
    prompt = random_prompts(1, length=BUCKETS[-1] + 37, seed=4)[0]
    static = Engine(target, cfg, BlockDrafter(net, target, static_step=True), eos_ids=[], buckets=True)
    eager = Engine(target, cfg, BlockDrafter(net, target), eos_ids=[])
    gs, ge = static.generate(prompt, 12), eager.generate(prompt, 12)
    assert gs.tokens == ge.tokens == ar_tokens(target, prompt, 12)
    assert gs.accepted == ge.accepted


@pytest.mark.parametrize("kind", ["block", "block_markov"])
def test_static_lattice_equals_eager(tiny_models, pair, kind):
    """Step by step along AR outputs, the static step's lattice (staged observation, full-width masked context)
    equals the eager drafter's: same candidates, log-probs within float32 rounding."""
    target = tiny_models[0]
    net = pair[kind][0]
    prompt = random_prompts(1, length=9, seed=2)[0]
    out = ar_tokens(target, prompt, 14)
    seq = prompt + out
    feats: list = []
    target.forward(torch.tensor(seq), torch.arange(len(seq)), target.new_cache(len(seq)), 0, features=feats,
                   feature_layers=net.cfg.target_layers)
    f = torch.cat(feats, -1)
    static, eager = BlockDrafter(net, target, static_step=True), BlockDrafter(net, target)
    n = len(prompt)
    for d in (static, eager):
        d.observe(0, f[: n - 1], 0)
    grown = n
    for step in (1, 3, 2, 1, 4):  # commit a few tokens per step, as accepted paths do
        committed = seq[:grown]
        ls, le = propose_one(static, committed, 6), propose_one(eager, committed, 6)
        for path in [(), (ls.children(())[0][0],)]:
            cs, ce = ls.children(path), le.children(path)
            assert [t for t, _ in cs] == [t for t, _ in ce]
            assert max(abs(a - b) for (_, a), (_, b) in zip(cs, ce)) < 1e-4
        assert isinstance(ls, MarkovLattice) == (kind == "block_markov")
        for d in (static, eager):
            d.observe(0, f[grown - 1 : grown - 1 + step], grown - 1)
        grown += step
    assert static.context_length() == eager.context_length() == grown - 1


def test_reset_drops_the_staged_observation(tiny_models, pair):
    target = tiny_models[0]
    d = BlockDrafter(pair["block"][0], target, static_step=True)
    d.observe(0, torch.zeros(3, len(d.target_layers) * target.args.hidden_size), 0)
    assert d._step.pending == (0, 3)
    d.reset(0)
    assert d._step.pending is None and d.context_length() == 0
