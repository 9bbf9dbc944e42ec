"""The residual add and RMSNorm split across the one-row W12 GEMVs (specpilot.w12.norm, §4.1).

The producer half must store bit for bit ``residual + GEMV`` (the residual add ``add_rmsnorm`` does) and the true
tile sums of squares; the consumer half must equal the GEMV of the normalised row within rounding (the scale's sum
runs in another order); both refuse what they cannot fuse and stay usable. A tiny W12 model's one-row pass with the
fusion on matches it off, and speculative decoding with it gives AR's tokens. CPU: the Triton interpreter in
float32; CUDA: compiled, bf16 too.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from .test_w12_gemm import assert_within_rounding
from .test_w12_swiglu import _cpu, _cpu_layer, gate_up_row, w12_layer, w12_tiny
from .tritonutil import CUDA, DEV, triton  # noqa: F401

from specpilot.kernels import fused
from specpilot.w12.gemm import W12GemmError, w12_gemm
from specpilot.w12.norm import (TILE, add_fusable, norm_fusable, w12_add_residual, w12_add_residual_reference,
                                        w12_norm_in, w12_norm_in_reference)

DTYPES = [torch.float32] + ([torch.bfloat16] if CUDA else [])
LAUNCHES = [
    (200, 300, dict()),  # default launch, K not a multiple of the 256-column step (masked loads), N not of 16
    (192, 512, dict(split_k=2, fused_split=True)),
    (192, 512, dict(split_k=2, fused_split=False)),  # the second kernel adds the escapes and the residual
    (130, 640, dict(block_k=128, split_k=5)),
]


def row(k, seed, dtype, scale=1.0):
    return (torch.randn(1, k, generator=torch.Generator().manual_seed(seed)) * scale).to(DEV, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,over", LAUNCHES)
@pytest.mark.parametrize("glu", [False, True])
def test_residual_add_is_bitwise_residual_plus_the_gemv(dtype, n, k, over, glu):
    layer, t = w12_layer(n, k, seed=n + k, bias=True)
    layer.bias = layer.bias.to(dtype)
    x = gate_up_row(k, seed=k, dtype=dtype) if glu else row(k, k, dtype)
    res = row(n, n, dtype, scale=3.0)
    keep = res.clone()
    assert add_fusable(x, layer, res, glu)
    new_x, sq = w12_add_residual(x, layer, res, glu, **over)
    y = w12_gemm(fused.silu_mul(x) if glu else x, t, layer.bias, gemv=True, lines=True, block_n=TILE, **over)
    assert torch.equal(res, keep)  # the residual is not modified
    assert new_x.shape == (1, n) and new_x.dtype == dtype and sq.shape == (-(-n // TILE),)
    assert torch.equal(new_x, res + y), (new_x - res - y).abs().max()
    f = torch.nn.functional.pad(new_x.float().reshape(-1), (0, -n % TILE)).reshape(-1, TILE)
    torch.testing.assert_close(sq, (f * f).sum(1), rtol=1e-6, atol=0)
    new2, sq2 = w12_add_residual(x, layer, res, glu, **over)  # deterministic
    assert torch.equal(new2, new_x) and torch.equal(sq2, sq)
    ref_x, ref_sq = w12_add_residual_reference(x.float().cpu(), _cpu_layer(layer), res.float().cpu(), glu)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(new_x.float().cpu(), ref_x, rtol=tol, atol=tol * ref_x.abs().max().item())
    torch.testing.assert_close(sq.cpu(), ref_sq, rtol=4 * tol, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,over", LAUNCHES)
def test_fused_norm_equals_the_gemv_of_the_normalised_row(dtype, n, k, over):
    layer, t = w12_layer(n, k, seed=2 * n + k, bias=True)
    layer.bias = layer.bias.to(dtype)
    x = row(k, seed=n, dtype=dtype, scale=4.0)
    w = row(k, seed=n + 1, dtype=dtype).reshape(-1)
    f = torch.nn.functional.pad(x.float().reshape(-1), (0, -k % TILE)).reshape(-1, TILE)
    sq = (f * f).sum(1)
    assert norm_fusable(x, layer, w)
    got = w12_norm_in(x, sq, w, 1e-6, layer, **over)
    assert got.shape == (1, n) and got.dtype == dtype
    assert torch.equal(w12_norm_in(x, sq, w, 1e-6, layer, **over), got)  # deterministic
    h = fused.rmsnorm_reference(x, w, 1e-6)  # the row add_rmsnorm would hand the GEMV
    want = w12_gemm(h, t, layer.bias, gemv=True, lines=True, **over)
    if dtype == torch.float32:  # the scale's sum in another order: a few float32 roundings of each value
        hx = fused.rmsnorm_reference(x.cpu(), w.cpu(), 1e-6)
        assert_within_rounding(got.cpu(), hx, _cpu(t), layer.bias.cpu())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    else:  # one bf16 rounding of a normalised value can move
        torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2 * want.abs().max().item())
    ref = w12_norm_in_reference(x.float().cpu(), sq.cpu(), w.float().cpu(), 1e-6, _cpu_layer(layer))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float().cpu(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_the_norm_reads_any_tiling_of_the_sum_of_squares():
    """The consumer only sums ``sq``: one partial holding the whole sum, or 16-column tiles, give the same scale up
    to float32 reassociation, and a wrong sum changes the output (the scale is really read from sq)."""
    layer, _ = w12_layer(64, 256, seed=5, bias=False)
    x = row(256, seed=9, dtype=torch.float32, scale=2.0)
    w = row(256, seed=10, dtype=torch.float32).reshape(-1)
    tiles = (x.reshape(-1, TILE) ** 2).sum(1)
    a = w12_norm_in(x, tiles, w, 1e-6, layer)
    b = w12_norm_in(x, tiles.sum().reshape(1), w, 1e-6, layer)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    c = w12_norm_in(x, tiles * 4, w, 1e-6, layer)  # 4x the sum of squares: half the scale
    torch.testing.assert_close(c, a / 2, rtol=1e-4, atol=1e-5)


def test_refusals_name_the_condition_and_leave_it_usable():
    layer, t = w12_layer(64, 256, seed=3, bias=False)
    x = row(256, 1, torch.float32)
    res = row(64, 2, torch.float32)
    w = row(256, 3, torch.float32).reshape(-1)
    sq = torch.ones(16, device=x.device)  # on the GPU too: the eps cases must reach the eps check
    cases = [
        (lambda: w12_add_residual(x, layer, res[:, :32]), "residual row \\[1, 64\\]"),
        (lambda: w12_add_residual(x, layer, res.double()), "float64"),
        (lambda: w12_add_residual(x, layer, [1.0] * 64), "not a tensor"),
        (lambda: w12_add_residual(x[:, :128], layer, res), "row x \\[1, 256\\]"),
        (lambda: w12_add_residual(x, layer, res, glu=True), "gate_up \\[1, 512\\]"),
        (lambda: w12_add_residual(x, layer, res, block_n=32), "16-column tiles"),
        (lambda: w12_add_residual(x, layer, res, splitk=2), "unknown"),
        (lambda: w12_add_residual(x, torch.nn.Linear(256, 64), res), "not a W12Linear"),
        (lambda: w12_norm_in(x, sq, w[:128], 1e-6, layer), "contiguous \\[256\\]"),
        (lambda: w12_norm_in(x, sq.double(), w, 1e-6, layer), "1-D float32"),
        (lambda: w12_norm_in(x, sq.reshape(4, 4), w, 1e-6, layer), "1-D float32"),
        (lambda: w12_norm_in(x, torch.ones(0), w, 1e-6, layer), "non-empty"),
        (lambda: w12_norm_in(torch.cat([x, x]), sq, w, 1e-6, layer), "row x \\[1, 256\\]"),
        (lambda: w12_norm_in(x, torch.ones(257), w, 1e-6, layer), "at most 256"),
        (lambda: w12_norm_in(x, sq.to_sparse(), w, 1e-6, layer), "1-D float32"),
        (lambda: w12_norm_in(x, sq, w, None, layer), "eps"),
        (lambda: w12_norm_in(x, sq, w, "1e-6", layer), "eps"),
        (lambda: w12_norm_in(x, sq, w, True, layer), "eps"),
        (lambda: w12_norm_in(x, sq, w, float("inf"), layer), "eps"),
        (lambda: w12_norm_in(x, sq, w, -1.0, layer), "eps"),
    ]
    for call, msg in cases:
        with pytest.raises(W12GemmError, match=msg):
            call()
    layer.bias = torch.ones(64, device="meta")
    with pytest.raises(W12GemmError, match="bias"):
        w12_add_residual(x, layer, res)
    layer.bias = torch.ones(64, dtype=torch.int32, device=x.device)
    with pytest.raises(W12GemmError, match="bias"):
        w12_norm_in(x, sq, w, 1e-6, layer)
    layer.bias = None
    assert not add_fusable(x, layer, res[:, :32]) and not norm_fusable(x, layer, w[:128])
    new_x, _ = w12_add_residual(x, layer, res)  # still usable
    assert torch.equal(new_x, res + w12_gemm(x, t, gemv=True, lines=True, block_n=TILE))


def _spy(monkeypatch, calls):
    import specpilot.w12.norm as mod

    for name in ("w12_add_residual", "w12_norm_in"):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda x, *a, real=real, name=name, **kw: calls.append((name, x.shape[0]))
                            or real(x, *a, **kw))


def test_a_model_pass_with_the_fused_norm_matches_add_rmsnorm(tiny_dirs, monkeypatch):
    """The tiny W12 target on the fused static path: one row with ``fuse_norm`` on runs 2L − 1 fused adds and norms
    (all but the first norm and the final one) and gives the hidden states of ``fuse_norm`` off within float32
    reassociation; three rows never take it."""
    w = w12_tiny(tiny_dirs)
    calls = []
    _spy(monkeypatch, calls)
    n_layers = w.args.num_layers
    for rows in (1, 3):
        outs = {}
        for on in (True, False):
            w.kernels = dataclasses.replace(w.kernels, fuse_norm=on)
            calls.clear()
            cache = w.new_cache(16)
            tokens = torch.arange(5, 5 + rows, device=DEV)
            pos = torch.arange(4, 4 + rows, device=DEV)
            mask = torch.ones(rows, rows, dtype=torch.bool, device=DEV).tril()
            outs[on] = w.forward_static(tokens, pos, cache, torch.tensor(4, device=DEV), mask)
            fused_calls = list(calls)
            want = [("w12_add_residual", 1)] * (2 * n_layers - 1) + [("w12_norm_in", 1)] * (2 * n_layers - 1)
            assert sorted(fused_calls) == (sorted(want) if on and rows == 1 else []), (rows, on, fused_calls)
        torch.testing.assert_close(outs[True], outs[False], rtol=1e-4, atol=1e-5)


def test_speculative_output_equals_ar_with_the_fused_norm(tiny_dirs, monkeypatch):
    """w12 + the fused static path with padded buckets (float32, interpreter): the AR steps (one row) take the fused
    norm, the tree passes do not, and speculative tokens equal AR's and the plain model's."""
    from specpilot.config import SystemConfig
    from specpilot.spec.draft_model import DraftModelDrafter
    from specpilot.model.checkpoint import load_model
    from specpilot.engine.engine import Engine

    from .conftest import random_prompts

    w = w12_tiny(tiny_dirs)
    drafter = load_model(tiny_dirs[1], device=DEV)
    calls = []
    _spy(monkeypatch, calls)
    cfg = SystemConfig(drafter="draft_model", tree="best_first", nodes=6, depth=3, top_k=2, w12=True)
    for p in random_prompts(2, 64, length=8, seed=29):
        spec = Engine(w, cfg, DraftModelDrafter(drafter, 2), eos_ids=[], buckets=True).generate(p, 8).tokens
        calls.clear()
        ar = Engine(w, SystemConfig.ar(), None, eos_ids=[], buckets=True).generate(p, 8).tokens
        assert calls and {r for _, r in calls} == {1}  # the AR engine's one-row passes took the fused norm
        w.kernels = dataclasses.replace(w.kernels, fused=False)
        plain = Engine(w, SystemConfig.ar(), None, eos_ids=[]).generate(p, 8).tokens
        w.kernels = dataclasses.replace(w.kernels, fused=True)
        assert spec == ar == plain
