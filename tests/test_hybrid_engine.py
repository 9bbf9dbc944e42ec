"""The Engine on a tiny hybrid (qwen3_5) target, CPU float32: AR equals transformers' greedy generate; chain
verification (per-row state snapshots) and tree verification (commit by replaying the accepted path) equal AR
with partial, zero and full acceptance and with steps where nothing is drafted; after every step the GDN state,
conv window and K/V equal a fresh prefill of the committed tokens (R9, R10)."""

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.engine.engine import Engine
from specpilot.model.checkpoint import load_model
from specpilot.spec.ngram import NgramDrafter

from .conftest import random_prompts
from .hybridutil import ar_tokens, check_ngram, check_scripted, state_matches_prefill, verify_mode
from .test_hybrid import TINY, tiny_hybrid

V = TINY["vocab_size"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid_engine")
    return tiny_hybrid(path, seed=4), load_model(path, dtype="float32")


@torch.no_grad()
def test_ar_equals_transformers_generate(pair):
    hf, target = pair
    for prompt in random_prompts(2, V, seed=5):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert ar_tokens(target, prompt, 20) == ref


@pytest.mark.parametrize("mode,tree,script,every", [
    ("snapshot", "chain", "right", 1),   # full acceptance
    ("snapshot", "chain", "wrong", 1),   # zero acceptance
    ("snapshot", "chain", "right", 2),   # every other step drafts nothing (R10)
    ("replay", "best_first", "both", 1),  # the accepted branch is never the first (replay of a non-contiguous path)
    ("replay", "best_first", "right", 3),
    ("replay", "ddtree_marginal", "both", 2),  # the other tree builders: a branch accepted off the first, R10
    ("replay", "eagle2_topk", "both", 2),
    ("replay", "sequoia", "both", 2),
    ("snapshot", "eagle2_topk", "both", 1),  # a tree verified with every row's state kept
])
def test_scripted_spec_equals_ar(pair, mode, tree, script, every):
    check_scripted(pair[1], V, mode, tree, script, every, 30)


@pytest.mark.parametrize("mode,tree", [("snapshot", "chain"), ("replay", "chain"), ("replay", "best_first")])
def test_ngram_spec_equals_ar(pair, mode, tree):
    """Partial acceptance from a real drafter: the n-gram drafter on prompts that repeat."""
    check_ngram(pair[1], V, mode, tree, 3, 40)


def test_long_prompt_chunked_prefill_then_tree_steps(pair):
    """A 130-token prompt (replay mode: the prefill runs the chunked form), then best_first steps: spec == AR and
    the state stays within float32 rounding of a fresh prefill."""
    _, target = pair
    prompt = (random_prompts(1, V, seed=13)[0] * 12)[:130]
    with verify_mode(target, "replay"):
        ar = ar_tokens(target, prompt, 16)
        cfg = SystemConfig(drafter="ngram", tree="best_first", nodes=12, depth=6, top_k=3)
        eng = Engine(target, cfg, NgramDrafter(cfg.ngram_max, cfg.ngram_min, max_matches=cfg.top_k), eos_ids=[])
        eng.step_hook = state_matches_prefill
        gen = eng.generate(prompt, 16)
    assert gen.tokens == ar
