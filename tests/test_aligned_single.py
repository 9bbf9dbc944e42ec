"""Aligned single-request passes (``KernelConfig.aligned``): the single-request engine on the batched engine's
kernels, so a tree's top chain carries the one-row AR pass's bits.

CPU: the Triton interpreter in float32 (the claim is bitwise, so float32 checks the arithmetic order as well as bf16
would). CUDA: bf16 on a random-weight target, where one bit of difference parts the outputs within a few tokens.
"""

from __future__ import annotations

import random

import pytest
import torch

from .tritonutil import CUDA, DEV, triton  # noqa: F401

from specpilot.config import SystemConfig
from specpilot.model.transformer import KernelConfig


def _prefilled(model, prompt, max_len=64):
    cache = model.new_cache(max_len)
    model(torch.tensor(prompt, device=DEV), torch.arange(len(prompt), device=DEV), cache, 0)  # eager prefill
    return cache


def test_top_chain_rows_carry_the_ar_pass_bits(tiny_dirs):
    """A tree pass whose top chain comes first gives, on each chain row, bit for bit the hidden state, K/V and argmax
    the one-row AR pass at that position gives; the off-chain rows are only close."""
    from specpilot.model.checkpoint import load_model

    from .test_tree_attention import tree_mask_from_parents

    model = load_model(tiny_dirs[0]).to(DEV)
    model.kernels = KernelConfig(fused=True, aligned=True)
    prompt = random.Random(4).choices(range(64), k=61)  # the chain straddles the 64-key block edge
    chain = [5, 17, 9, 40, 2]
    ar_cache = _prefilled(model, prompt, 80)
    ar_hidden = []
    one = torch.ones(1, 1, dtype=torch.bool, device=DEV)
    for j, tok in enumerate(chain):  # AR: one row at a time, each row's K/V at its position
        start = len(prompt) + j
        h = model.forward_static(torch.tensor([tok], device=DEV), torch.tensor([start], device=DEV), ar_cache,
                                 torch.tensor(start, device=DEV), one)
        ar_hidden.append(h[0])
    parents = [-1, 0, 1, 2, 3, 0, 1, 5]  # rows 0-4 the chain, then a sibling branch
    tokens = chain + [33, 34, 35]
    depths = [0, 1, 2, 3, 4, 1, 2, 2]
    start = len(prompt)
    tree_cache = _prefilled(model, prompt, 80)
    h = model.forward_static(torch.tensor(tokens, device=DEV), torch.tensor([start + d for d in depths], device=DEV),
                             tree_cache, torch.tensor(start, device=DEV), tree_mask_from_parents(parents).to(DEV))
    for j in range(len(chain)):
        assert torch.equal(h[j], ar_hidden[j]), j
    end = start + len(chain)
    assert torch.equal(tree_cache.k[:, :end], ar_cache.k[:, :end])
    assert torch.equal(tree_cache.v[:, :end], ar_cache.v[:, :end])
    assert torch.equal(model.greedy(h[: len(chain)]), model.greedy(torch.stack(ar_hidden)))


@pytest.mark.parametrize("cfg", [SystemConfig(drafter="ngram", tree="best_first", nodes=6, depth=4, top_k=2),
                                 SystemConfig(drafter="ngram", tree="chain", nodes=4, depth=4, tlv=True)],
                         ids=["best_first", "tlv_chain"])
def test_aligned_engine_equals_ar(tiny_dirs, cfg, monkeypatch):
    """Speculative decoding through aligned passes (batched attention, batch-invariant GEMMs) gives AR's tokens,
    TLV's Q pass included; the aligned kernels are the ones that ran."""
    from specpilot.engine.deployment import Deployment
    from specpilot.model import fused as fused_path

    from .conftest import random_prompts

    calls = []
    real = fused_path.invariant_linear
    monkeypatch.setattr(fused_path, "invariant_linear", lambda *a: calls.append(1) or real(*a))
    dep = Deployment(tiny_dirs[0], None, device=DEV, aligned=True, pack=False)
    dep.target.kernels = KernelConfig(fused=True, aligned=True)
    prompts = [(p * 3)[:14] for p in random_prompts(2, 64, length=6, seed=5)]  # repeats: n-gram proposals
    ar = dep.system(SystemConfig.ar(), eos_ids=[], buckets=True)  # row buckets: the static path on the CPU too
    spec = dep.system(cfg, eos_ids=[], buckets=True)
    for p in prompts:
        assert spec.generate(p, 10).tokens == ar.generate(p, 10).tokens
    assert calls, "the aligned path never ran"


def test_deployment_sets_the_aligned_kernels(tiny_dirs):
    """``Deployment(aligned=True)`` is the target's ``KernelConfig.aligned`` (off by default)."""
    from specpilot.engine.deployment import Deployment

    assert Deployment(tiny_dirs[0], None, aligned=True).target.kernels.aligned
    assert not Deployment(tiny_dirs[0], None).target.kernels.aligned


def test_pilot_refuses_aligned_with_batch_or_off_cuda(monkeypatch, capsys, tmp_path):
    """``pilot --aligned`` with ``--batch`` (whose passes are aligned already) or on a CPU device (no fused path): one
    line, exit 2, before anything loads."""
    from .conftest import run_cli

    code, out, err = run_cli(monkeypatch, capsys, "pilot", "--aligned", "--batch", "1", "--out", str(tmp_path / "r"))
    assert code == 2 and "--batch" in err and len(err.strip().splitlines()) == 1, err
    code, out, err = run_cli(monkeypatch, capsys, "pilot", "--aligned", "--out", str(tmp_path / "r"))
    assert code == 2 and "CUDA" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.skipif(not CUDA, reason="bf16 near ties need a GPU")
@pytest.mark.parametrize("tree", ["chain", "best_first"])
def test_bf16_single_request_speculation_reproduces_ar_when_aligned(tmp_path, tree):
    """On a random-weight bf16 target (near ties everywhere) the aligned single-request engine's n-gram chain equals
    AR token for token: its accepted rows carry AR's bits. A best-first tree's rows off its top chain see their
    ancestors at other lanes, so its first difference is printed, not asserted."""
    from specpilot.engine.deployment import Deployment

    from .conftest import save_tiny

    target = save_tiny(tmp_path / "t", vocab=2048, hidden=256, layers=4, heads=4, kv_heads=2, seed=7)
    dep = Deployment(target, None, dtype="bfloat16", device="cuda", aligned=True)
    cfg = SystemConfig(drafter="ngram", tree=tree, nodes=6, depth=6 if tree == "chain" else 4,
                       top_k=1 if tree == "chain" else 2)
    rng = random.Random(9)
    prompts = [([rng.randrange(1, 2048) for _ in range(rng.randint(3, 9))] * 6)[: rng.randint(5, 60)]
               for _ in range(6)]
    ar, spec = dep.system(SystemConfig.ar(), eos_ids=[]), dep.system(cfg, eos_ids=[])
    outs = [(ar.generate(p, 96).tokens, spec.generate(p, 96).tokens) for p in prompts]
    if tree == "chain":
        assert all(a == s for a, s in outs)
    else:
        print("first difference per prompt (tree):",
              [next((i for i, (x, y) in enumerate(zip(a, s)) if x != y), None) for a, s in outs])
