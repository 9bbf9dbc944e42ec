"""Prompt admission (§4.4): prompts admitted while requests run are prefilled inside the step's exact pass; their
outputs equal those of prompts prefilled alone (AR greedy, float32 CPU), with and without the shared budget, n-gram
and block drafters; admission steps save their prefill pass; prompts over the cap get their own pass."""

from __future__ import annotations

import random

import pytest

from specpilot.config import SystemConfig
from specpilot.engine.batch import BatchEngine, Request

from .test_batch import ar, cache_matches_prefill, random_requests
from .test_shared_budget import drafter_for


@pytest.mark.parametrize("kind,selection,seed", [("ngram", "per_request", 0), ("ngram", "shared_budget", 1),
                                                 ("block", "shared_budget", 2), ("block", "per_request", 3)])
def test_admitted_prompts_equal_prompts_prefilled_alone(tiny_models, kind, selection, seed):
    target, _ = tiny_models
    rng = random.Random(seed)
    cfg = SystemConfig(drafter=kind, tree="best_first", nodes=4, depth=rng.choice([3, 5]), top_k=3,
                       row_selection=selection, prompt_admission=rng.choice([16, 40]))
    slots = rng.choice([2, 3])
    eng = BatchEngine(target, cfg, drafter_for(kind, target, cfg, slots), eos_ids=[], max_num_seqs=slots,
                      padded=False)
    eng.step_hook = cache_matches_prefill
    reqs = random_requests(rng, 9)
    for i, (p, n, stops) in enumerate(reqs):
        eng.add_request(Request(f"r{i}", p, n, stops))
    got = {f"r{i}": [] for i in range(len(reqs))}
    rides = alone = 0  # admission steps whose prompts rode in the decode pass / got their own prefill pass
    while eng.has_work():
        running, prefills = bool(eng._running), eng.prefill_passes
        outs = eng.step()
        first = [o for o in outs if not got[o.request_id]]  # a request's first output: its prefill's
        if running and first and eng.prefill_passes == prefills:
            rides += 1
        alone += eng.prefill_passes - prefills
        for o in outs:
            got[o.request_id] += o.new_tokens
    assert rides > 0 and eng.prefill_passes == alone
    for i, (p, n, stops) in enumerate(reqs):
        assert got[f"r{i}"] == ar(target, p, n, stops), (i, p, n, sorted(stops))
    assert eng.free_slots() == slots


def test_prompts_over_the_cap_get_their_own_pass(tiny_models):
    target, _ = tiny_models
    cfg = SystemConfig(drafter="ngram", tree="best_first", nodes=4, depth=3, top_k=2, prompt_admission=5)
    eng = BatchEngine(target, cfg, drafter_for("ngram", target, cfg, 2), eos_ids=[], max_num_seqs=2, padded=False)
    # r0 and r1 arrive with nothing running: one prefill pass; r0 ends at step 1, r2 (7 rows > 5) gets its own pass
    # at step 2 and ends there; r3 (4 rows) rides in step 3's pass beside r1 (at most 1 + 4 + 4 of its 12 tokens)
    prompts, budgets = [[1, 2, 3], [7, 8, 9], [4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14]], [2, 12, 2, 6]
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        eng.add_request(Request(f"r{i}", p, n))
    got = {f"r{i}": [] for i in range(4)}
    while eng.has_work():
        for o in eng.step():
            got[o.request_id] += o.new_tokens
    assert eng.prefill_passes == 2
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        assert got[f"r{i}"] == ar(target, p, n)
