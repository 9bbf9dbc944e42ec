"""W12 records to the exact bf16 weight on the GPU, for wide passes (prefill): decode once, then cuBLAS (§4.1).

At one row a projection is a read of its weight and the W12 GEMV wins by reading 12 bits instead of 16. At
hundreds of rows (a prompt's prefill) a projection is compute-bound: the tensor-core W12 kernels decode every
weight tile once per 16–64 activation rows and lose to cuBLAS by far more than the 4 bits save. There the
cheaper way is the one quantised engines take for large batches: decode the whole weight once into a bf16
scratch tensor (read 12 bits, write 16 bits a weight) and call the very ``F.linear`` the bf16 model calls, so
the pass costs one decode plus the bf16 GEMM, and its output is bit for bit the bf16 model's.

:func:`w12_decode_dense` runs the word decode of :mod:`specpilot.w12.tiles` (three integer
instructions a weight to ``w' = w · 2^(112 − B_n)``), scales each row by the exact power of two
``2^(B_n − 112)``, stores bf16, then writes the escapes' exact bit patterns over their saturated codes (one
scatter of ``E`` int16 values). The reference is :func:`specpilot.w12.format.decode`; tests compare bit for
bit in the Triton interpreter.
"""

from __future__ import annotations

import torch

from specpilot.w12.escapes import W12GemmError
from specpilot.w12.format import RECORD_COLS, W12Tensor

try:
    import triton
    import triton.language as tl

    from specpilot.w12.tiles import _decode_words, _load_groups, _word_offsets
except ImportError:  # CPU installs without triton
    triton = None


def w12_decode_dense(w12: W12Tensor, out: torch.Tensor | None = None, block_n: int = 32, block_k: int = 256,
                     num_warps: int = 4) -> torch.Tensor:
    """The exact bf16 weight ``[N, K]`` of ``w12`` decoded by a Triton kernel (its records' device).

    Args:
        w12: the encoded weight (records ``[ceil(N/128), ceil(K/64), 12288]`` uint8).
        out: optional bf16 ``[N, K]`` contiguous destination (same device); allocated when None.
        block_n / block_k / num_warps: launch shape (block_n divides 128, block_k a multiple of 64).
    Returns: ``out``, equal bit for bit to :func:`specpilot.w12.format.decode` of ``w12``.
    Raises: W12GemmError on a bad ``out`` or launch shape; RuntimeError without triton.
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    n, k = w12.shape
    if 128 % block_n or block_k % RECORD_COLS:
        raise W12GemmError(f"block_n must divide 128 and block_k be a multiple of {RECORD_COLS}")
    rec = w12.records
    if out is None:
        out = torch.empty((n, k), dtype=torch.bfloat16, device=rec.device)
    elif out.shape != (n, k) or out.dtype != torch.bfloat16 or not out.is_contiguous() or out.device != rec.device:
        raise W12GemmError(f"out must be a contiguous bf16 [{n}, {k}] tensor on {rec.device}")
    k_pad = rec.shape[1] * RECORD_COLS
    _w12_dense_kernel[(triton.cdiv(n, block_n), triton.cdiv(k_pad, block_k))](
        rec.view(torch.int64), rec.view(torch.int32), w12.base, out, n, k, k_pad, BLOCK_N=block_n, BLOCK_K=block_k,
        ASM=rec.is_cuda, num_warps=num_warps)
    if w12.esc_idx.numel():
        out.view(torch.int16).view(-1)[w12.esc_idx.long()] = w12.esc_val  # exact escapes over saturated codes
    return out


if triton is not None:

    @triton.jit
    def _w12_dense_kernel(RecV, RecQ, Base, Out, N, K, K_PAD, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          ASM: tl.constexpr):
        """Grid ``(cdiv(N, BLOCK_N), cdiv(K_PAD, BLOCK_K))``: one ``[BLOCK_N, BLOCK_K]`` tile of the weight,
        decoded from record words and stored as bf16 (rows past N and columns past K are not stored)."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        kb = tl.program_id(1) * BLOCK_K
        n_ok = offs_n < N
        row_v, row_q, rg, col_v, col_q = _word_offsets(tl.program_id(0) * BLOCK_N, BLOCK_N, K_PAD, BLOCK_K)
        vw, qw = _load_groups(RecV, RecQ, kb, K_PAD, row_v, row_q, rg, col_v, col_q, False)
        w = _decode_words(vw, qw, ASM)  # float32 w' [BLOCK_N, BLOCK_K]
        base = tl.load(Base + offs_n, mask=n_ok, other=112).to(tl.int32)
        w = w * ((base + 15) << 23).to(tl.float32, bitcast=True)[:, None]  # 2^(B_n − 112): exact for normals
        offs_k = kb + tl.arange(0, BLOCK_K)
        tl.store(Out + offs_n[:, None] * K + offs_k[None, :], w.to(tl.bfloat16),
                 mask=n_ok[:, None] & (offs_k < K)[None, :])


__all__ = ["w12_decode_dense"]
