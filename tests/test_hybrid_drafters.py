"""Every drafter kind and every tree builder on a tiny hybrid (qwen3_5: Gated DeltaNet + gated attention) target,
CPU float32: speculative output equals AR token for token with the n-gram drafter, a dense and a hybrid draft model,
block, block_markov and eagle3 drafters reading the hybrid target's features; chains verified with per-row state
snapshots and with replayed commits, trees with replayed commits; partial acceptance at every depth and steps that
draft nothing; after every step of a request the GDN state, conv window and K/V equal a fresh prefill (R9, R10).
The hybrid draft model drafts past its committed tokens and rolls its recurrent state back (its lattices equal a
fresh drafter's); the features a hybrid target hands a drafter are the named layers' outputs, as a dense target's."""

from __future__ import annotations

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.engine.engine import Engine
from specpilot.spec.block import BlockDrafter
from specpilot.spec.draft_model import DraftModelDrafter
from specpilot.spec.drafter import propose_one
from specpilot.spec.trees import BUILDERS

from .conftest import random_prompts
from .hybridutil import (KINDS, LAYERS, TOP_K, Skipping, ar_tokens, drafter_nets, make_drafter, requests,
                         state_matches_prefill, tiny_target, verify_mode)
from .test_hybrid import TINY

V = TINY["vocab_size"]
DEPTH, NODES = 5, 12
CASES = [("chain", "snapshot"), ("chain", "replay")] + [(t, "replay") for t in sorted(BUILDERS) if t != "chain"]


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def nets():
    return drafter_nets()


@pytest.mark.parametrize("tree,mode", CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_spec_equals_ar(target, nets, kind, tree, mode):
    """The first request drafts nothing every third step and checks the cache after every step; the second runs the
    drafter plainly."""
    name, drafter = make_drafter(kind, target, nets)
    cfg = SystemConfig(drafter=name, tree=tree, nodes=NODES, depth=DEPTH, top_k=TOP_K)
    accepted = []
    with verify_mode(target, mode):
        for i, (p, n) in enumerate(requests(V)):
            eng = Engine(target, cfg, Skipping(drafter, 3) if i == 0 else drafter, eos_ids=[])
            if i == 0:
                eng.step_hook = state_matches_prefill
            gen = eng.generate(p, n)
            assert gen.tokens == ar_tokens(target, p, n), (kind, tree, mode, i)
            assert max(gen.rows) <= (DEPTH if tree == "chain" else NODES) + 1
            accepted += gen.accepted
    assert 1 in accepted and 1 < max(accepted) <= DEPTH + 1


@pytest.mark.parametrize("kind", ["draft_hybrid", "block", "eagle3"])
def test_acceptance_at_every_depth(target, nets, kind):
    """A chain accepts every length from 0 to DEPTH drafted tokens (+ the bonus) over a few requests: the commit
    moves the GDN state to every position of the verified rows."""
    name, drafter = make_drafter(kind, target, nets)
    eng = Engine(target, SystemConfig(drafter=name, tree="chain", nodes=DEPTH, depth=DEPTH, top_k=1), drafter,
                 eos_ids=[])
    accepted = set()
    for p in random_prompts(4, V, length=12, seed=5):
        gen = eng.generate(p, 40)
        assert gen.tokens == ar_tokens(target, p, 40)
        accepted |= set(gen.accepted)
    assert accepted == set(range(1, DEPTH + 2)), (kind, sorted(accepted))


def test_hybrid_draft_model_lattices_equal_a_fresh_drafter(target, nets):
    """The hybrid draft model commits each drafted position to run the next, then rolls its state back: along a
    request its lattices equal those of a drafter that sees the context for the first time, also when asked again at
    the same context or at a shorter one (its cache restarts from the first token), and its cache holds exactly the
    committed tokens after each draft."""
    model = nets["draft_hybrid"]
    d = DraftModelDrafter(model, top_k=TOP_K)
    prompt = random_prompts(1, V, seed=3)[0]
    ar = ar_tokens(target, prompt, 16)
    for m in (1, 2, 4, 5, 9, 9, 7, 12):  # grows by 1, 2, 1, 4; the same again; shorter; longer
        ctx = prompt + ar[:m]
        got, want = propose_one(d, ctx, DEPTH), propose_one(DraftModelDrafter(model, top_k=TOP_K), ctx, DEPTH)
        assert got.depth == want.depth == DEPTH
        for j in range(DEPTH):
            (gt, gl), (wt, wl) = zip(*got.children((0,) * j)), zip(*want.children((0,) * j))
            assert gt == wt and max(abs(a - b) for a, b in zip(gl, wl)) < 1e-5, (m, j)
        assert d.cache.length == len(ctx)
        fresh = model.new_cache(len(ctx))
        model.forward(torch.tensor(ctx), torch.arange(len(ctx)), fresh, 0)
        fresh.commit(len(ctx))
        torch.testing.assert_close(d.cache.state, fresh.state, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(d.cache.window, fresh.window, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_features_are_the_named_layers_outputs(target, nets):
    """A hybrid target hands the outputs of the named decoder layers (GDN or attention), in the order named, as a
    dense target does; along a tree-verified request the features the engine hands a drafter for each committed slot
    equal a causal pass over the committed tokens."""
    for model, layers in ((target, (3, 0, 1)), (nets["draft_dense"], (0,))):
        outs = {}
        hooks = [model.model.layers[i].register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o))
                 for i in layers]
        ids = torch.tensor(random_prompts(1, V, length=15, seed=2)[0])
        feats: list = []
        try:
            model.forward(ids, torch.arange(15), model.new_cache(16), 0, features=feats, feature_layers=layers)
        finally:
            for h in hooks:
                h.remove()
        assert len(feats) == len(layers) and all(torch.equal(f, outs[i]) for f, i in zip(feats, layers))
    seen = torch.zeros(80, len(LAYERS) * target.args.hidden_size)
    block = BlockDrafter(nets["block"], target, top_k=TOP_K)

    class Recording(Skipping):  # never skips; keeps what it observes
        def observe(self, slot, features, start):
            seen[start : start + features.shape[0]] = features
            super().observe(slot, features, start)

    prompt = requests(V)[0][0]
    with verify_mode(target, "replay"):
        eng = Engine(target, SystemConfig(drafter="block", tree="best_first", nodes=NODES, depth=DEPTH, top_k=TOP_K),
                     Recording(block, 10**9), eos_ids=[])
        gen = eng.generate(prompt, 30)
    assert max(gen.accepted) > 2  # some steps commit a path of several tree rows
    committed = prompt + gen.tokens
    n = len(committed) - 1  # every committed slot but the last token's was observed
    feats = []
    target.forward(torch.tensor(committed[:n]), torch.arange(n), target.new_cache(n), 0, features=feats,
                   feature_layers=LAYERS)
    torch.testing.assert_close(seen[:n], torch.cat(feats, -1), atol=1e-5, rtol=1e-5)
