"""The Engine on a tiny qwen3_next target (GDN + gated attention, mixture-of-experts MLPs), CPU float32: AR equals
transformers' greedy generate; speculative decoding with the n-gram drafter (chain and best_first) and with scripted
drafters (zero and partial acceptance, steps drafting nothing) equals AR token for token; after every step the GDN
state, conv window and K/V equal a fresh prefill of the committed tokens (R9, R10)."""

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.engine.engine import Engine
from specpilot.model.checkpoint import load_model
from specpilot.model.moe import SparseMoE
from specpilot.spec.ngram import NgramDrafter

from .conftest import random_prompts
from .test_engine import ScriptedDrafter
from .test_hybrid_engine import ar_tokens, state_matches_prefill
from .test_qwen3_next import TINY_NEXT, tiny_next

V = TINY_NEXT["vocab_size"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next_engine")
    hf = tiny_next(path, seed=4)
    target = load_model(path, dtype="float32")
    assert any(isinstance(layer.mlp, SparseMoE) for layer in target.model.layers)
    return hf, target


@torch.no_grad()
def test_ar_equals_transformers_generate(pair):
    hf, target = pair
    for prompt in random_prompts(2, V, seed=5):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert ar_tokens(target, prompt, 16) == ref


@pytest.mark.parametrize("mode,tree,script,every", [
    ("snapshot", "chain", "wrong", 1),   # zero acceptance
    ("snapshot", "chain", "right", 2),   # full acceptance, every other step drafts nothing (R10)
    ("replay", "best_first", "both", 1),  # partial: the accepted branch is never the first
])
def test_scripted_spec_equals_ar(pair, mode, tree, script, every):
    _, target = pair
    prompt = random_prompts(1, V, seed=7)[0]
    ar = ar_tokens(target, prompt, 24)
    target.verify = mode
    try:
        cfg = SystemConfig.stock("ngram", depth=5) if tree == "chain" else \
            SystemConfig(drafter="ngram", tree="best_first", nodes=12, depth=5, top_k=2)
        eng = Engine(target, cfg, ScriptedDrafter(len(prompt), ar, script, every=every), eos_ids=[])
        eng.step_hook = state_matches_prefill
        gen = eng.generate(prompt, 24)
    finally:
        target.verify = "snapshot"
    assert gen.tokens == ar
    if script == "wrong":
        assert set(gen.accepted) == {1}
    else:
        assert max(gen.accepted) > 1
    if every > 1:
        assert 1 in gen.accepted


@pytest.mark.parametrize("mode,tree", [("snapshot", "chain"), ("replay", "best_first")])
def test_ngram_spec_equals_ar(pair, mode, tree):
    """Partial acceptance from a real drafter: the n-gram drafter on prompts that repeat."""
    _, target = pair
    target.verify = mode
    accepted = []
    try:
        for i, p in enumerate(random_prompts(2, V, seed=11)):
            prompt = (p[:8] * 3)[:24]
            ar = ar_tokens(target, prompt, 32)
            cfg = SystemConfig.stock("ngram", depth=6) if tree == "chain" else \
                SystemConfig(drafter="ngram", tree="best_first", nodes=12, depth=6, top_k=3)
            eng = Engine(target, cfg, NgramDrafter(cfg.ngram_max, cfg.ngram_min, max_matches=cfg.top_k), eos_ids=[])
            if i == 0:
                eng.step_hook = state_matches_prefill
            gen = eng.generate(prompt, 32)
            assert gen.tokens == ar
            accepted += gen.accepted
    finally:
        target.verify = "snapshot"
    assert max(accepted) > 1 and 1 in accepted
