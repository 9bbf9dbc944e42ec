"""W12 GEMM on tensor cores from record *words*: ``x [M, K] @ W[N, K]ᵀ`` for 2–256 rows (§4.1).

The first tensor-core kernel (:mod:`~specpilot.w12.mma_bytes`, ``w12_gemm(..., words=False)``) loads the
records byte by byte (128 one-byte global loads a thread per 128-column step compiled for sm_90a,
``probes/ptxas_probe.py``), decodes each weight with an exponent add, and waits for every MMA. This one reads
what the GEMV reads (:mod:`specpilot.w12.tiles`): per row and group of 8 columns a 64-bit word of
views and a 32-bit word of nibbles through ``cp.async``. On the GPU it decodes two weights at once straight
to a bf16 pair in inline PTX (``_decode8_bf16``: ``w' = w · 2^(112 − B_n)``, exact in bf16; without the PTX,
e.g. in the interpreter, the float32 decode of ``_decode8``), lays the 8 columns of each word side by side,
and permutes K on both operands (``_k_order``) so that the decoded words of a thread are exactly its
``wgmma`` register fragment: the tile feeds ``tl.dot`` as the left operand (``acc [BLOCK_N, BLOCK_M] = W'
xᵀ``) with no round trip through shared memory. The epilogue multiplies each output row by the exact power of
two ``2^(B_n − 112)``; split 0 adds the escapes (:func:`~specpilot.w12.epilogue._add_escapes`, their slots
loaded before the K loop), as the first kernel does; split K sums in fixed order, then the bias
(:func:`~specpilot.w12.epilogue._w12_split_sum_kernel`, or in the kernel with ``fused_split``).

Rounding: the bound of :mod:`specpilot.w12.gemm` (a sum over K in another order), plus the GEMV's
caveat (scaling by a power of two commutes with float32 rounding unless a partial sum or product is
subnormal in one scaling and not the other: at most ``2^-149`` an operation). On the H200 with the default
launch: 0.89–1.33x cuBLAS bf16 at 8–32 rows over the Qwen3-8B and -32B projections
(``results/w12_bench_h200_2026-12-01_62845f8.json``).
"""

from __future__ import annotations

import torch

from specpilot.w12.epilogue import _outputs, _sum_splits, split_locks
from specpilot.w12.escapes import W12GemmError
from specpilot.w12.format import RECORD_COLS, RECORD_ROWS, W12Tensor

try:
    import triton
    import triton.language as tl

    from specpilot.w12.epilogue import _add_escapes, _escapes_load, _split_end
    from specpilot.w12.tiles import _decode_words, _decode_words_bf16, _k_columns, _k_order, _load_groups, _word_offsets
except ImportError:  # CPU installs without triton
    triton = None


#: ``x_gather`` default: load the activation tile with its columns in ``_k_order`` (see ``_mma_step``). Off: on
#: the H200 the permuted load (4-byte ``cp.async`` pieces, 19 instead of 7 a step) was 0–16% slower than loading in
#: column order and permuting through shared memory, on every Qwen3-8B projection at 2–128 rows
#: (``results/w12_xgather_probe_h200_2026-12-02_f2fd9b3.json``)
X_GATHER_DEFAULT = False


def w12_mma(x: torch.Tensor, w12: W12Tensor, bias: torch.Tensor | None, escapes, cfg: dict,
            view: bool = False) -> torch.Tensor:
    """``x [M, K] @ W12ᵀ (+ bias)`` on tensor cores from record words; called by
    :func:`~specpilot.w12.gemm.w12_gemm` (which checks shapes, dtypes, devices and ``cfg``: its
    :func:`~specpilot.w12.launch.default_config` plus overrides) with ``escapes`` its escape table.
    ``cfg["asm"]`` (default: on CUDA) selects the inline-PTX decode, ``cfg["x_gather"]`` (default
    :data:`X_GATHER_DEFAULT`) the permuted activation load, ``cfg["esc_early"]`` whether split 0 loads its escape
    slots before the K loop. ``view`` (:func:`~specpilot.w12.view.w12_view_gemm`; ``escapes`` then
    ``escape_table(w12, view=True)``): the 8-bit view (§4.3 Q pass), ``x @ approx_view(w12)ᵀ`` from the view words
    only, every nibble at its midpoint (:func:`~specpilot.w12.tiles._load_groups`). Returns ``[M, N]`` in x's dtype.
    Raises: W12GemmError when BLOCK_K is not a multiple of 64 or BLOCK_N does not divide 128."""
    row_ptr, esc_k, esc_d = escapes
    m, k = x.shape
    n = w12.shape[0]
    bm, bn, bk, split = cfg["block_m"], cfg["block_n"], cfg["block_k"], cfg["split_k"]
    if RECORD_ROWS % bn or bk % RECORD_COLS:
        raise W12GemmError(f"block_n must divide {RECORD_ROWS}, block_k be a multiple of {RECORD_COLS}")
    rec = w12.records
    k_pad = rec.shape[1] * RECORD_COLS
    k_per_split = triton.cdiv(triton.cdiv(k_pad, split), bk) * bk
    out, part, b = _outputs(x, n, split, bias)
    lock = split_locks(x.device, triton.cdiv(n, bn) * triton.cdiv(m, bm)) if split > 1 and cfg.get("fused_split") else None
    fused = lock is not None  # None: not asked, no split, or capturing without counters (the two-kernel sum)
    lock = row_ptr if lock is None else lock
    _w12_mma_kernel[(triton.cdiv(n, bn), split, triton.cdiv(m, bm))](
        x, rec.view(torch.int64), rec.view(torch.int32), w12.base, b, out, part, lock, row_ptr, esc_k, esc_d, m, n,
        k, k_pad, k_per_split, x.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, FUSED=fused,
        EVEN=k_per_split * split == k_pad, X_EVEN=k_per_split * split == k, HAS_BIAS=bias is not None,
        FP32=x.dtype == torch.float32,
        ASM=bool(cfg.get("asm", True)) and x.is_cuda, X_GATHER=bool(cfg.get("x_gather", X_GATHER_DEFAULT)),
        ESC_EARLY=bool(cfg.get("esc_early", False)), VIEW=view,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}))
    return _sum_splits(part, out, b, split, bias is not None, fused)



if triton is not None:

    @triton.jit
    def _mma_step(acc, X, vw, qw, offs_m, m_ok, kb, stride_xm, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, X_EVEN: tl.constexpr, FP32: tl.constexpr, ASM: tl.constexpr,
                  X_GATHER: tl.constexpr = False):
        """One K step of :func:`_w12_mma_kernel`: load X's tile at column ``kb``, decode the words ``vw`` / ``qw``
        and add ``W' xᵀ`` of the step to ``acc [BLOCK_N, BLOCK_M]``. ``X_GATHER``: load X's columns already in
        ``_k_order`` (:func:`~specpilot.w12.tiles._k_columns`) instead of permuting the loaded tile."""
        if X_GATHER:
            offs_k = kb + _k_columns(BLOCK_K)
        else:
            offs_k = kb + tl.arange(0, BLOCK_K)
        if X_EVEN:
            a = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None], other=0.0)
        else:
            a = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=m_ok[:, None] & (offs_k < K)[None, :], other=0.0)
        if ASM and not FP32:
            w = _decode_words_bf16(vw, qw)  # bf16 w' [BLOCK_N, BLOCK_K] straight from the words
        else:
            w = _decode_words(vw, qw, ASM)  # float32 w' (exact in bf16: zero low 16 bits)
        w = _k_order(w, BLOCK_N, BLOCK_K)  # both operands: the same K permutation (see _k_order)
        if not X_GATHER:
            a = _k_order(a, BLOCK_M, BLOCK_K)
        if FP32:
            acc += tl.dot(w, tl.trans(a), input_precision="ieee")
        else:
            acc += tl.dot(w.to(tl.bfloat16), tl.trans(a))
        return acc

    @triton.jit
    def _w12_mma_kernel(X, RecV, RecQ, Base, Bias, Out, Part, Lock, RowPtr, EscK, EscD, M, N, K, K_PAD, K_PER_SPLIT,
                        stride_xm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr, FUSED: tl.constexpr, EVEN: tl.constexpr, X_EVEN: tl.constexpr, HAS_BIAS: tl.constexpr,
                        FP32: tl.constexpr, ASM: tl.constexpr, X_GATHER: tl.constexpr = False,
                        ESC_EARLY: tl.constexpr = True, VIEW: tl.constexpr = False):
        """Grid ``(cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, BLOCK_M))``: BLOCK_N rows of one record band, one K
        chunk, BLOCK_M activation rows; ``acc [BLOCK_N, BLOCK_M] = W' xᵀ`` in float32 (see :func:`w12_mma`).
        ``RecV`` / ``RecQ``: the records as int64 / int32 words. ``X_EVEN``: every split ends inside K, so the
        activation loads need only the row mask (and can be vector loads). ``VIEW``: the 8-bit view, no nibble loads."""
        pid_k = tl.program_id(1)
        offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        row_v, row_q, rg, col_v, col_q = _word_offsets(tl.program_id(0) * BLOCK_N, BLOCK_N, K_PAD, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        if ESC_EARLY:  # loaded now, used after the K loop (registers held through it)
            sk, sd, lo, cnt = _escapes_load(RowPtr, EscK, EscD, offs_n, n_ok & (pid_k == 0))
        k0 = pid_k * K_PER_SPLIT
        k1 = tl.minimum(k0 + K_PER_SPLIT, K_PAD)
        for kk in range(0, K_PER_SPLIT, BLOCK_K):
            kb = k0 + kk
            vw, qw = _load_groups(RecV, RecQ, kb, k1, row_v, row_q, rg, col_v, col_q, EVEN, VIEW)
            acc = _mma_step(acc, X, vw, qw, offs_m, m_ok, kb, stride_xm, K, BLOCK_M, BLOCK_N, BLOCK_K, X_EVEN, FP32, ASM,
                            X_GATHER)
        base = tl.load(Base + offs_n, mask=n_ok, other=112).to(tl.int32)
        acc = acc * ((base + 15) << 23).to(tl.float32, bitcast=True)[:, None]  # 2^(B_n − 112), exact
        dst = offs_m[None, :] * N + offs_n[:, None]
        ok = n_ok[:, None] & m_ok[None, :]
        if not ESC_EARLY:
            sk, sd, lo, cnt = _escapes_load(RowPtr, EscK, EscD, offs_n, n_ok & (pid_k == 0))
        if pid_k == 0:
            acc = _add_escapes(acc, X, stride_xm, EscK, EscD, sk, sd, lo, cnt, offs_m, m_ok, True)
        _split_end(acc, Part, Lock + tl.program_id(2) * tl.num_programs(0) + tl.program_id(0), Bias, Out, M, N, offs_n,
                   n_ok, dst, ok, pid_k, SPLIT_K, FUSED, HAS_BIAS, True)


__all__ = ["w12_mma"]
