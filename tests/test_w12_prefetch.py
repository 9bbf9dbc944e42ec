"""The W12 kernels' L2 prefetch (``prefetch=D``, :func:`~specpilot.kernels.w12_tiles._prefetch_steps`): a hint that
must change no value. On a GPU, every D and kernel (one-row lines GEMV with its fused norm / SwiGLU / residual add
operands, the tensor-core kernel at 8 and 33 rows, ragged K, split K, bias, escapes) gives bitwise the output with no
prefetch; on the CPU the override is checked and the interpreter (no inline PTX) ignores it."""

from __future__ import annotations

import pytest
import torch

from specpilot.kernels.w12_gemm import W12GemmError, escape_table, w12_gemm, w12_gemm_reference
from specpilot.w12.format import encode

from .tritonutil import CUDA, DEV


def _weight(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    w[::37, ::29] = 300.0  # escapes in many tiles
    t = encode(w.to(DEV), device=DEV)
    return t, escape_table(t)


@pytest.mark.parametrize("bad", [dict(prefetch=-1), dict(prefetch=True), dict(prefetch=1.5), dict(prefetch="2"),
                                 dict(prefetch_lines=1)])
def test_prefetch_override_is_checked(bad):
    t, esc = _weight(128, 128, 0)
    x = torch.randn(1, 128, device=DEV, dtype=torch.float32)
    with pytest.raises(W12GemmError, match="prefetch"):
        w12_gemm(x, t, escapes=esc, **bad)


@pytest.mark.skipif(CUDA, reason="the interpreter case")
def test_prefetch_is_ignored_by_the_interpreter():
    t, esc = _weight(256, 320, 1)
    x = torch.randn(3, 320, dtype=torch.float32)
    assert torch.equal(w12_gemm(x, t, escapes=esc, prefetch=4), w12_gemm(x, t, escapes=esc))
    assert torch.equal(w12_gemm(x, t, escapes=esc, prefetch=1, prefetch_lines=True), w12_gemm(x, t, escapes=esc))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA (inline PTX)")
@pytest.mark.parametrize("n,k", [(384, 4096), (1000, 3000), (4096, 12288)])
@pytest.mark.parametrize("m", [1, 8, 33])
def test_prefetch_changes_no_bit(n, k, m):
    t, esc = _weight(n, k, n + k + m)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    want = w12_gemm(x, t, bias, escapes=esc, prefetch=0)
    ref = w12_gemm_reference(x, t, bias).float()
    assert (want.float() - ref).abs().max() <= 0.02 * ref.abs().max()  # the kernel ran (coarse; the bound is tested elsewhere)
    for d, lines in ((2, False), (64, False), (1, True), (3, True)):
        for split in (None, 2):
            assert torch.equal(w12_gemm(x, t, bias, escapes=esc, prefetch=d, prefetch_lines=lines, split_k=split),
                               w12_gemm(x, t, bias, escapes=esc, prefetch=0, split_k=split)), (d, lines, split)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA (inline PTX)")
@pytest.mark.parametrize("split", [None, 1, 4])
def test_prefetch_changes_no_bit_in_the_fused_one_row_paths(split):
    from specpilot.kernels.w12_gemm import W12Linear
    from specpilot.kernels.w12_norm import w12_add_residual, w12_norm_in
    from specpilot.kernels.w12_swiglu import w12_swiglu_down

    g = torch.Generator().manual_seed(5)
    k, n = 1024, 2048
    down = W12Linear.from_linear(torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)).cuda()
    up = W12Linear.from_linear(torch.nn.Linear(n, 3 * k, bias=True).to(torch.bfloat16)).cuda()
    gate_up = torch.randn(1, 2 * k, generator=g).to("cuda", torch.bfloat16)
    res = torch.randn(1, n, generator=g).to("cuda", torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(n, generator=g)).to("cuda", torch.bfloat16)
    for d, lines in ((1, False), (64, False), (2, True)):
        pf = dict(prefetch=d, prefetch_lines=lines, split_k=split)
        a0 = w12_add_residual(gate_up, down, res, glu=True, prefetch=0, split_k=split)
        a1 = w12_add_residual(gate_up, down, res, glu=True, **pf)
        assert torch.equal(a0[0], a1[0]) and torch.equal(a0[1], a1[1])
        assert torch.equal(w12_swiglu_down(gate_up, down, **pf), w12_swiglu_down(gate_up, down, prefetch=0, split_k=split))
        assert torch.equal(w12_norm_in(a0[0], a0[1], weight, 1e-6, up, **pf),
                           w12_norm_in(a0[0], a0[1], weight, 1e-6, up, prefetch=0, split_k=split))
