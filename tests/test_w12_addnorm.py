"""The residual add + RMSNorm run by the W12 GEMV's last program (specpilot.kernels.w12_addnorm, §4.1, issue 5).

CPU (Triton interpreter, float32): bitwise ``add_rmsnorm(residual, GEMV output)`` (both sums are numpy's), for
split K summed in the kernel, no split, the two-kernel fallback, with and without the fused SwiGLU load, with
escapes and a bias; the tile counters are back at zero afterwards. CUDA (bf16): ``new_x`` bitwise, ``normed``
within one bf16 rounding (the square sums run over different warps).
"""

from __future__ import annotations

import pytest
import torch

from .test_w12_gemm import planted_weight
from .tritonutil import CUDA, DEV, triton  # noqa: F401

from specpilot.kernels import fused
from specpilot.kernels.w12_addnorm import addnorm_fusable, w12_add_rmsnorm, w12_add_rmsnorm_reference
from specpilot.kernels.w12_gemm import W12GemmError, W12Linear, split_locks, w12_gemm
from specpilot.w12.format import encode

DTYPE = torch.bfloat16 if CUDA else torch.float32


def layer_and_inputs(n, k, seed, bias, glu):
    g = torch.Generator().manual_seed(seed)
    wt = planted_weight(n, k, seed=seed)
    wt[wt.float().abs() > 1e5] = -7e4  # escapes kept, but no output whose square overflows float32 (rstd 0)
    layer = W12Linear.from_w12(encode(wt, device=DEV),
                               torch.randn(n, generator=g).to(DEV, DTYPE) if bias else None)
    layer.use_kernel = True
    x = torch.randn(1, 2 * k if glu else k, generator=g).to(DEV, DTYPE)
    res = torch.randn(1, n, generator=g).to(DEV, DTYPE) * 4
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(DEV, DTYPE)
    return layer, x, res, w


def assert_norm_matches(got, want):
    normed, new_x = got
    assert normed.abs().max() > 0.1 and bool(normed.isfinite().all())
    assert torch.equal(new_x, want[1])
    if CUDA:  # rstd may differ in its last float32 bit: normed by one bf16 rounding at most
        assert torch.allclose(normed.float(), want[0].float(), rtol=2**-7, atol=0)
    else:
        assert torch.equal(normed, want[0])


@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("n,k,over", [
    (192, 512, dict(split_k=4)),  # split K summed in the kernel, then the norm
    (200, 300, dict(split_k=1)),  # no split: every program stores its tile; ragged N and K
    (192, 512, dict(split_k=2, fused_split=False)),  # two-kernel sum: add_rmsnorm after it
    (130, 640, dict(block_n=32, block_k=128, split_k=5)),
])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_norm_is_add_rmsnorm_of_the_gemv_output(glu, n, k, over, bias):
    layer, x, res, w = layer_and_inputs(n, k, seed=n + k + glu, bias=bias, glu=glu)
    assert addnorm_fusable(x, layer, res, w, glu)
    y = w12_gemm(fused.silu_mul(x) if glu else x, layer.w12(), layer.bias, gemv=True, lines=True, **over)
    want = fused.add_rmsnorm(res, y, w, 1e-6)
    for _ in range(2):  # the counters reset: a second call is the same
        got = w12_add_rmsnorm(x, layer, res, w, 1e-6, glu=glu, **over)
        assert_norm_matches(got, want)
    assert int(split_locks(x.device, 1024).abs().sum()) == 0
    ref = w12_add_rmsnorm_reference(x.cpu().double(), _double(layer), res.cpu().double(), w.cpu().double(), 1e-6, glu)
    assert torch.allclose(got[0].cpu().double(), ref[0], rtol=2e-2, atol=2e-2)


def _double(layer):
    c = W12Linear.from_w12(layer.w12().__class__(*(t.cpu() for t in (layer.records, layer.base, layer.esc_idx,
                                                                     layer.esc_val)), layer.w12().shape,
                                                layer.sha256), None if layer.bias is None else layer.bias.cpu())
    c.use_kernel = False
    return lambda x: c(x.float()).double()


def test_refuses_what_it_cannot_fuse_and_stays_usable():
    layer, x, res, w = layer_and_inputs(64, 128, seed=5, bias=False, glu=False)
    bad = [(torch.cat([x, x]), layer, torch.cat([res, res]), w), (x, torch.nn.Linear(128, 64).to(DEV), res, w),
           (x, layer, res[:, :32], w), (x, layer, res, w[:32]), (x, layer, res.half(), w), (x, layer, "res", w)]
    for args in bad:
        assert not addnorm_fusable(*args)
        with pytest.raises(W12GemmError, match="no fused add_rmsnorm"):
            w12_add_rmsnorm(*args, 1e-6)
    with pytest.raises(W12GemmError, match="unknown"):
        w12_add_rmsnorm(x, layer, res, w, 1e-6, block_z=1)
    assert_norm_matches(w12_add_rmsnorm(x, layer, res, w, 1e-6),
                        fused.add_rmsnorm(res, w12_gemm(x, layer.w12()), w, 1e-6))
