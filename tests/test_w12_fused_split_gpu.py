"""In-kernel split-K sums of the W12 kernels (``fused_split``) on a GPU, where programs really run at once:
bitwise equal to the two-kernel path over many calls at the Qwen3-8B down-projection shape (split 8: eight
programs race for each tile's counter), eagerly and replayed from a CUDA graph, and the counters end at zero.
Skipped without CUDA (the interpreter test in ``test_w12_gemm.py`` covers the arithmetic on the CPU)."""

from __future__ import annotations

import pytest
import torch

from specpilot.w12.gemm import default_config, escape_table, split_locks, w12_gemm
from specpilot.w12.format import encode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("m,gemv", [(1, True), (1, False), (8, False), (32, False)])
def test_fused_split_matches_the_split_sum_kernel_under_races(m, gemv):
    n, k = 4096, 12288
    torch.manual_seed(m)
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    w[::97, ::89] = 300.0  # escapes in many tiles
    t = encode(w, device="cuda")
    esc = escape_table(t)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    over = dict(gemv=gemv, split_k=8) if gemv else dict(gemv=False)
    assert gemv or default_config(m, n, k)["split_k"] > 1
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    want = w12_gemm(x, t, bias, escapes=esc, fused_split=False, **over)  # the two-kernel sum (fused is the default)
    for _ in range(50):
        assert torch.equal(w12_gemm(x, t, bias, escapes=esc, fused_split=True, **over), want)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        w12_gemm(x, t, bias, escapes=esc, fused_split=True, **over)  # warm-up: this stream's counters
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        out = w12_gemm(x, t, bias, escapes=esc, fused_split=True, **over)
    for _ in range(20):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    g2 = torch.cuda.CUDAGraph()  # captured on PyTorch's own capture stream, never warmed up: the two-kernel sum
    with torch.cuda.graph(g2):
        out2 = w12_gemm(x, t, bias, escapes=esc, fused_split=True, **over)
    out2.zero_()
    g2.replay()
    torch.cuda.synchronize()
    assert torch.equal(out2, want)
    assert int(split_locks(x.device, 1).abs().sum()) == 0  # this stream's counters
    with torch.cuda.stream(side):
        assert int(split_locks(x.device, 1).abs().sum()) == 0  # the graph's
