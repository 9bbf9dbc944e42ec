"""The per-request drafter block (§4.4): the depth rule and its inputs against hand-worked cases, the config switch,
and the batched engine with it: spec == AR in float32 for batches of random makeup (n-gram, a tiny draft model, a
tiny trained block drafter; with and without the shared budget), depths that differ across requests and steps, and
the exact replay equal to the engine step by step, depths included."""

from __future__ import annotations

import random

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.engine.batch import BatchEngine, Request
from specpilot.pilot.replay import record
from specpilot.pilot.replay_batch import batch_summary, replay_batch
from specpilot.spec.drafter_block import DECAY, BlockHistory, confident_positions, pick_block
from specpilot.spec.lattice import PositionalLattice, TrieLattice
from specpilot.spec.ngram import NgramDrafter

from .test_batch import V, ar, cache_matches_prefill, drafter_of
from .test_shared_budget import drafter_for


def chain_lattice(probs: list[float], k: int = 2) -> PositionalLattice:
    """Top-1 probability ``probs[d]`` at position ``d``; the rest spread over ``k - 1`` other tokens."""
    toks = torch.arange(len(probs) * k).view(len(probs), k)
    lp = torch.tensor([[p] + [(1 - p) / (k - 1)] * (k - 1) for p in probs]).log()
    return PositionalLattice(toks, lp)


def test_confident_positions():
    # cumulative top-1: 0.9, 0.72, 0.504, 0.252, 0.126 -> 4 positions at >= 0.25, 3 at >= 0.5
    lat = chain_lattice([0.9, 0.8, 0.7, 0.5, 0.5])
    assert confident_positions(lat, 0.25) == 4 and confident_positions(lat, 0.5) == 3
    assert confident_positions(lat, 1.0) == 0 and confident_positions(chain_lattice([1.0] * 3), 1.0) == 3
    assert confident_positions(None) == 0
    # a trie: the top-1 path follows the most frequent continuation; it ends where the continuations end
    trie = TrieLattice([[1, 2, 3], [1, 2, 4], [1, 5]], depth=6)  # p: 1, 2/3, 1/2 -> cumulative 1, .667, .333
    assert confident_positions(trie, 0.5) == 2 and confident_positions(trie, 0.3) == 3
    for bad in (0.0, -1.0, 1.5):
        with pytest.raises(ValueError, match="threshold"):
            confident_positions(lat, bad)


def test_pick_block():
    allowed = (16, 12, 8)
    assert pick_block(allowed, None, 0, 0) == 8 and pick_block(allowed, None, 16, 16) == 8  # no history: smallest
    assert pick_block(allowed, 1.0, 3, 8) == 8  # want max(2, 3) = 3
    assert pick_block(allowed, 5.0, 3, 8) == 12  # want 10 (acceptance asks)
    assert pick_block(allowed, 0.5, 10, 16) == 12  # want 10 (confidence asks)
    assert pick_block(allowed, 0.5, 8, 8) == 12  # confident to the end of an 8-block: want 9
    assert pick_block(allowed, 0.5, 12, 12) == 16  # ... of a 12-block: want 13
    assert pick_block(allowed, 7.0, 0, 8) == 16 and pick_block(allowed, 30.0, 0, 16) == 16  # past the largest
    assert pick_block(allowed, 4.0, 0, 8) == 8 and pick_block(allowed, 4.01, 0, 8) == 12  # 2 x 4 = 8 fits 8
    assert pick_block((3, 1, 2), 0.0, 0, 3) == 1  # any order
    for bad in ((), (0, 4)):
        with pytest.raises(ValueError, match="allowed drafter blocks"):
            pick_block(bad, 1.0, 0, 0)


def test_history():
    h = BlockHistory()
    assert h.pick((16, 12, 8)) == 8
    h.drafted(chain_lattice([0.9, 0.9, 0.1]), 16)
    assert (h.confident, h.last_depth) == (2, 16)
    h.accepted(6)
    assert h.accept_ema == 6.0 and h.pick((16, 12, 8)) == 12  # want max(12, 2)
    h.accepted(0)
    assert h.accept_ema == pytest.approx(DECAY * 0 + (1 - DECAY) * 6.0) and h.pick((16, 12, 8)) == 8
    h.drafted(None, 8)
    assert h.confident == 0


def test_config_switch():
    c = SystemConfig(drafter="block", tree="best_first", nodes=16, depth=16, top_k=4, drafter_block=(16, 12, 8))
    off = c.model_copy(update={"drafter_block": ()})
    assert c.seal() != off.seal() and "drafter_block" not in json_keys(off)
    assert SystemConfig().seal() == SystemConfig(drafter_block=()).seal()
    assert c.label().endswith("+block16/12/8") and "+block" not in off.label()
    cases = [({"drafter_block": (16, 20)}, "1..depth"), ({"drafter_block": (0,)}, "1..depth"),
             ({"drafter_block": (8, 8)}, "distinct"), ({"drafter": "none"}, "no drafter")]
    for bad, msg in cases:
        with pytest.raises(ValueError, match=msg):
            SystemConfig(**{**c.model_dump(), **bad})


def json_keys(cfg: SystemConfig) -> set[str]:
    """Fields that enter ``cfg``'s seal (those of :data:`_LATER_FIELDS` only when set)."""
    from specpilot.config import _LATER_FIELDS

    return {k for k, v in cfg.model_dump().items() if not (k in _LATER_FIELDS and v == _LATER_FIELDS[k])}


def requests(rng: random.Random, n: int) -> list[tuple[list[int], int, frozenset]]:
    """Prompts of random length, most with repeats (n-gram matches), budgets up to 40, some stop ids."""
    out = []
    for _ in range(n):
        base = [rng.randrange(V) for _ in range(rng.randint(2, 7))]
        prompt = (base * rng.randint(1, 4))[: rng.randint(2, 24)]
        out.append((prompt, rng.choice([1, 4, 17, 30, 40]), frozenset(rng.sample(range(V), rng.choice([0, 0, 1])))))
    return out


def run(eng: BatchEngine, reqs, deepest: int) -> tuple[dict, dict]:
    """Every request through ``eng``: outputs, and per request the (exact pass, asked depth) of its decode steps
    whose depth was the rule's pick, not cut at the request's last tokens (at least ``deepest`` + 1 tokens left)."""
    budgets = {}
    for i, (p, n, stops) in enumerate(reqs):
        eng.add_request(Request(f"r{i}", p, n, stops))
        budgets[f"r{i}"] = n
    got = {f"r{i}": [] for i in range(len(reqs))}
    depths = {f"r{i}": [] for i in range(len(reqs))}
    while eng.has_work():
        passes = eng.exact_passes
        for o in eng.step():
            room = budgets[o.request_id] - len(got[o.request_id])
            if got[o.request_id] and room > deepest:  # a request's first output is its prefill's (asks nothing)
                depths[o.request_id].append((passes, o.draft_depth))
            got[o.request_id] += o.new_tokens
    return got, depths


@pytest.mark.parametrize("kind,selection,seed", [("ngram", "per_request", 0), ("ngram", "shared_budget", 1),
                                                 ("draft_model", "per_request", 2), ("block", "per_request", 3),
                                                 ("block", "shared_budget", 4)])
def test_drafter_block_batch_equals_ar(tiny_models, kind, selection, seed):
    target, _ = tiny_models
    rng = random.Random(seed)
    tree = "chain" if kind == "draft_model" else "best_first"
    cfg = SystemConfig(drafter=kind, tree=tree, nodes=6, depth=6, top_k=1 if tree == "chain" else 3,
                       row_selection=selection, drafter_block=(6, 4, 2), prompt_admission=rng.choice([0, 24]))
    slots = rng.choice([3, 4])
    # the draft model is the target itself (the tiny random draft model accepts almost nothing, so its requests
    # would keep the smallest depth): lossless whatever drafts, and acceptance moves the depths here
    drafter = drafter_of(kind, target, target, slots, cfg) if kind == "draft_model" else \
        drafter_for(kind, target, cfg, slots)
    eng = BatchEngine(target, cfg, drafter, eos_ids=[], max_num_seqs=slots, padded=False)
    eng.step_hook = cache_matches_prefill
    reqs = requests(rng, 9)
    got, depths = run(eng, reqs, 6)
    for i, (p, n, stops) in enumerate(reqs):
        assert got[f"r{i}"] == ar(target, p, n, stops), (i, p, n, sorted(stops))
    assert eng.free_slots() == slots
    # the rule's picks (steps not cut at a request's end): allowed depths only, varying per request and per step
    asked = [d for ds in depths.values() for _, d in ds]
    assert set(asked) <= {2, 4, 6} and len(set(asked)) >= 2, sorted(set(asked))
    by_step: dict[int, set[int]] = {}
    for ds in depths.values():
        for s, d in ds:
            by_step.setdefault(s, set()).add(d)
    assert any(len(v) > 1 for v in by_step.values()), "no step drafted different depths for its requests"
    assert any(len({d for _, d in ds}) > 1 for ds in depths.values()), "no request changed its depth across steps"


@pytest.mark.parametrize("selection,seed", [("per_request", 5), ("shared_budget", 6)])
def test_replay_with_drafter_block_equals_the_engine(tiny_models, selection, seed):
    """The replay's nodes, accepted, kept tokens and asked depths equal the engine's, per request and step."""
    target, _ = tiny_models
    rng = random.Random(seed)
    reqs = [(p, n, frozenset()) for p, n, _ in requests(rng, 8)]
    outs = [ar(target, p, n) for p, n, _ in reqs]
    cfg = SystemConfig(drafter="ngram", tree="best_first", nodes=5, depth=6, top_k=3, row_selection=selection,
                       drafter_block=(6, 3, 1))
    slots = 3
    rec = record(NgramDrafter(cfg.ngram_max, cfg.ngram_min, max_matches=cfg.top_k), [p for p, _, _ in reqs], outs,
                 6, 3)
    steps = replay_batch(rec, cfg, slots)
    eng = BatchEngine(target, cfg, NgramDrafter(cfg.ngram_max, cfg.ngram_min, max_matches=cfg.top_k, max_slots=slots),
                      eos_ids=[], max_num_seqs=slots, padded=False)
    for i, (p, n, _) in enumerate(reqs):
        eng.add_request(Request(f"r{i}", p, n))
    per: dict[int, list] = {i: [] for i in range(len(reqs))}
    seen: set[str] = set()
    while eng.has_work():
        for o in eng.step():
            if o.request_id in seen:
                per[int(o.request_id[1:])].append((o.drafted, o.accepted, len(o.new_tokens), o.draft_depth))
            seen.add(o.request_id)
    got: dict[int, list] = {i: [] for i in range(len(reqs))}
    for s in steps:
        for i, n, a, k, d in zip(s.requests, s.nodes, s.accepted, s.kept, s.depths):
            got[i].append((n, a, k, d))
    assert got == per and len(steps) == eng.exact_passes
    assert len({d for s in steps for d in s.depths if d in (6, 3, 1)}) > 1
    rows = batch_summary(steps)["draft_rows_per_step"]
    assert rows == pytest.approx(sum(d for ds in per.values() for *_, d in ds) / eng.exact_passes)
