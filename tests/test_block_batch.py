"""A block drafter holding many requests in slots drafts a batch in one pass of its network, and each request's
lattice equals the one it gets drafted alone (float32 CPU: the same candidates in the same order, log-probs within
1e-5), whatever shares its batch: context lengths, depths (0 included), slots not contiguous, buffers grown."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from specpilot.errors import DrafterError
from specpilot.spec.block import BlockDrafter, BlockNet
from specpilot.spec.drafter import Drafter, DraftRequest, propose_one
from specpilot.spec.lattice import MarkovLattice, PositionalLattice

from .blockutil import tiny_config


def _net(target, markov_rank: int, seed: int) -> BlockNet:
    """A 2-layer block drafter of block 6 with random weights (a strong Markov head when it has one)."""
    cfg = dataclasses.replace(tiny_config(target, block=6, markov_rank=markov_rank), layers=2)
    torch.manual_seed(seed)
    net = BlockNet(cfg)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        if markov_rank:
            net.markov_v.weight.normal_(std=1.0)
    return net.eval().requires_grad_(False)


def _features(target, layers, committed: list[int]) -> torch.Tensor:
    """Target features ``[n - 1, F]`` of ``committed[:-1]`` (the context a block drafter reads)."""
    n = len(committed) - 1
    if n == 0:
        return torch.zeros(0, len(layers) * target.args.hidden_size)
    feats: list = []
    with torch.inference_mode():
        target.forward(torch.tensor(committed[:-1]), torch.arange(n), target.new_cache(n), 0, features=feats,
                       feature_layers=layers)
    return torch.cat(feats, -1)


def _observe_in_chunks(d: BlockDrafter, slot: int, feats: torch.Tensor, rng: random.Random) -> None:
    """Observe ``feats`` from position 0 in random chunks, as the engine does after each step."""
    d.reset(slot)
    if len(feats) == 0:
        return
    start = 0
    while start < len(feats):
        k = rng.randint(1, len(feats) - start)
        d.observe(slot, feats[start : start + k], start)
        start += k


def _assert_same_lattice(got, want) -> None:
    assert type(got) is type(want) and got.depth == want.depth
    for d in range(want.depth):
        if isinstance(want, PositionalLattice):
            pairs = [(got.children((0,) * d), want.children((0,) * d))]
        else:  # every parent the lattice stores scores for, and the parent-free scores
            parents = [want.anchor] if d == 0 else [t for t, _ in want.marginal((0,) * (d - 1))]
            paths = [(p,) if d == 0 else (0,) * (d - 1) + (p,) for p in parents]
            pairs = [(got.children(p[:d]), want.children(p[:d])) for p in paths]
            pairs.append((got.marginal((0,) * d), want.marginal((0,) * d)))
        for g, w in pairs:
            assert [t for t, _ in g] == [t for t, _ in w], (d, g, w)
            torch.testing.assert_close(torch.tensor([lp for _, lp in g]), torch.tensor([lp for _, lp in w]),
                                       atol=1e-5, rtol=0)


@pytest.mark.parametrize("markov_rank", [0, 8])
def test_a_batch_equals_each_request_drafted_alone(tiny_models, markov_rank, monkeypatch):
    target = tiny_models[0]
    net = _net(target, markov_rank, seed=3 + markov_rank)
    b = net.cfg.block_size
    rng = random.Random(markov_rank)
    batched = BlockDrafter(net, target, max_len=8, max_slots=7)  # 8 positions: the buffers grow on the way
    alone = BlockDrafter(net, target)
    calls = []
    real = net.run
    monkeypatch.setattr(net, "run", lambda x, *a: calls.append(tuple(x.shape)) or real(x, *a))
    for trial in range(12):
        k = rng.randint(1, 6)
        slots = rng.sample(range(7), k)  # in random order, rarely consecutive
        requests = []
        for slot in slots:
            n = rng.choice([1, 2, rng.randint(3, 12), rng.randint(13, 40)])  # n = 1: no context at all
            committed = [rng.randrange(64) for _ in range(n)]
            depth = rng.choice([0, 1, rng.randint(2, b), b + 3])
            _observe_in_chunks(batched, slot, _features(target, batched.target_layers, committed), rng)
            requests.append(DraftRequest(slot, committed, depth))
        if trial % 3 == 0:  # a request with nothing to draft always shares some batches
            i = rng.randrange(k)
            requests[i] = dataclasses.replace(requests[i], depth=0)
        calls.clear()
        got = batched.propose(requests)
        drafted = [q for q in requests if q.depth >= 1]
        assert calls == ([(len(drafted), b, target.args.hidden_size)] if drafted else [])  # one pass, or none
        assert len(got) == len(requests)
        for q, lat in zip(requests, got):
            if q.depth < 1:
                assert lat is None
                continue
            alone.reset(0)
            if len(q.committed) > 1:
                alone.observe(0, _features(target, alone.target_layers, q.committed), 0)
            want = propose_one(alone, q.committed, q.depth)
            assert isinstance(want, MarkovLattice if markov_rank else PositionalLattice)
            assert want.depth == min(q.depth, b)
            _assert_same_lattice(lat, want)
    assert batched.slot_k.shape[2] >= 39  # grown from 8 positions, every slot's context kept


def test_slots_are_checked_and_independent(tiny_models):
    target = tiny_models[0]
    net = _net(target, 0, seed=5)
    d = BlockDrafter(net, target, max_slots=3)
    assert isinstance(d, Drafter) and d.max_slots == 3 and BlockDrafter(net, target).max_slots == 1
    feats = _features(target, d.target_layers, [1, 2, 3, 4])
    for bad in (-1, 3):
        with pytest.raises(DrafterError, match=f"slot {bad}"):
            d.propose([DraftRequest(bad, [1, 2, 3, 4], 2)])
        with pytest.raises(DrafterError, match=f"slot {bad}"):
            d.observe(bad, feats, 0)
        with pytest.raises(DrafterError, match=f"slot {bad}"):
            d.reset(bad)
    d.observe(2, feats, 0)
    assert [d.context_length(s) for s in range(3)] == [0, 0, 3]
    with pytest.raises(DrafterError, match="twice"):
        d.propose([DraftRequest(2, [1, 2, 3, 4], 2), DraftRequest(2, [1, 2, 3, 4], 2)])
    with pytest.raises(RuntimeError, match="slot 0 holds 0 positions, expected 3"):
        d.propose([DraftRequest(2, [1, 2, 3, 4], 2), DraftRequest(0, [1, 2, 3, 4], 2)])
    assert d.propose([DraftRequest(0, [1, 2, 3, 4], 0), DraftRequest(2, [1, 2, 3, 4], 2)])[0] is None
    d.reset(2)
    assert d.context_length(2) == 0
