"""W12 one-row GEMV with the record words streamed by TMA into a multi-stage shared-memory ring (§4.1, issue 5).

Session 12 located the one-row miss in the load stream: the line-coalesced GEMV
(:func:`~specpilot.kernels.w12_gemv._w12_gemv_lines_kernel`) waits for each K step's words before it decodes them,
so a program of a few steps exposes the memory latency at every step (``bench/w12_access_probe.py``). Here the same
tiles (``[R, BLOCK_N · 8]`` words of R = BLOCK_K / 64 records, the tile's rows contiguous in each record) come from
two 3-D tensor descriptors over the records, ``[bands, records, 1536]`` int64 (views) and ``[bands, records, 3072]``
int32 (nibbles from word 2048), loaded in a ``tl.range`` loop with ``num_stages = STAGES``: Triton's pipeliner issues
the TMA copies of the next ``STAGES − 1`` steps while a step is decoded. Records past a band's end read as zero
words (TMA bounds), whose x is masked to 0, so a ragged last split needs no masks.

``PERSISTENT``: one grid of ``P`` programs walks the ``(tile, split)`` units ``p, p + P, …`` in one flattened
loop over their K steps, so the ring stays full across units (no latency at a program's start but the first).

Decode, x, order of the sum and epilogue are those of the lines kernel (the final reductions run in another
register layout, so the bits can differ within the rounding bound). CUDA (sm_90) only;
the reference is :func:`~specpilot.kernels.w12_gemm.w12_gemm_reference`.
"""

from __future__ import annotations

import torch

from ..w12.format import RECORD_COLS, W12Tensor
from .w12_gemm import W12GemmError, _outputs, _sum_splits, split_locks, triton

if triton is not None:
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .w12_gemm import _w12_split_sum_kernel
    from .w12_gemv import _gemv_store, _lines_sum


def record_descriptors(w12: W12Tensor, block_n: int, block_k: int):
    """Tensor descriptors of ``w12.records`` for a ``[BLOCK_K / 64 records, block_n rows]`` tile: views
    ``[bands, records, 1536]`` int64 with blocks ``[1, R, 8 · block_n]`` and nibbles ``[bands, records, 3072]`` int32
    with blocks ``[1, R, 8 · block_n]`` (a row's 8 view words, then at word 2048 its 8 nibble words)."""
    rec = w12.records
    bands, kt = rec.shape[0], rec.shape[1]
    r = block_k // RECORD_COLS
    v = rec.view(torch.int64).view(bands, kt, 1536)
    q = rec.view(torch.int32).view(bands, kt, 3072)
    return (TensorDescriptor(v, [bands, kt, 1536], [kt * 1536, 1536, 1], [1, r, 8 * block_n]),
            TensorDescriptor(q, [bands, kt, 3072], [kt * 3072, 3072, 1], [1, r, 8 * block_n]))


def w12_gemv_stream(x: torch.Tensor, w12: W12Tensor, bias: torch.Tensor | None, escapes, *, block_n: int = 16,
                    block_k: int = 256, split_k: int = 1, stages: int = 3, num_warps: int = 1, persistent: int = 0,
                    fused_split: bool = True) -> torch.Tensor:
    """``x [1, K] @ W12ᵀ (+ bias)`` through :func:`_w12_gemv_stream_kernel`; ``persistent`` > 0: that many programs
    (else one per (tile, split) unit). Returns ``[1, N]`` in x's dtype. Raises: W12GemmError for more than one row,
    a CPU tensor or bad launch parameters."""
    if x.shape[0] != 1:
        raise W12GemmError(f"the TMA GEMV takes one row, got {x.shape[0]}")
    n, k = w12.shape
    rec = w12.records
    k_pad = rec.shape[1] * RECORD_COLS
    if 128 % block_n or block_k % RECORD_COLS or split_k < 1 or stages < 1:
        raise W12GemmError("stream: block_n must divide 128, block_k be a multiple of 64, split_k, stages >= 1")
    k_per_split = triton.cdiv(triton.cdiv(k_pad, split_k), block_k) * block_k
    tiles = triton.cdiv(n, block_n)
    out, part, b = _outputs(x, n, split_k, bias)
    row_ptr, esc_k, esc_d = escapes
    if persistent:  # partials only (the loop must hold no nested loop to be pipelined); the sum kernel adds the rest
        part = torch.empty((split_k, 1, n), dtype=torch.float32, device=x.device)
        fused_split = False
    lock = split_locks(x.device, tiles) if split_k > 1 and fused_split else None
    fused = lock is not None
    lock = row_ptr if lock is None else lock
    dv, dq = record_descriptors(w12, block_n, block_k)
    units = tiles * split_k
    grid = (min(persistent, units),) if persistent else (tiles, split_k)  # the fused split sum locks by program_id(0)
    _w12_gemv_stream_kernel[grid](
        x, dv, dq, w12.base, b, out, part, lock, row_ptr, esc_k, esc_d, 1, n, k, k_pad, k_per_split, x.stride(0),
        units, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, FUSED=fused, X_EVEN=k_per_split * split_k == k,
        HAS_BIAS=bias is not None, STAGES=stages, PERSISTENT=bool(persistent), ASM=x.is_cuda, num_warps=num_warps)
    if persistent:
        _w12_split_sum_kernel[(triton.cdiv(n, 64), 1)](part, x, b, out, row_ptr, esc_k, esc_d, 1, n, x.stride(0),
                                                       SPLIT_K=split_k, BLOCK_M=16, BLOCK_N=64,
                                                       HAS_BIAS=bias is not None, num_warps=4)
        return out
    return _sum_splits(part, x, b, out, escapes, split_k, bias is not None, fused)


if triton is not None:

    @triton.jit
    def _stream_end(acc, X, Base, Bias, Out, Part, Lock, RowPtr, EscK, EscD, M, N, stride_xm, n0, pid_k,
                    R: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, FUSED: tl.constexpr,
                    HAS_BIAS: tl.constexpr):
        """A unit's end: the lines kernel's reduction and scaling of ``acc [R, BLOCK_N · 8]``, then the GEMV store."""
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        base = tl.load(Base + offs_n, mask=n_ok, other=112).to(tl.int32)
        scale = ((base + 15) << 23).to(tl.float32, bitcast=True)  # 2^(B_n − 112), exact
        y = (tl.sum(tl.sum(tl.reshape(acc, [R, BLOCK_N, 8]), axis=2), axis=0) * scale)[None, :]  # [1, BN]
        offs_m = tl.arange(0, 1)
        _gemv_store(y, X, Bias, Out, Part, Lock, RowPtr, EscK, EscD, M, N, stride_xm, offs_m, offs_n, offs_m < M,
                    n_ok, pid_k, SPLIT_K, FUSED, HAS_BIAS)

    @triton.jit
    def _stream_step(acc, DescV, DescQ, X, n0, kb, K, K_PAD, R: tl.constexpr, BLOCK_N: tl.constexpr,
                     X_EVEN: tl.constexpr, ASM: tl.constexpr):
        """One K step of the lines kernel from the descriptors: ``acc [R, BLOCK_N · 8]`` plus the step's products."""
        J: tl.constexpr = BLOCK_N * 8
        band = n0 // 128
        col = (n0 % 128) * 8
        vw = tl.reshape(DescV.load([band, kb // 64, col]), [R, J])
        qw = tl.reshape(DescQ.load([band, kb // 64, 2048 + col]), [R, J])
        cols = kb + tl.arange(0, R)[:, None] * 64 + tl.arange(0, 64)[None, :]
        if X_EVEN:
            xt = tl.load(X + cols).to(tl.float32)
        else:
            xt = tl.load(X + cols, mask=cols < K, other=0.0).to(tl.float32)
        acc = _lines_sum(acc, vw, qw, xt, R, BLOCK_N, ASM)
        return acc

    @triton.jit
    def _w12_gemv_stream_kernel(X, DescV, DescQ, Base, Bias, Out, Part, Lock, RowPtr, EscK, EscD, M, N, K, K_PAD,
                                K_PER_SPLIT, stride_xm, UNITS, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                SPLIT_K: tl.constexpr, FUSED: tl.constexpr, X_EVEN: tl.constexpr,
                                HAS_BIAS: tl.constexpr, STAGES: tl.constexpr, PERSISTENT: tl.constexpr,
                                ASM: tl.constexpr = True):
        """Units ``u = tile · SPLIT_K + split`` of BLOCK_N rows and K_PER_SPLIT columns; one unit a program (grid
        ``(tiles, SPLIT_K)``), or (PERSISTENT, grid ``(P,)``) units ``pid, pid + P, …`` in one loop of their steps,
        each unit's scaled partial to ``Part [SPLIT_K, 1, N]`` (see the module docstring)."""
        R: tl.constexpr = BLOCK_K // 64
        J: tl.constexpr = BLOCK_N * 8
        acc = tl.zeros([R, J], dtype=tl.float32)
        if PERSISTENT:
            P = tl.num_programs(0)
            steps = K_PER_SPLIT // BLOCK_K
            mine = (UNITS - tl.program_id(0) + P - 1) // P
            for it in tl.range(0, mine * steps, num_stages=STAGES):
                u = tl.program_id(0) + (it // steps) * P
                s = it % steps
                n0 = (u // SPLIT_K) * BLOCK_N
                pid_k = u % SPLIT_K
                if s == 0:
                    acc = tl.zeros([R, J], dtype=tl.float32)
                acc = _stream_step(acc, DescV, DescQ, X, n0, pid_k * K_PER_SPLIT + s * BLOCK_K, K, K_PAD, R, BLOCK_N,
                                   X_EVEN, ASM)
                if s == steps - 1:  # the unit's scaled partial sum; escapes and bias in the sum kernel
                    offs_n = n0 + tl.arange(0, BLOCK_N)
                    n_ok = offs_n < N
                    base = tl.load(Base + offs_n, mask=n_ok, other=112).to(tl.int32)
                    scale = ((base + 15) << 23).to(tl.float32, bitcast=True)
                    y = tl.sum(tl.sum(tl.reshape(acc, [R, BLOCK_N, 8]), axis=2), axis=0) * scale
                    tl.store(Part + pid_k * N + offs_n, y, mask=n_ok)
        else:
            n0 = tl.program_id(0) * BLOCK_N
            pid_k = tl.program_id(1)
            k0 = pid_k * K_PER_SPLIT
            for kk in tl.range(0, K_PER_SPLIT, BLOCK_K, num_stages=STAGES):
                acc = _stream_step(acc, DescV, DescQ, X, n0, k0 + kk, K, K_PAD, R, BLOCK_N, X_EVEN, ASM)
            _stream_end(acc, X, Base, Bias, Out, Part, Lock, RowPtr, EscK, EscD, M, N, stride_xm, n0, pid_k, R,
                        BLOCK_N, SPLIT_K, FUSED, HAS_BIAS)

__all__ = ["w12_gemv_stream", "record_descriptors"]
