"""A block drafter's batched step as one static pass per (requests, width) bucket (CUDA graphs on a GPU, run eagerly
here): the same lattices as the eager batched drafter through staged, eager and reset observations, and spec == AR
through the batched engine. float32 CPU."""

from __future__ import annotations

import random

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.engine.batch import BatchEngine
from specpilot.spec.block import BlockDrafter
from specpilot.spec.block_batch_step import request_buckets
from specpilot.spec.drafter import DraftRequest

from .blockutil import trained_pair
from .conftest import random_prompts
from .test_engine import ar_tokens

pytestmark = pytest.mark.usefixtures("one_thread")


def test_request_buckets():
    assert request_buckets(1) == [1] and request_buckets(5) == [1, 2, 4, 5] and request_buckets(8) == [1, 2, 4, 8]


def _same(la, lb, depth):
    for pos in range(depth):  # a positional lattice: every path of one length has the same children
        path = (la.children(())[0][0],) * pos
        ca, cb = la.children(path), lb.children(path)
        assert [t for t, _ in ca] == [t for t, _ in cb]
        assert max(abs(a - b) for (_, a), (_, b) in zip(ca, cb)) < 1e-4


def test_batched_static_lattices_equal_the_eager_drafters(tiny_models):
    """Four slots, random features and lengths: prompts observed eagerly (longer than P), then steps of 1..P rows
    staged, a slot observed twice before its draft, a slot left out of a step, a reset slot: each drafted
    lattice equals the eager drafter's (same candidates, log-probs within float32 rounding)."""
    target = tiny_models[0]
    net = trained_pair(target)["block"][0]
    fdim = len(net.cfg.target_layers) * target.args.hidden_size
    static = BlockDrafter(net, target, max_slots=4, max_len=64, batch_step=True)
    eager = BlockDrafter(net, target, max_slots=4, max_len=64)
    assert static.slot_k.shape[0] == 5 and static._batch is not None
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    seqs = {s: [rng.randrange(64) for _ in range(rng.randint(9, 20))] for s in range(4)}

    def observe(slot, start, k):
        f = torch.randn(k, fdim, generator=gen)
        for d in (static, eager):
            d.observe(slot, f, start)

    for s, seq in seqs.items():
        observe(s, 0, len(seq) - 1)
    p = static._batch.pad_rows
    for step in range(6):
        slots = [s for s in range(4) if not (step == 2 and s == 1)]  # slot 1 sits one step out
        batch = [DraftRequest(s, seqs[s], rng.randint(1, 6)) for s in slots]
        for la, lb, q in zip(static.propose(batch), eager.propose(batch), batch):
            _same(la, lb, q.depth)
        for s in slots:
            k = rng.randint(1, p)
            observe(s, len(seqs[s]) - 1, k)
            seqs[s] += [rng.randrange(64) for _ in range(k)]
            if step == 3 and s == 0:  # observed again before its next draft: the older observation written first
                observe(s, len(seqs[s]) - 1, 2)
                seqs[s] += [rng.randrange(64) for _ in range(2)]
        if step == 4:
            for d in (static, eager):
                d.reset(2)
            seqs[2] = [rng.randrange(64) for _ in range(12)]
            observe(2, 0, 11)
    assert [static.context_length(s) for s in range(4)] == [eager.context_length(s) for s in range(4)]
    assert all(static.context_length(s) == len(seqs[s]) - 1 for s in range(4))
    static.reset(0)
    assert 0 not in static._batch.pending


@pytest.mark.parametrize("tree", ["chain", "best_first"])
def test_batched_engine_with_the_static_batch_step_equals_ar(tiny_models, tree):
    """Five requests through three slots (a bucket of 4 with a scratch request at times), prompts shorter and
    longer than P: spec == AR, drafts accepted."""
    target = tiny_models[0]
    net = trained_pair(target)["block"][0]
    cfg = SystemConfig(drafter="block", tree=tree, nodes=12 if tree == "best_first" else 6, depth=6,
                       top_k=16 if tree == "best_first" else 1)
    drafter = BlockDrafter(net, target, max_slots=3, max_len=32, batch_step=True)
    eng = BatchEngine(target, cfg, drafter, max_num_seqs=3, eos_ids=[])
    prompts = [p[: n] for p, n in zip(random_prompts(5, length=24, seed=41), (3, 24, 9, 5, 17))]
    gens = eng.generate_all(prompts, 30)
    assert [g.tokens for g in gens] == [ar_tokens(target, p, 30) for p in prompts]
    assert max(a for g in gens for a in g.accepted) > 1 and drafter.slot_k.shape[2] >= 64  # the buffers grew


def test_markov_heads_are_refused(tiny_models):
    target = tiny_models[0]
    with pytest.raises(ValueError, match="Markov"):
        BlockDrafter(trained_pair(target)["block_markov"][0], target, max_slots=2, batch_step=True)
