"""The calibrated drafter (simulated acceptance, for random-weight targets) on a tiny hybrid (qwen3_5) target, CPU
float32: calibrated from a hybrid draft model's recording, with every cost drafter kind (none, n-gram, a random block
network reading the hybrid's features, a dense and a hybrid draft model built from their specs), chain and
best_first: spec == AR, the cache equals a fresh prefill after every step, and a request without a known continuation
stays AR."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from specpilot.config import SystemConfig
from specpilot.engine.engine import Engine
from specpilot.model.hybrid import HybridTransformer
from specpilot.pilot.replay import record
from specpilot.spec.calibrated import CalibratedDrafter
from specpilot.spec.calibration import calibrate
from specpilot.spec.cost_drafter import cost_drafter, cost_spec_of
from specpilot.spec.draft_model import DraftModelDrafter

from .conftest import random_prompts
from .hybridutil import ar_tokens, near_copy, state_matches_prefill, tiny_target, verify_mode
from .test_hybrid import TINY

V = TINY["vocab_size"]
DENSE = {"model_type": "qwen3", "vocab_size": V, "hidden_size": 32, "intermediate_size": 64, "num_layers": 1,
         "n_heads": 2, "n_kv_heads": 1, "head_dim": 16}
COSTS = {"none": None, "ngram": {"kind": "ngram"}, "block": {"kind": "block", "layers": 1, "block_size": 8},
         "draft_dense": {"kind": "draft_model", "args": DENSE}}


@pytest.fixture(scope="module")
def calibration():
    """A calibration of the hybrid draft model (the target moved by 2e-3 noise) along 4 AR outputs of 24 tokens;
    its cost spec is that hybrid draft model's."""
    target = tiny_target()
    drafter = DraftModelDrafter(near_copy(target, 2e-3), top_k=4)
    prompts = random_prompts(4, V, length=12, seed=21)
    rec = record(drafter, prompts, [ar_tokens(target, p, 24) for p in prompts], 5, 4)
    return calibrate(rec, cost=cost_spec_of(drafter), source={"drafter": "draft_model"})


@pytest.mark.parametrize("tree,mode", [("chain", "snapshot"), ("best_first", "replay")])
@pytest.mark.parametrize("cost", sorted(COSTS) + ["draft_hybrid"])
def test_spec_equals_ar(calibration, cost, tree, mode):
    target = tiny_target()
    cfg = SystemConfig(drafter="calibrated", drafter_path="-", tree=tree, nodes=5 if tree == "chain" else 12, depth=5,
                       top_k=1 if tree == "chain" else 4)
    made = cost_drafter(calibration.cost if cost == "draft_hybrid" else COSTS[cost], target, cfg.top_k, 1)
    if cost == "draft_hybrid":
        assert isinstance(made.model, HybridTransformer)
    d = CalibratedDrafter(calibration, V, top_k=cfg.top_k, cost=made, max_slots=1)
    prompts = random_prompts(3, V, length=10, seed=31)
    for p in prompts[:2]:  # the last prompt has no known continuation: no proposals, still AR
        d.expect(p, ar_tokens(target, p, 30))
    with verify_mode(target, mode):
        eng = Engine(target, cfg, d, eos_ids=[])
        eng.step_hook = state_matches_prefill
        gens = [eng.generate(p, 30) for p in prompts]
    assert [g.tokens for g in gens] == [ar_tokens(target, p, 30) for p in prompts]
    assert max(max(g.accepted) for g in gens[:2]) > 2 and gens[2].tau == 1.0
