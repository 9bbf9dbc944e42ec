"""Helpers for the engine tests on hybrid (Gated DeltaNet) targets, qwen3_5 and qwen3_next alike: AR tokens, the
check that the cache equals a fresh prefill after every step, a verification-mode switch, a drafter wrapper that
drafts nothing on some steps, the scripted / n-gram spec == AR checks both model types run, and a tiny qwen3_5
target with one drafter of every kind (built once per test session)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import tempfile

import torch

from specpilot.config import SystemConfig
from specpilot.engine.engine import Engine
from specpilot.model.checkpoint import load_model
from specpilot.spec.block import BlockDrafter
from specpilot.spec.draft_model import DraftModelDrafter
from specpilot.spec.eagle3 import Eagle3Drafter
from specpilot.spec.ngram import NgramDrafter

from .blockutil import greedy_data, tiny_config, train_eagle3_tiny, train_tiny
from .conftest import random_prompts, save_tiny
from .test_engine import ScriptedDrafter
from .test_hybrid import tiny_hybrid

#: the drafter kinds :func:`make_drafter` builds; the target layers the feature-reading ones read (GDN, full
#: attention, the last GDN layer of the 4-layer tiny target); their candidates per position
KINDS = ("ngram", "draft_dense", "draft_hybrid", "block", "block_markov", "eagle3")
LAYERS = (0, 1, 3)
TOP_K = 4


def ar_tokens(target, prompt, n):
    """AR greedy output of ``n`` tokens (the oracle), computed once per target, prompt and length."""
    return list(_ar(target, tuple(prompt), n))


@functools.lru_cache(maxsize=None)
def _ar(target, prompt, n):
    return tuple(Engine(target, SystemConfig.ar(), None, eos_ids=[]).generate(list(prompt), n).tokens)


def state_matches_prefill(engine, committed):
    """The hybrid cache equals a fresh prefill of every committed token but the last (R9)."""
    n = len(committed) - 1
    c = engine.cache
    assert c.length == n
    fresh = engine.target.new_cache(n + 1)
    engine.target.forward(torch.tensor(committed[:-1]), torch.arange(n), fresh, 0)
    fresh.commit(n)
    torch.testing.assert_close(c.state, fresh.state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c.window, fresh.window, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c.k[:, :n], fresh.k[:, :n], atol=1e-5, rtol=1e-5)


@contextlib.contextmanager
def verify_mode(target, mode):
    """Run the block with ``target.verify = mode`` (``snapshot`` | ``replay``), ``snapshot`` again after."""
    target.verify = mode
    try:
        yield
    finally:
        target.verify = "snapshot"


class Skipping:
    """A drafter that proposes nothing on every ``every``-th step (R10) and is ``inner`` otherwise; the engine
    still hands it the target features of every step (``observe`` is the inner drafter's)."""

    def __init__(self, inner, every):
        self.inner, self.every, self.calls = inner, every, 0
        self.kind, self.target_layers, self.vocab_size = inner.kind, inner.target_layers, inner.vocab_size
        self.max_context, self.max_slots = inner.max_context, inner.max_slots

    def reset(self, slot=0):
        self.calls = 0
        self.inner.reset(slot)

    def observe(self, slot, features, start):
        self.inner.observe(slot, features, start)

    def propose(self, batch):
        self.calls += 1
        return [None] * len(batch) if self.calls % self.every == 0 else self.inner.propose(batch)


def near_copy(model, eps, seed=1):
    """A copy of ``model`` with every parameter moved by ``eps`` · N(0, 1): a draft model that agrees with it often
    but not always (partial acceptance at every depth)."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=g) * eps)
    return out


def tree_config(tree, depth, nodes=12, top_k=2, drafter="ngram"):
    return SystemConfig.stock(drafter, depth=depth) if tree == "chain" else \
        SystemConfig(drafter=drafter, tree=tree, nodes=nodes, depth=depth, top_k=top_k)


def check_scripted(target, vocab, mode, tree, script, every, n):
    """spec == AR with a scripted drafter (``right`` / ``wrong`` / ``both`` branches, nothing drafted every
    ``every``-th step), the cache checked after every step; asserts the acceptance the script implies."""
    prompt = random_prompts(1, vocab, seed=7)[0]
    ar = ar_tokens(target, prompt, n)
    with verify_mode(target, mode):
        eng = Engine(target, tree_config(tree, 5), ScriptedDrafter(len(prompt), ar, script, every=every), eos_ids=[])
        eng.step_hook = state_matches_prefill
        gen = eng.generate(prompt, n)
    assert gen.tokens == ar
    if script == "wrong":
        assert set(gen.accepted) == {1}
    else:
        assert max(gen.accepted) > 1
    if every > 1:
        assert 1 in gen.accepted


def check_ngram(target, vocab, mode, tree, n_prompts, n):
    """spec == AR with the n-gram drafter on prompts that repeat (partial acceptance from a real drafter), the cache
    checked after every step of the first request."""
    accepted = []
    with verify_mode(target, mode):
        for i, p in enumerate(random_prompts(n_prompts, vocab, seed=11)):
            prompt = (p[:8] * 3)[:24]
            ar = ar_tokens(target, prompt, n)
            cfg = tree_config(tree, 6, top_k=3)
            eng = Engine(target, cfg, NgramDrafter(cfg.ngram_max, cfg.ngram_min, max_matches=cfg.top_k), eos_ids=[])
            if i == 0:
                eng.step_hook = state_matches_prefill
            gen = eng.generate(prompt, n)
            assert gen.tokens == ar
            accepted += gen.accepted
    assert max(accepted) > 1 and 1 in accepted


@functools.lru_cache(maxsize=None)
def tiny_target():
    """The tiny qwen3_5 target (4 layers: 3 GDN + 1 attention, vocabulary 96, seed 4), float32, no gradients."""
    with tempfile.TemporaryDirectory() as d:
        tiny_hybrid(d, seed=4)
        return load_model(d, dtype="float32").requires_grad_(False)


@functools.lru_cache(maxsize=None)
def drafter_nets():
    """The networks of :func:`make_drafter` for :func:`tiny_target`: a dense 1-layer draft model (random), the target
    moved by 2e-3 noise as a hybrid draft model, and block / block_markov / eagle3 nets reading :data:`LAYERS`,
    trained briefly on the target's greedy outputs (untrained ones accept almost nothing, which would leave the deeper
    tree positions unexercised)."""
    target = tiny_target()
    v = target.args.vocab_size
    seqs = greedy_data(target, n=16, prompt_len=12, gen=40)
    cfg = dataclasses.replace(tiny_config(target), target_layers=list(LAYERS))
    with tempfile.TemporaryDirectory() as d:
        dense = load_model(save_tiny(d, vocab=v, hidden=32, layers=1, heads=2, kv_heads=1, seed=2))
    return {"draft_dense": dense, "draft_hybrid": near_copy(target, 2e-3),
            "block": train_tiny(target, cfg, steps=150, seqs=seqs)[0],
            "block_markov": train_tiny(target, dataclasses.replace(cfg, markov_rank=8), steps=150, seqs=seqs)[0],
            "eagle3": train_eagle3_tiny(target, LAYERS, seqs, 64, steps=120)[0]}


def make_drafter(kind, target, nets, top_k=TOP_K):
    """``(SystemConfig drafter name, a fresh drafter)`` of ``kind`` (:data:`KINDS`) with ``top_k`` candidates."""
    if kind == "ngram":
        return "ngram", NgramDrafter(4, 1, max_matches=top_k)
    if kind.startswith("draft_"):
        return "draft_model", DraftModelDrafter(nets[kind], top_k=top_k)
    if kind.startswith("block"):
        return "block", BlockDrafter(nets[kind], target, top_k=top_k)
    return "eagle3", Eagle3Drafter(nets[kind], target, top_k=top_k)


def requests(vocab):
    """``(prompt, new tokens)``: a random prompt (the trained drafters' kind) and one that repeats (the n-gram drafter
    and the dense draft model accept a token on it, once or twice)."""
    return [(random_prompts(1, vocab, length=12, seed=5)[0], 24), ((random_prompts(2, vocab, seed=11)[1][:8] * 3)[:24],
                                                                    40)]
