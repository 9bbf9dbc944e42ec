"""Exact replay of the batched engine (§2.4, §4.4): step by step, the nodes and accepted tokens :func:`replay_batch`
computes from a recording equal the :class:`BatchEngine`'s own, per request and in total, for the shared budget
and the equal split, with and without prompt admission (n-gram drafter, float32 CPU)."""

from __future__ import annotations

import random

import pytest

from specpilot.config import SystemConfig
from specpilot.engine.batch import BatchEngine, Request
from specpilot.pilot.replay import record
from specpilot.pilot.replay_batch import batch_summary, replay_batch
from specpilot.spec.ngram import NgramDrafter

from .test_batch import ar


def engine_steps(target, cfg, prompts, budgets, slots, prefill_rows):
    """Per request, its decode steps' ``(nodes, accepted, kept)``, and the engine's decode passes."""
    eng = BatchEngine(target, cfg, NgramDrafter(cfg.ngram_max, cfg.ngram_min, max_matches=cfg.top_k, max_slots=slots),
                      eos_ids=[], max_num_seqs=slots, max_prefill_rows=prefill_rows, padded=False)
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        eng.add_request(Request(f"r{i}", p, n))
    seen: set[str] = set()
    per = {i: [] for i in range(len(prompts))}
    while eng.has_work():
        for o in eng.step():
            i = int(o.request_id[1:])
            if o.request_id in seen:  # the first output of a request is its prefill's
                per[i].append((o.drafted, o.accepted, len(o.new_tokens)))
            seen.add(o.request_id)
    return per, eng.exact_passes


@pytest.mark.parametrize("selection,seed,admit", [("shared_budget", 0, 0), ("shared_budget", 1, 0),
                                                  ("per_request", 2, 0), ("shared_budget", 3, 24)])
def test_replay_batch_equals_the_engine(tiny_models, selection, seed, admit):
    target, _ = tiny_models
    rng = random.Random(seed)
    prompts, budgets = [], []
    for _ in range(9):
        base = [rng.randrange(64) for _ in range(rng.randint(2, 6))]
        prompts.append((base * 4)[: rng.randint(3, 18)])
        budgets.append(rng.choice([1, 3, 9, 20, 30]))
    outs = [ar(target, p, n) for p, n in zip(prompts, budgets)]
    cfg = SystemConfig(drafter="ngram", tree="best_first", nodes=rng.choice([3, 5]), depth=4, top_k=3,
                       row_selection=selection, prompt_admission=admit)
    slots, prefill_rows = rng.choice([2, 3, 4]), rng.choice([8, 2048])
    rec = record(NgramDrafter(cfg.ngram_max, cfg.ngram_min, max_matches=cfg.top_k), prompts, outs, 4, 3)
    steps = replay_batch(rec, cfg, slots, prefill_rows)
    per, passes = engine_steps(target, cfg, prompts, budgets, slots, prefill_rows)
    assert len(steps) == passes
    got = {i: [] for i in range(len(prompts))}
    for s in steps:
        assert len(s.requests) <= slots
        if selection == "shared_budget":
            assert sum(s.nodes) <= cfg.step_budget(len(s.requests))
        for i, n, a, k in zip(s.requests, s.nodes, s.accepted, s.kept):
            got[i].append((n, a, k))
    assert got == per
    summary = batch_summary(steps)
    assert summary["steps"] == passes and summary["accepted_per_step"] > 0
