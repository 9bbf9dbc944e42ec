"""Prompt prefixes reused across a batch's requests (specpilot/engine/prefix.py): outputs stay AR greedy's in float32,
every slot stays a fresh prefill of its committed tokens, identical prompts arriving together are prefilled once, a
finished request's slot serves the next prompt that shares its prefix, and targets or drafters that cannot reuse a
prefix (hybrid, feature-reading drafters) get none."""

from __future__ import annotations

import random

import pytest

from specpilot.config import SystemConfig
from specpilot.engine.batch import BatchEngine, Request
from specpilot.engine.prefix import MIN_TOKENS, PrefixCache, shared_prefix
from specpilot.spec.ngram import NgramDrafter

from .test_batch import V, ar, cache_matches_prefill, drafter_of


def shared_requests(rng: random.Random, n: int) -> list[tuple[list[int], int]]:
    """Prompts built on three shared heads (a system prompt's role) of 16-40 tokens, some prompts identical."""
    heads = [[rng.randrange(V) for _ in range(rng.randint(MIN_TOKENS, 40))] for _ in range(3)]
    out = []
    for _ in range(n):
        if out and rng.random() < 0.3:
            out.append((list(rng.choice(out)[0]), rng.choice([1, 3, 9])))  # an identical prompt
            continue
        tail = [rng.randrange(V) for _ in range(rng.randint(0, 12))]
        out.append((rng.choice(heads) + tail, rng.choice([1, 2, 5, 13])))
    return out


def test_shared_prefix_and_the_cache_rules():
    assert shared_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and shared_prefix([], [1]) == 0 and shared_prefix([7], [7]) == 1
    with pytest.raises(ValueError):
        PrefixCache(None, min_tokens=0)


@pytest.mark.parametrize("kind,tree,seed", [("none", "chain", 0), ("none", "chain", 1), ("ngram", "best_first", 2),
                                            ("draft_model", "chain", 3)])
def test_prefix_reuse_keeps_outputs_ar_and_caches_exact(tiny_models, kind, tree, seed):
    """Requests join over time (a few up front, one more per step), more than the slots hold; every output equals AR
    greedy and after every step every slot equals a fresh prefill of its committed tokens (copied prefixes
    included); prefixes were reused, from running requests and from freed slots."""
    target, small = tiny_models
    rng = random.Random(seed)
    cfg = SystemConfig.ar() if kind == "none" else SystemConfig(drafter=kind, tree=tree, nodes=4, depth=3,
                                                                  top_k=1 if tree == "chain" else 2)
    slots = 3
    eng = BatchEngine(target, cfg, drafter_of(kind, target, small, slots, cfg), eos_ids=[], max_num_seqs=slots)
    assert eng.prefix is not None
    eng.step_hook = cache_matches_prefill
    copies = []
    real = eng.pool.copy_prefix
    eng.pool.copy_prefix = lambda s, d, n: copies.append((s, d, n)) or real(s, d, n)
    reqs = shared_requests(rng, 10)
    got = {f"r{i}": [] for i in range(len(reqs))}
    pending = [Request(f"r{i}", p, n) for i, (p, n) in enumerate(reqs)]
    for q in pending[:3]:
        eng.add_request(q)
    pending = pending[3:]
    while eng.has_work() or pending:
        if pending:
            eng.add_request(pending.pop(0))
        for o in eng.step():
            got[o.request_id] += o.new_tokens
    for i, (p, n) in enumerate(reqs):
        assert got[f"r{i}"] == ar(target, p, n), i
    assert eng.prefix.hits >= 3 and eng.prefix.reused_tokens >= 3 * MIN_TOKENS
    assert copies and all(s != d and n >= MIN_TOKENS for s, d, n in copies)
    assert eng.free_slots() == slots


def test_identical_prompts_arriving_together_are_prefilled_once(tiny_models):
    """Four copies of one prompt queued at once: the first is prefilled whole (then decodes its first step), the
    other three wait one step and then prefill only their last token; outputs equal AR's."""
    target, _ = tiny_models
    prompt = [(5 * i + 3) % V for i in range(30)]
    eng = BatchEngine(target, SystemConfig.ar(), None, eos_ids=[], max_num_seqs=4)
    rows = []
    real = target.forward_batch
    target.forward_batch = lambda tokens, *a, **k: rows.append(len(tokens)) or real(tokens, *a, **k)
    try:
        outs = eng.generate_all([prompt] * 4, 6)
    finally:
        del target.forward_batch
    want = ar(target, prompt, 6)
    assert all(g.tokens == want for g in outs)
    assert eng.prefill_passes == 2 and rows[:4] == [30, 1, 3, 4]  # prefill, decode, 3 x 1 prefill row, decode
    assert eng.prefix.hits == 3 and eng.prefix.reused_tokens == 3 * 29


def test_freed_slots_keep_their_prompts_for_the_next_requests(tiny_models):
    """One request after another: a prompt that differs takes an empty slot (its shared head copied), so the first
    request's slot still holds its prompt when that prompt comes again, and it is taken without a copy."""
    target, _ = tiny_models
    head = [(7 * i + 1) % V for i in range(24)]
    eng = BatchEngine(target, SystemConfig.ar(), None, eos_ids=[], max_num_seqs=2)
    copies = []
    real = eng.pool.copy_prefix
    eng.pool.copy_prefix = lambda s, d, n: copies.append((s, d, n)) or real(s, d, n)
    a, b = head + [1, 2], head + [3]
    outs = [eng.generate_all([p], n)[0].tokens for p, n in [(a, 4), (b, 5), (a, 4)]]
    assert outs == [ar(target, a, 4), ar(target, b, 5), ar(target, a, 4)]
    assert copies == [(0, 1, 24)]  # b's head from a's slot; a again in its own slot
    assert eng.prefix.hits == 2 and eng.prefix.reused_tokens == 24 + 25
    assert sorted(eng.prefix.kept) == [0, 1]


def test_pick_keeps_prefixes_resident_and_evicts_the_least_recent():
    class Pool:
        def copy_prefix(self, s, d, n):
            pass

    pc = PrefixCache(Pool(), min_tokens=4)
    p, q, r = list(range(10)), list(range(100, 110)), list(range(200, 210))
    assert pc.pick(p, [3, 1, 0]) == 0  # nothing kept: the lowest
    pc.release(0, p + [7, 8])
    pc.release(1, q)
    assert pc.pick(p, [2, 1, 0]) == 0 and pc.pick(q + [5], [2, 1, 0]) == 1  # its own prompt, a later turn
    assert pc.pick(p[:6] + [99], [2, 1, 0]) == 2  # shares a head only: an empty slot, the head copied there
    assert pc.pick(r, [1, 0]) == 0  # no empty slot: the least recently released
    pc.reuse(2, p[:6] + [99], [])  # reads slot 0 (copy): slot 1 is now the least recent
    assert pc.pick(r, [1, 0]) == 1
    with pytest.raises(ValueError):
        pc.pick(r, [])


def test_no_prefix_reuse_where_it_cannot_hold(tiny_models):
    """Off on request; off by default where the decode passes are batch-invariant (the padded runner with the
    target's batch-invariant kernels: a reused prefix would change a request's later bits), on when asked there;
    and not for a drafter that reads the target's features of every prompt row."""
    target, small = tiny_models
    assert BatchEngine(target, SystemConfig.ar(), None, max_num_seqs=2, prefix_caching=False).prefix is None
    assert target.kernels.batch_invariant
    assert BatchEngine(target, SystemConfig.ar(), None, max_num_seqs=2, padded=True).prefix is None
    assert BatchEngine(target, SystemConfig.ar(), None, max_num_seqs=2, padded=True, prefix_caching=True).prefix
    cfg = SystemConfig(drafter="block", tree="chain", nodes=3, depth=3, top_k=1)
    assert BatchEngine(target, cfg, drafter_of("block", target, small, 2, cfg), max_num_seqs=2).prefix is None
    cfg = SystemConfig(drafter="ngram", tree="chain", nodes=3, depth=3, top_k=1)
    assert BatchEngine(target, cfg, NgramDrafter(max_slots=2), max_num_seqs=2).prefix is not None


def test_reuse_never_covers_the_last_prompt_token():
    class Pool:
        def __init__(self):
            self.copied = []

        def copy_prefix(self, s, d, n):
            self.copied.append((s, d, n))

    pool = Pool()
    pc = PrefixCache(pool, min_tokens=4)
    prompt = list(range(10))
    assert pc.reuse(1, prompt, [(0, prompt + [99])]) == 9 and pool.copied == [(0, 1, 9)]
    assert pc.reuse(2, [50] + prompt, [(0, prompt)]) == 0  # nothing shared
    pc.release(3, prompt[:6])
    assert pc.reuse(3, prompt, []) == 6 and pool.copied[-1] == (0, 1, 9)  # its own kept slot: no copy
    assert 3 not in pc.kept and pc.waits(prompt, [prompt], []) and not pc.waits(prompt, [[1]], [])
    assert pc.queried_tokens == 10 + 11 + 10 and pc.reused_tokens == 9 + 6 and pc.hits == 2


def test_copies_of_resident_prompts_arriving_together_all_reuse(tiny_models):
    """Two prompts left resident by a first round; then each arrives three times at once: the first copy takes its
    own slot without a copy, the other two copy its prefix in the same pass (no prompt prefilled whole)."""
    target, _ = tiny_models
    a, b = [(5 * i + 3) % V for i in range(30)], [(3 * i + 7) % V for i in range(25)]
    eng = BatchEngine(target, SystemConfig.ar(), None, eos_ids=[], max_num_seqs=6)
    assert [g.tokens for g in eng.generate_all([a, b], 4)] == [ar(target, a, 4), ar(target, b, 4)]
    hits, reused = eng.prefix.hits, eng.prefix.reused_tokens
    rows = []
    real = target.forward_batch
    target.forward_batch = lambda tokens, *x, **k: rows.append(len(tokens)) or real(tokens, *x, **k)
    try:
        outs = eng.generate_all([a, b, a, b, a, b], 5)
    finally:
        del target.forward_batch
    assert [g.tokens for g in outs] == [ar(target, p, 5) for p in [a, b] * 3]
    assert eng.prefix.hits - hits == 6 and eng.prefix.reused_tokens - reused == 3 * 29 + 3 * 24
    assert rows[0] == 6 and eng.prefill_passes == 2  # one prefill pass of the six last prompt tokens
