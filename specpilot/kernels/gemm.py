"""Skinny GEMM for verification passes: ``x [M, K] @ W[N, K]ᵀ`` with M = 1–64 rows (§2.1).

At a few rows a projection is a read of W: the time is W's bytes over the bandwidth. cuBLAS reaches
1.8–2.5 TB/s on the Qwen3-8B shapes at 1 row where a copy runs at 4.3 TB/s (``../shared/ANCHORS.md``),
because its tiles leave the small matrices with too few blocks in flight. This kernel tiles N by
BLOCK_N and splits K into SPLIT_K chunks so that every SM streams W, pads the M rows to one tensor-core
tile (BLOCK_M ≤ 64, so W is read exactly once for every M up to 64) and keeps fp32 accumulators.

Split-K partials go to an fp32 workspace ``[SPLIT_K, M, N]`` and a second kernel sums them in split
order (no atomics): bitwise deterministic for fixed shapes. The launch configuration depends only on
static shapes (:func:`default_config`), so a captured CUDA graph and an eager call agree bit for bit.

The same kernel, tiled over M as well, is the batch-invariant GEMM of batched passes: with the K order (BLOCK_K,
SPLIT_K) chosen from the weight's shape alone (:func:`invariant_config`), every row's products are summed in the
same order whatever the number of rows (the tile may follow the rows: on the H200 it does not change a row's
bits), so a row's output does not depend on the other rows of the pass. cuBLAS picks its algorithm by M, so under it a request's logits change in the last bits
with the batch it shares a step with, and near ties flip its tokens.

- :func:`skinny_gemm_reference`: float32 matmul, the oracle.
- :func:`skinny_gemm`: the Triton kernel (interpreter on the CPU in tests).
- :func:`linear`: the kernel on CUDA for M ≤ 64 and 16-bit weights, ``F.linear`` otherwise.
- :func:`invariant_gemm` / :func:`invariant_linear`: the batch-invariant form, any M.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton
    triton = None

MAX_ROWS = 64


def skinny_gemm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in float32, cast to x's dtype. ``x [M, K]``, ``weight [N, K]``, ``bias [N]``."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return 132  # H200 SXM
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_config(m: int, n: int, k: int, num_sms: int = 132) -> dict:
    """Launch parameters for ``[m, k] @ [n, k]ᵀ`` from static shapes only.

    BLOCK_M: the rows rounded up to 16/32/64. BLOCK_N 64, BLOCK_K 128, 5 stages. SPLIT_K: the smallest
    power of two that puts a program on every SM, keeping at least 4 K-blocks per split and dividing K
    into whole blocks. From the H200 sweep of ``probes/kernels_probe.py --sweep``: deeper pipelines beat
    more splits (every split costs a reduction launch).
    """
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 64, 128
    n_blocks = -(-n // block_n)
    k_blocks = -(-k // block_k)
    split = 1
    while n_blocks * split < num_sms and k_blocks % (2 * split) == 0 and k_blocks // (2 * split) >= 4:
        split *= 2
    return dict(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split, num_warps=4, num_stages=5)


# Tiles of the batch-invariant GEMM by rows: (max rows, BLOCK_M, BLOCK_N, warps, stages). A row's bits depend only
# on the K order (SPLIT_K, BLOCK_K), not on the tile: every tile shape gave bitwise-equal rows on the H200
# (results/batch_invariant_h200_2026-12-04/invariant_tiles.json); these were the fastest inside CUDA graphs at
# 8 / 32 / 128 / 256 rows (invariant_split.json there).
INVARIANT_TILES = ((16, 16, 64, 4, 5), (128, 64, 128, 4, 4), (None, 128, 128, 8, 3))
SMEM_BYTES = 200 * 1024  # the stages of a float32 tile are cut to fit this


def invariant_config(m: int, n: int, k: int, num_sms: int = 132, element_size: int = 2,
                     tile_by_rows: bool = True) -> dict:
    """Launch parameters of the batch-invariant GEMM for ``[m, k] @ [n, k]ᵀ``.

    The K order, which alone decides a row's bits on a GPU, is a function of ``(n, k)`` and the device's SM count
    only: BLOCK_K 128 and the smallest power-of-two SPLIT_K that puts ``(n / 64) · SPLIT_K`` programs on half the
    SMs (keeping ≥ 4 K-blocks per split and whole blocks). With ``tile_by_rows`` the tile follows ``m``
    (:data:`INVARIANT_TILES`), else it is the largest whatever ``m`` (the Triton interpreter: its ``tl.dot`` is a
    numpy matmul whose bits change with the tile's shape). In float32 the stages are cut to fit
    :data:`SMEM_BYTES` of shared memory.
    """
    block_k, k_blocks, split = 128, -(-k // 128), 1
    while -(-n // 64) * split < num_sms // 2 and k_blocks % (2 * split) == 0 and k_blocks // (2 * split) >= 4:
        split *= 2
    bm, bn, warps, stages = next(t[1:] for t in INVARIANT_TILES if t[0] is None or (tile_by_rows and m <= t[0]))
    stages = max(1, min(stages, SMEM_BYTES // ((bm + bn) * block_k * element_size)))
    return dict(block_m=bm, block_n=bn, block_k=block_k, split_k=split, num_warps=warps, num_stages=stages)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if triton is None:
        raise RuntimeError("triton is not installed")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"want x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    n = weight.shape[0]
    if x.shape[0] < 1:
        raise ValueError("the GEMM needs at least one row")
    if x.dtype != weight.dtype or (bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype)):
        raise ValueError(f"dtype/shape mismatch: x {x.dtype}, weight {weight.dtype}, bias "
                         f"{None if bias is None else (bias.dtype, tuple(bias.shape))}")
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("x needs a contiguous last dim and weight must be contiguous")


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **overrides) -> torch.Tensor:
    """Triton ``x @ weight.T (+ bias)``; fp32 accumulation, output in x's dtype.

    Args:
        x: ``[M, K]`` with M ≤ 64 (bf16 / fp16 / fp32), last dim contiguous.
        weight: ``[N, K]`` same dtype, contiguous (an ``nn.Linear`` weight).
        bias: ``[N]`` or None.
        overrides: block_m / block_n / block_k / split_k / num_warps / num_stages (sweeps and tests).
    Returns: ``[M, N]``.
    Raises: ValueError on shape / dtype / layout mismatch or M > 64; RuntimeError without triton.
    """
    _check(x, weight, bias)
    (m, k), n = x.shape, weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"skinny_gemm takes 1..{MAX_ROWS} rows, got {m}")
    cfg = default_config(m, n, k, _num_sms(x.device.index if x.is_cuda else None))
    cfg.update({key: v for key, v in overrides.items() if v is not None})
    return _launch(x, weight, bias, cfg)


def invariant_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant Triton ``x @ weight.T (+ bias)`` for any number of rows (module doc): row i of the result
    is bitwise the same whether x has 1 row or 2048, and wherever row i sits among them. fp32 accumulation.

    Args / Returns: as :func:`skinny_gemm`, with ``x [M, K]`` for any M ≥ 1.
    Raises: ValueError on shape / dtype / layout mismatch; RuntimeError without triton.
    """
    _check(x, weight, bias)
    return _launch(x, weight, bias, invariant_config(x.shape[0], weight.shape[0], x.shape[1],
                                                     _num_sms(x.device.index if x.is_cuda else None),
                                                     x.element_size(), tile_by_rows=x.is_cuda))


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: dict) -> torch.Tensor:
    """Run the kernel with launch parameters ``cfg``: grid ``(N tiles, SPLIT_K, M tiles)``, then the split sum."""
    (m, k), n = x.shape, weight.shape[0]
    bm, bn, bk, split = cfg["block_m"], cfg["block_n"], cfg["block_k"], cfg["split_k"]
    k_per_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    even = n % bn == 0 and k % k_per_split == 0 and k == k_per_split * split
    _skinny_gemm_kernel[(triton.cdiv(n, bn), split, triton.cdiv(m, bm))](
        x, weight, bias if bias is not None else out, out, part, m, n, k, x.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, K_PER_SPLIT=k_per_split, SPLIT_K=split, EVEN=even,
        HAS_BIAS=bias is not None, FP32=x.dtype == torch.float32,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if split > 1:
        block = 1024
        _split_k_sum_kernel[(triton.cdiv(m * n, block),)](
            part, bias if bias is not None else out, out, m * n, n, SPLIT_K=split, BLOCK=block,
            HAS_BIAS=bias is not None, num_warps=4)
    return out


def cublas_linear(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """``layer(x)`` through ``F.linear`` (cuBLAS on CUDA); same signature as :func:`linear`. A layer that is
    not an ``nn.Linear`` (a :class:`~specpilot.w12.gemm.W12Linear`, §4.1) runs its own forward."""
    if not isinstance(layer, torch.nn.Linear):
        return layer(x)
    return F.linear(x, layer.weight, layer.bias)


def linear(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """``layer(x)`` for ``x [M, K]``: :func:`skinny_gemm` on CUDA for 1 ≤ M ≤ 64 and 16-bit weights,
    ``F.linear`` otherwise (cuBLAS is at its best from there); a layer that is not an ``nn.Linear`` (a
    W12Linear) runs its own forward."""
    if not isinstance(layer, torch.nn.Linear):
        return layer(x)
    w = layer.weight
    if (x.is_cuda and triton is not None and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS
            and w.dtype in (torch.bfloat16, torch.float16)):
        return skinny_gemm(x, w, layer.bias)
    return F.linear(x, w, layer.bias)


def invariant_linear(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """``layer(x)`` for ``x [M, K]`` through :func:`invariant_gemm` (batched passes); same signature as
    :func:`linear`. A layer that is not an ``nn.Linear`` (a W12Linear) runs its own forward, which makes no
    batch-invariance promise. Raises RuntimeError without triton."""
    if not isinstance(layer, torch.nn.Linear):
        return layer(x)
    return invariant_gemm(x, layer.weight, layer.bias)


if triton is not None:

    @triton.jit
    def _skinny_gemm_kernel(X, W, Bias, Out, Part, M, N, K, stride_xm, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PER_SPLIT,
                            SPLIT_K: tl.constexpr, EVEN: tl.constexpr, HAS_BIAS: tl.constexpr,
                            FP32: tl.constexpr):
        """Grid ``(cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, BLOCK_M))``: one N tile, one K chunk (K_PER_SPLIT, a
        multiple of BLOCK_K), one M tile. Only block sizes are compile-time constants, so one compile serves
        every projection."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        k0 = pid_k * K_PER_SPLIT
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kk in range(0, K_PER_SPLIT, BLOCK_K):
            offs_k = k0 + kk + tl.arange(0, BLOCK_K)
            a = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=m_ok[:, None] & (offs_k < K)[None, :], other=0.0)
            if EVEN:
                b = tl.load(W + offs_n[:, None] * K + offs_k[None, :])
            else:
                b = tl.load(W + offs_n[:, None] * K + offs_k[None, :],
                            mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0)
            if FP32:
                acc += tl.dot(a, tl.trans(b), input_precision="ieee")
            else:
                acc += tl.dot(a, tl.trans(b))
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(Out + offs_m[:, None] * N + offs_n[None, :], acc.to(Out.dtype.element_ty),
                     mask=m_ok[:, None] & n_ok[None, :])
        else:
            tl.store(Part + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc,
                     mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _split_k_sum_kernel(Part, Bias, Out, MN, N, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                            HAS_BIAS: tl.constexpr):
        """``Out = sum_s Part[s] (+ bias)`` in split order (deterministic)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < MN
        acc = tl.load(Part + offs, mask=ok, other=0.0)
        for s in range(1, SPLIT_K):
            acc += tl.load(Part + s * MN + offs, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(Bias + offs % N, mask=ok, other=0.0).to(tl.float32)
        tl.store(Out + offs, acc.to(Out.dtype.element_ty), mask=ok)
