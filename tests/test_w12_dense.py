"""The dense W12 decode for wide passes (specpilot.w12.dense, §4.1): bit for bit the reference decode,
and a wide W12Linear pass is the bf16 layer's own F.linear (Triton interpreter on the CPU, compiled on CUDA)."""

from __future__ import annotations

import pytest
import torch

from .tritonutil import DEV, triton  # noqa: F401

import specpilot.w12.dense as wd
import specpilot.w12.linear as wl
from specpilot.w12.format import decode, encode
from specpilot.w12.gemm import W12GemmError
from specpilot.w12.linear import W12Linear

from .test_w12_gemm import planted_weight


@pytest.mark.parametrize("n,k,bn,bk", [(130, 200, 32, 256), (200, 333, 16, 64), (64, 64, 128, 128)])
def test_dense_decode_is_the_reference_bit_for_bit(n, k, bn, bk):
    w = planted_weight(n, k, seed=n + k)
    w[5, 7], w[9, 1] = float("inf"), float("nan")  # non-finite escapes too
    t = encode(w, device=DEV)
    assert t.num_escapes > 10
    got = wd.w12_decode_dense(t, block_n=bn, block_k=bk)
    assert torch.equal(got.view(torch.int16).cpu(), w.view(torch.int16))
    assert torch.equal(got.view(torch.int16), decode(t).view(torch.int16))
    out = torch.empty(n, k, dtype=torch.bfloat16, device=DEV)
    assert wd.w12_decode_dense(t, out=out) is out and torch.equal(out.view(torch.int16), got.view(torch.int16))


def test_dense_decode_bad_arguments():
    t = encode(planted_weight(64, 64, seed=1), device=DEV)
    with pytest.raises(W12GemmError, match="contiguous bf16"):
        wd.w12_decode_dense(t, out=torch.empty(64, 63, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(W12GemmError, match="contiguous bf16"):
        wd.w12_decode_dense(t, out=torch.empty(64, 64, dtype=torch.float32, device=DEV))
    with pytest.raises(W12GemmError, match="block_n"):
        wd.w12_decode_dense(t, block_n=48)


def test_wide_w12_pass_takes_the_dense_path_and_equals_f_linear(monkeypatch):
    """Above DENSE_ROWS rows the kernel path decodes once and calls F.linear: in float32 bit for bit the
    nn.Linear with the same weight; at DENSE_ROWS rows and below the tensor-core kernel runs (no dense decode)."""
    g = torch.Generator().manual_seed(5)
    lin = torch.nn.Linear(96, 40).requires_grad_(False)
    with torch.no_grad():
        lin.weight.copy_(planted_weight(40, 96, seed=3).float())
    layer = W12Linear.from_linear(lin).to(DEV)
    layer.use_kernel = True
    lin = lin.to(DEV)
    calls = []
    real = wl.w12_decode_dense
    monkeypatch.setattr(wl, "w12_decode_dense", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(wl, "DENSE_ROWS", 8)
    x = torch.randn(9, 96, generator=g).to(DEV)
    assert torch.equal(layer(x), lin(x)) and calls == [1]
    torch.testing.assert_close(layer(x[:8]), lin(x[:8]), atol=1e-5, rtol=1e-5)
    assert calls == [1]  # 8 rows: the tensor-core kernel
