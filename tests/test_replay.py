"""Exact replay of tree policies on block-drafter lattices: replay τ == the τ the live engine measures, for
every builder, node budget and depth, on the same prompts (float32 CPU)."""

from __future__ import annotations

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.spec.block import BlockDrafter
from specpilot.engine.engine import Engine
from specpilot.spec.trees import BUILDERS, SequoiaBuilder
from specpilot.pilot.replay import record, replay

from .blockutil import trained_pair
from .conftest import random_prompts
from .test_engine import ar_tokens

POLICIES = [(b, 8, 6) for b in sorted(BUILDERS)] + [("best_first", 16, 4), ("best_first", 3, 6), ("eagle2_topk", 20, 6)]


def live_tau(target, drafter, cfg, prompts, n):
    eng = Engine(target, cfg, drafter, eos_ids=[])
    gens = [eng.generate(p, n) for p in prompts]
    return sum(sum(g.accepted) for g in gens) / sum(g.steps for g in gens), sum(g.steps for g in gens)


@pytest.mark.parametrize("kind", ["block", "block_markov"])
def test_replay_equals_live(tiny_models, kind):
    target = tiny_models[0]
    net = trained_pair(target)[kind][0]
    prompts = random_prompts(3, length=12, seed=5)
    n = 36
    ar = [ar_tokens(target, p, n) for p in prompts]
    rec = record(BlockDrafter(net, target), prompts, ar, net.cfg.block_size, 16, target=target)
    # sequoia: the default (geometric) profile both in the engine and in replay
    taus = {}
    for builder, nodes, depth in POLICIES:
        cfg = SystemConfig(drafter="block", tree=builder, nodes=nodes, depth=depth, top_k=16)
        want = live_tau(target, BlockDrafter(net, target), cfg, prompts, n)
        got = replay(rec, cfg)
        assert got == want, (builder, nodes, depth, got, want)
        taus[(builder, nodes, depth)] = got[0]
    assert taus[("best_first", 8, 6)] > 1.3  # the trained drafter does accept tokens
    # top-K truncation replays too (the live lattice keeps the first K of the conditioned order)
    cfg = SystemConfig(drafter="block", tree="best_first", nodes=8, depth=6, top_k=2)
    assert replay(rec, cfg) == live_tau(target, BlockDrafter(net, target, top_k=2), cfg, prompts, n)
    oracle = replay(rec, SystemConfig(drafter="block", tree="best_first", nodes=6, depth=6, top_k=16), "oracle")[0]
    assert oracle >= max(t for (b, nn, d), t in taus.items() if d == 6) - 1e-9
    # a measured profile reaches the builder through ``sequoia`` (no registry is changed): a profile that puts all
    # acceptance on rank 0 gives the chain's shape, so the chain's τ
    chain_like = SequoiaBuilder([[1.0] + [0.0] * 15] * 16)
    seq = SystemConfig(drafter="block", tree="sequoia", nodes=6, depth=6, top_k=16)
    chain = SystemConfig(drafter="block", tree="chain", nodes=6, depth=6, top_k=16)
    assert replay(rec, seq, sequoia=chain_like) == replay(rec, chain)


def test_block_recording_needs_target(tiny_models):
    target = tiny_models[0]
    net = trained_pair(target)["block"][0]
    with pytest.raises(ValueError, match="target"):
        record(BlockDrafter(net, target), [[1, 2, 3]], [[4, 5, 6]], 4, 16)


def test_replay_equals_live_bundled():
    """The bundled target + block drafters, two bundled prompts, float32: replay τ == live τ exactly."""
    from specpilot.data.benchmarks import load_requests
    from specpilot.engine.deployment import Deployment
    from specpilot.zoo import bundled_block_dir, bundled_block_markov_dir, bundled_target_dir

    dirs = [d for d in (bundled_block_dir(), bundled_block_markov_dir()) if (d / "model.safetensors").is_file()]
    if not dirs:
        pytest.skip("bundled block drafters not built")
    dep = Deployment(bundled_target_dir(), block_dirs=dirs)
    tok = dep.tokenizer
    prompts = [tok(r.text, add_special_tokens=False)["input_ids"] for r in
               load_requests("gsm8k", 1) + load_requests("humaneval", 1)]
    n = 24
    ar = [dep.system(SystemConfig.ar(), eos_ids=[]).generate(p, n).tokens for p in prompts]
    for d in dirs:
        rec = record(dep.system(SystemConfig(drafter="block", drafter_path=str(d), top_k=16)).drafter,
                     prompts, ar, 16, 16, target=dep.target)
        for builder, nodes, depth in (("chain", 8, 8), ("best_first", 32, 8), ("ddtree_marginal", 16, 16)):
            cfg = SystemConfig(drafter="block", drafter_path=str(d), tree=builder, nodes=nodes, depth=depth, top_k=16)
            eng = dep.system(cfg, eos_ids=[])
            gens = [eng.generate(p, n) for p in prompts]
            assert [g.tokens for g in gens] == ar
            live = (sum(sum(g.accepted) for g in gens) / sum(g.steps for g in gens), sum(g.steps for g in gens))
            assert replay(rec, cfg) == live, (d.name, builder, nodes, depth)


def test_planner_proposes_block_drafters(tiny_models):
    """The planner's tree direction proposes block drafter configs (checkpoint, block size, builder) and
    predicts their τ by replay of the block recording."""
    from specpilot.pilot.planner import Planner

    target = tiny_models[0]
    net = trained_pair(target)["block"][0]
    prompts = random_prompts(2, length=12, seed=6)
    ar = [ar_tokens(target, p, 24) for p in prompts]
    rec = record(BlockDrafter(net, target), prompts, ar, net.cfg.block_size, 16, target=target)
    rec.drafter_path = "tiny-block"
    ngram = record(_ngram(), prompts, ar, 6, 1)
    planner = Planner({("block:tiny-block", 16): rec, ("ngram", 1): ngram}, {1: 1.0, 8: 1.1, 64: 1.5}, 1.2)
    space = planner.space(SystemConfig.stock("ngram"), "tree")
    blocks = [c for c in space if c.drafter == "block"]
    assert blocks and all(c.drafter_path == "tiny-block" and c.depth <= net.cfg.block_size for c in blocks)
    assert {c.tree for c in blocks} >= {"chain", "best_first", "ddtree_marginal", "eagle2_topk"}
    cfg = next(c for c in blocks if c.tree == "best_first")
    assert planner.predict(cfg).tau == replay(rec, cfg)[0]
    assert planner.predict(cfg.model_copy(update={"drafter_path": "other"})) is None


def _ngram():
    from specpilot.spec.ngram import NgramDrafter

    return NgramDrafter(4, 1, max_matches=1)
