"""The Engine on a tiny qwen3_next target (GDN + gated attention, mixture-of-experts MLPs), CPU float32: AR equals
transformers' greedy generate; speculative decoding with the n-gram drafter (chain and best_first), with scripted
drafters (zero and partial acceptance, steps drafting nothing), with a qwen3_next draft model and with (untrained)
block and eagle3 drafters reading its features, every tree builder, equals AR token for token; after every step the
GDN state, conv window and K/V equal a fresh prefill of the committed tokens (R9, R10)."""

import dataclasses

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.engine.engine import Engine
from specpilot.model.checkpoint import load_model
from specpilot.model.moe import SparseMoE
from specpilot.spec.block import BlockDrafter, BlockNet
from specpilot.spec.draft_model import DraftModelDrafter
from specpilot.spec.eagle3 import Eagle3Drafter
from specpilot.spec.train_eagle3 import new_eagle3_net
from specpilot.spec.trees import BUILDERS

from .blockutil import tiny_config
from .conftest import random_prompts
from .hybridutil import (LAYERS, Skipping, ar_tokens, check_ngram, check_scripted, near_copy, state_matches_prefill,
                         verify_mode)
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


def run_checked(target, name, drafter, tree, n=24):
    """One request with ``drafter`` (nothing drafted every third step), the cache checked after every step; chains
    verified with state snapshots, trees with replayed commits. Returns the accepted counts."""
    prompt = random_prompts(1, V, length=12, seed=5)[0]
    cfg = SystemConfig(drafter=name, tree=tree, nodes=12, depth=5, top_k=4)
    with verify_mode(target, "snapshot" if tree == "chain" else "replay"):
        eng = Engine(target, cfg, Skipping(drafter, 3), eos_ids=[])
        eng.step_hook = state_matches_prefill
        gen = eng.generate(prompt, n)
    assert gen.tokens == ar_tokens(target, prompt, n)
    return gen.accepted


@pytest.mark.parametrize("tree", sorted(BUILDERS))
def test_qwen3_next_draft_model(pair, tree):
    """A qwen3_next draft model (the target moved by 2e-3 noise: routed experts in the drafter too) rolls its state
    back after each draft; it accepts partially."""
    target = pair[1]
    accepted = run_checked(target, "draft_model", DraftModelDrafter(near_copy(target, 2e-3), top_k=4), tree)
    assert 1 in accepted and max(accepted) > 2


@pytest.mark.parametrize("tree", sorted(BUILDERS))
def test_feature_drafters(pair, tree):
    """Block and eagle3 drafters (random weights) reading a GDN, the attention and the last layer of the MoE hybrid."""
    target = pair[1]
    torch.manual_seed(0)
    block = BlockNet(dataclasses.replace(tiny_config(target), target_layers=list(LAYERS))).eval()
    eagle3 = new_eagle3_net(target.args, LAYERS, torch.arange(64)).eval()
    run_checked(target, "block", BlockDrafter(block, target, top_k=4), tree)
    run_checked(target, "eagle3", Eagle3Drafter(eagle3, target, top_k=4), tree)
