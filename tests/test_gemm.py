"""Skinny GEMM (specpilot.kernels.gemm) against the float32 reference on fresh random inputs.

CPU: Triton interpreter, float32. CUDA: compiled, float32 and bf16 (bf16 within accumulation rounding).
"""

from __future__ import annotations

import pytest
import torch

from .tritonutil import CUDA, DEV, triton  # noqa: F401

from specpilot.kernels import gemm

DTYPES = [torch.float32] + ([torch.bfloat16] if CUDA else [])


# (M, N, K, overrides): even and ragged N / K, split-K 1..3, every BLOCK_M bucket
CASES = [
    (1, 64, 128, dict(block_n=32, block_k=32)),
    (1, 40, 96, dict(block_n=32, block_k=32, split_k=2)),
    (5, 128, 256, dict(block_n=64, block_k=64, split_k=2)),
    (17, 48, 200, dict(block_n=16, block_k=32, split_k=3)),
    (33, 64, 64, dict(block_n=32, block_k=32)),
    (64, 32, 160, dict(block_n=32, block_k=32, split_k=2)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,over", CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_gemm_matches_reference(dtype, m, n, k, over, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    w = torch.randn(n, k, generator=g).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype) if bias else None
    out = gemm.skinny_gemm(x, w, b, **over)
    ref = gemm.skinny_gemm_reference(x, w, b)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=1e-2)
    assert out.shape == (m, n) and out.dtype == dtype
    torch.testing.assert_close(out, ref, **tol)
    assert torch.equal(gemm.skinny_gemm(x, w, b, **over), out), "two runs must be bitwise identical"


def test_default_config_fills_the_device_and_divides_k():
    for m, n, k in [(1, 6144, 4096), (1, 4096, 4096), (1, 24576, 4096), (32, 4096, 12288), (64, 151936, 4096)]:
        c = gemm.default_config(m, n, k)
        kb = -(-k // c["block_k"])
        assert kb % c["split_k"] == 0 and kb // c["split_k"] >= 4
        assert c["block_m"] >= m
        could_double = kb % (2 * c["split_k"]) == 0 and kb // (2 * c["split_k"]) >= 4
        assert (-(-n // c["block_n"])) * c["split_k"] >= 132 or not could_double


def test_bad_input_raises():
    with pytest.raises(ValueError):
        gemm.skinny_gemm(torch.randn(65, 8, device=DEV), torch.randn(4, 8, device=DEV))
    with pytest.raises(ValueError):
        gemm.skinny_gemm(torch.randn(2, 8, device=DEV), torch.randn(4, 9, device=DEV))


def test_linear_falls_back_off_cuda():
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    assert torch.equal(gemm.linear(x, lin), lin(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,bias", [(96, 300, False), (64, 1024, True)])
def test_invariant_gemm_rows_do_not_depend_on_the_other_rows(dtype, n, k, bias):
    """Batch invariance: each row of a 150-row product is bitwise the row computed alone, or among any other
    rows at any offset (split-K 1 and > 1), and matches the float32 reference."""
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(150, k, generator=g).to(DEV, dtype)
    w = torch.randn(n, k, generator=g).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype) if bias else None
    full = gemm.invariant_gemm(x, w, b)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=1e-2)
    torch.testing.assert_close(full, gemm.skinny_gemm_reference(x, w, b), **tol)
    for lo, hi in [(0, 1), (7, 8), (3, 70), (60, 150), (149, 150)]:
        assert torch.equal(gemm.invariant_gemm(x[lo:hi], w, b), full[lo:hi]), (lo, hi)
    shuffled = torch.randperm(150, generator=g)
    assert torch.equal(gemm.invariant_gemm(x[shuffled], w, b), full[shuffled])


def test_invariant_configs_share_one_k_order_per_weight():
    """Whatever the rows, one weight shape gets one K order (BLOCK_K, SPLIT_K): the bits of a row; tiles vary."""
    for n, k in [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)]:
        cs = [gemm.invariant_config(m, n, k) for m in (1, 16, 17, 64, 128, 129, 2048)]
        assert len({(c["block_k"], c["split_k"]) for c in cs}) == 1
        kb = -(-k // cs[0]["block_k"])
        assert kb % cs[0]["split_k"] == 0 and kb // cs[0]["split_k"] >= 4
        assert len({c["block_m"] for c in cs}) == 3
        assert len({str(gemm.invariant_config(m, n, k, tile_by_rows=False)) for m in (1, 17, 2048)}) == 1
    fp32 = gemm.invariant_config(2048, 4096, 4096, element_size=4)
    assert (fp32["block_m"] + fp32["block_n"]) * fp32["block_k"] * 4 * fp32["num_stages"] <= gemm.SMEM_BYTES
