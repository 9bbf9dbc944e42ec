"""Fused elementwise kernels (specpilot.kernels.fused) against their PyTorch references, fresh random inputs.

CPU: Triton interpreter, float32 (numpy has no bf16). CUDA: compiled, float32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

from .tritonutil import CUDA, DEV, triton  # noqa: F401

from specpilot.kernels import fused
from specpilot.model.transformer import KernelConfig

DTYPES = [torch.float32] + ([torch.bfloat16] if CUDA else [])


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d,with_delta", [(1, 64, True), (3, 96, True), (5, 128, False)])
def test_add_rmsnorm_matches_reference(dtype, rows, d, with_delta):
    g = torch.Generator().manual_seed(rows * d)
    x = (torch.randn(rows, d, generator=g) * 3).to(DEV, dtype)
    delta = torch.randn(rows, d, generator=g).to(DEV, dtype) if with_delta else None
    w = torch.randn(d, generator=g).to(DEV, dtype)
    x_before = x.clone()
    normed, new_x = fused.add_rmsnorm(x, delta, w, 1e-6)
    ref_n, ref_x = fused.add_rmsnorm_reference(x_before, delta, w, 1e-6)
    torch.testing.assert_close(new_x, ref_x, atol=0, rtol=0)  # the add is one rounding either way
    torch.testing.assert_close(normed, ref_n, **_tol(dtype))
    assert torch.equal(x, x_before), "x must not be modified in place"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,h,kvh,d,norm", [(1, 4, 2, 16, True), (3, 8, 2, 32, True), (2, 4, 4, 16, False)])
def test_qk_norm_rope_store_matches_reference(dtype, rows, h, kvh, d, norm):
    g = torch.Generator().manual_seed(rows * h * d + norm)
    s, start = 40, 17
    qkv = torch.randn(rows, (h + 2 * kvh) * d, generator=g).to(DEV, dtype)
    qw, kw = (torch.randn(d, generator=g).to(DEV, dtype) for _ in range(2)) if norm else (None, None)
    pos = torch.arange(rows) + start + 3
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    f = pos.float()[:, None] * inv[None]
    emb = torch.cat((f, f), -1)
    cos, sin = emb.cos().to(DEV, dtype), emb.sin().to(DEV, dtype)
    kc = torch.full((s, kvh, d), float("nan"), dtype=dtype, device=DEV)
    vc = kc.clone()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    st = torch.tensor(start, device=DEV)
    q = fused.qk_norm_rope_store(qkv, qw, kw, cos, sin, kc, vc, st, h, kvh, 1e-6)
    q_ref = fused.qk_norm_rope_store_reference(qkv, qw, kw, cos, sin, kc_ref, vc_ref, start, h, kvh, 1e-6)
    torch.testing.assert_close(q, q_ref, **_tol(dtype))
    torch.testing.assert_close(kc, kc_ref, equal_nan=True, **_tol(dtype))
    torch.testing.assert_close(vc, vc_ref, equal_nan=True, atol=0, rtol=0)  # v is a plain copy
    assert torch.isnan(kc[:start]).all() and torch.isnan(kc[start + rows:]).all(), "wrote outside the rows' slots"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,h,kvh,d,norm", [(1, 4, 2, 16, True), (5, 8, 2, 32, True), (3, 4, 4, 16, False)])
def test_qk_norm_rope_store_at_pool_rows_matches_reference(dtype, rows, h, kvh, d, norm):
    """The batched form: each row's K/V to its own (pool slot, position) of one pool layer ``[N, S, KVH, D]`` (a
    strided view, as ``pool.k[:, layer]``); nothing else of the pool is written."""
    g = torch.Generator().manual_seed(rows * h + d + norm)
    n, layers, s = 4, 3, 20
    qkv = torch.randn(rows, (h + 2 * kvh) * d, generator=g).to(DEV, dtype)
    qw, kw = (torch.randn(d, generator=g).to(DEV, dtype) for _ in range(2)) if norm else (None, None)
    cos, sin = (torch.randn(rows, d, generator=g).to(DEV, dtype) for _ in range(2))
    pool_k = torch.full((n, layers, s, kvh, d), float("nan"), dtype=dtype, device=DEV)
    pool_v = pool_k.clone()
    ref_k, ref_v = pool_k.clone(), pool_v.clone()
    slot = torch.randint(0, n, (rows,), generator=g)
    pos = torch.randperm(s, generator=g)[:rows]  # distinct positions: no two rows share a destination
    dest = (slot.to(DEV), pos.to(DEV))
    q = fused.qk_norm_rope_store(qkv, qw, kw, cos, sin, pool_k[:, 1], pool_v[:, 1], None, h, kvh, 1e-6, rows=dest)
    q_ref = fused.qk_norm_rope_store_reference(qkv, qw, kw, cos, sin, ref_k[:, 1], ref_v[:, 1], None, h, kvh, 1e-6,
                                               rows=dest)
    torch.testing.assert_close(q, q_ref, **_tol(dtype))
    torch.testing.assert_close(pool_k, ref_k, equal_nan=True, **_tol(dtype))
    torch.testing.assert_close(pool_v, ref_v, equal_nan=True, atol=0, rtol=0)
    written = torch.zeros(n, layers, s, dtype=torch.bool)
    written[slot, 1, pos] = True
    assert not torch.isnan(pool_k.cpu()[written]).any() and torch.isnan(pool_k.cpu()[~written]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,i", [(1, 48), (4, 1500)])
def test_silu_mul_matches_reference(dtype, rows, i):
    g = torch.Generator().manual_seed(rows + i)
    gu = (torch.randn(rows, 2 * i, generator=g) * 4).to(DEV, dtype)
    torch.testing.assert_close(fused.silu_mul(gu), fused.silu_mul_reference(gu), **_tol(dtype))


def test_bad_shapes_raise():
    x = torch.randn(2, 8, device=DEV)
    with pytest.raises(ValueError):
        fused.add_rmsnorm(x, None, torch.ones(4, device=DEV), 1e-6)
    with pytest.raises(ValueError):
        fused.silu_mul(torch.randn(2, 7, device=DEV))
    with pytest.raises(ValueError):
        fused.qk_norm_rope_store(torch.randn(1, 10, device=DEV), None, None, torch.ones(1, 4), torch.ones(1, 4),
                                 torch.zeros(8, 1, 4), torch.zeros(8, 1, 4), torch.tensor(0), 1, 1, 1e-6)


# -- the fused static path of the model and the engine ---------------------------------------------------
def test_fused_static_pass_matches_plain(tiny_dirs):
    """One tree pass through the fused layer path (8 launches per layer) equals the op-by-op static path:
    hidden states, and the K/V it writes into the cache."""
    from specpilot.model.checkpoint import load_model

    from .test_tree_attention import tree_mask_from_parents

    model = load_model(tiny_dirs[0]).to(DEV)
    prompt = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(3)).to(DEV)
    outs = []
    for kernels in (False, True):
        model.kernels = KernelConfig(fused=kernels)
        cache = model.new_cache(48)
        model(prompt, torch.arange(9, device=DEV), cache, 0)  # prefill: dynamic path
        parents = [-1, 0, 0, 1, 2, 1]
        mask = tree_mask_from_parents(parents).to(DEV)
        depth = torch.tensor([0, 1, 1, 2, 2, 2], device=DEV)
        toks = torch.tensor([5, 7, 9, 11, 13, 15], device=DEV)
        h = model.forward_static(toks, 9 + depth, cache, torch.tensor(9, device=DEV), mask)
        outs.append((h, cache.k[:, :15].clone(), cache.v[:, :15].clone()))
    (h0, k0, v0), (h1, k1, v1) = outs
    torch.testing.assert_close(h1, h0, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k1, k0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v1, v0, atol=1e-5, rtol=1e-5)


def test_engine_with_fused_kernels_equals_ar(tiny_dirs, monkeypatch):
    """Speculative decoding through padded buckets with the fused kernels gives AR's tokens (float32)."""
    from specpilot.config import SystemConfig
    from specpilot.spec.draft_model import DraftModelDrafter
    from specpilot.engine.engine import Engine

    from .conftest import random_prompts
    from .test_engine import ar_tokens

    from specpilot.model import fused as fused_path

    calls = []
    real = fused_path.fused_layer
    monkeypatch.setattr(fused_path, "fused_layer", lambda *a: calls.append(1) or real(*a))
    from specpilot.model.checkpoint import load_model

    target, drafter = load_model(tiny_dirs[0], device=DEV), load_model(tiny_dirs[1], device=DEV)
    cfg = SystemConfig(drafter="draft_model", tree="best_first", nodes=6, depth=3, top_k=2)
    try:
        target.kernels = KernelConfig(fused=True)
        eng = Engine(target, cfg, DraftModelDrafter(drafter, 2), eos_ids=[], buckets=True)
        got = [eng.generate(p, 12).tokens for p in random_prompts(2, 64, length=8, seed=23)]
    finally:
        target.kernels = KernelConfig()
    for p, toks in zip(random_prompts(2, 64, length=8, seed=23), got):
        assert toks == ar_tokens(target, p, 12)
    assert calls, "the fused path never ran"
