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


@pytest.mark.parametrize("kind", ["block", "block_markov"])
def test_draft_vocabulary(tiny_models, pair, tmp_path, kind):
    """A draft vocabulary (the most frequent ids of the target's greedy outputs): candidates only from it, its
    log-probs normalized over it; spec == AR eager and static; the static lattice equals the eager one; the ids
    survive a checkpoint round trip; the whole vocabulary as the draft vocabulary changes nothing."""
    from specpilot.spec.block import load_block, save_block
    from specpilot.spec.train_block import with_draft_vocab

    target = tiny_models[0]
    v = target.args.vocab_size
    net = pair[kind][0]
    seen = torch.tensor([t for p in random_prompts(6, length=10, seed=31) for t in p + ar_tokens(target, p, 30)])
    ids = torch.bincount(seen, minlength=v).argsort(descending=True)[: v // 4].sort().values
    small = with_draft_vocab(net, ids).eval()
    back = load_block(save_block(small, tmp_path / "dv"), target)
    assert back.cfg.draft_vocab_size == len(ids) and torch.equal(back.draft_ids, ids)
    from specpilot.errors import DrafterError

    with pytest.raises(DrafterError, match="draft vocabulary holds 16"):  # fewer ids than candidates a position
        load_block(save_block(with_draft_vocab(net, ids[:15]), tmp_path / "dv15"), target)
    cfg = SystemConfig(drafter="block", tree="best_first", nodes=12, depth=6, top_k=16)
    prompt = random_prompts(1, length=10, seed=31)[0]
    for static in (False, True):
        d = BlockDrafter(small, target, static_step=static)
        eng = Engine(target, cfg, d, eos_ids=[], buckets=static)
        gen = eng.generate(prompt, 30)
        assert gen.tokens == ar_tokens(target, prompt, 30) and max(gen.accepted) > 1
    eager, static = BlockDrafter(small, target), BlockDrafter(small, target, static_step=True)
    full, whole = BlockDrafter(net, target), BlockDrafter(with_draft_vocab(net, torch.arange(v)).eval(), target)
    feats: list = []
    target.forward(torch.tensor(prompt), torch.arange(len(prompt)), target.new_cache(len(prompt)), 0,
                   features=feats, feature_layers=net.cfg.target_layers)
    f = torch.cat(feats, -1)
    committed = prompt[:-1] + [prompt[-1]]
    for d in (eager, static, full, whole):
        d.observe(0, f[:-1], 0)
    le, ls, lf, lw = (propose_one(d, committed, 6) for d in (eager, static, full, whole))
    allowed = set(ids.tolist())
    for path in [(), (le.children(())[0][0],)]:
        ce = le.children(path)
        assert all(t in allowed for t, _ in ce)
        assert [t for t, _ in ce] == [t for t, _ in ls.children(path)]
        assert max(abs(a - b) for (_, a), (_, b) in zip(ce, ls.children(path))) < 1e-4
        if not path:  # renormalized over fewer ids: each kept candidate's log-prob is at least the full one's
            lfull = dict(lf.children(path))
            assert all(p >= lfull[t] - 1e-5 for t, p in ce if t in lfull)
    for path in [(), (lf.children(())[0][0],)]:
        assert [t for t, _ in lf.children(path)] == [t for t, _ in lw.children(path)]
        assert max(abs(a - b) for (_, a), (_, b) in zip(lf.children(path), lw.children(path))) < 1e-4
