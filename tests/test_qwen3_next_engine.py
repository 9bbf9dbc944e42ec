"""The Engine on a tiny qwen3_next target (GDN + gated attention, mixture-of-experts MLPs), CPU float32: AR equals
transformers' greedy generate; speculative decoding with the n-gram drafter (chain and best_first) and with scripted
drafters (zero and partial acceptance, steps drafting nothing) equals AR token for token; after every step the GDN
state, conv window and K/V equal a fresh prefill of the committed tokens (R9, R10)."""

import pytest
import torch

from specpilot.model.checkpoint import load_model
from specpilot.model.moe import SparseMoE

from .conftest import random_prompts
from .hybridutil import ar_tokens, check_ngram, check_scripted
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
    check_scripted(pair[1], V, mode, tree, script, every, 24)


@pytest.mark.parametrize("mode,tree", [("snapshot", "chain"), ("replay", "best_first")])
def test_ngram_spec_equals_ar(pair, mode, tree):
    """Partial acceptance from a real drafter: the n-gram drafter on prompts that repeat."""
    check_ngram(pair[1], V, mode, tree, 2, 32)
