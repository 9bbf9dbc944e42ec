"""The first W12 tensor-core kernel: records loaded byte by byte (``w12_gemm(..., words=False)``, §4.1).

It follows :mod:`specpilot.kernels.gemm` (tile N, split K, pad the rows to one tensor-core tile, fp32 accumulators,
a fixed-order split-K sum) but loads W12 records (:mod:`specpilot.w12.format`) instead of bf16 weights:

* a program owns ``BLOCK_N`` (16/32/64/128) rows of one 128-row record band and walks its K chunk ``BLOCK_K`` (a
  multiple of 64, i.e. whole records) at a time; per step it loads the rows' 8-bit views (``64`` contiguous bytes per
  row and record) and packed nibbles (``32`` bytes per row and record);
* it rebuilds the bf16 bits in registers, ``sign << 15 | (B_n + offset) << 7 | view_mant3 << 4 | nibble``, and feeds
  ``tl.dot`` (bf16 operands on the GPU; in float32 when the activations are float32, which is how the Triton
  interpreter tests it on the CPU: bf16 values are exact in float32);
* padded columns (``K`` up to a multiple of 64) hold finite codes and meet activations masked to 0; padded rows
  (``N`` up to a multiple of 128) are never stored;
* split 0 adds the escapes, then the split-K sum and the bias (:mod:`specpilot.w12.epilogue`; two launches with
  split K: this kernel has no in-kernel sum).

The record-word kernel (:mod:`specpilot.w12.mma`, the default) replaced it: 1.0–1.2x faster on the H200 at 16–256
rows (``results/w12_dense_probe_h200_2026-11-30.json``). Kept as the ``words=False`` override and a reference
point for offline compiles (its PTX loads weights with ``ld.global.b8``). Rounding: the bound of
:mod:`specpilot.w12.gemm`.
"""

from __future__ import annotations

import torch

from specpilot.w12.epilogue import _outputs, _sum_splits
from specpilot.w12.format import RECORD_COLS, W12Tensor

try:
    import triton
    import triton.language as tl

    from specpilot.w12.epilogue import _add_escapes, _escapes_load, _split_end
except ImportError:  # CPU installs without triton
    triton = None

#: runtime arguments of :func:`_w12_gemm_kernel` and their Triton types with bf16 activations, for offline compiles
#: (:mod:`specpilot.kernels.resources`)
BYTE_KERNEL_SIGNATURE = {"X": "*bf16", "Rec": "*u8", "Base": "*u8", "Bias": "*bf16", "Out": "*bf16", "Part": "*fp32",
                         "RowPtr": "*i32", "EscK": "*i32", "EscD": "*fp32", "M": "i32", "N": "i32", "K": "i32",
                         "K_PAD": "i32", "stride_xm": "i32", "K_PER_SPLIT": "i32"}


def w12_mma_bytes(x: torch.Tensor, w12: W12Tensor, bias: torch.Tensor | None, escapes, cfg: dict) -> torch.Tensor:
    """``x [M, K] @ W12ᵀ (+ bias)`` with the byte-loading kernel; called by :func:`~specpilot.w12.gemm.w12_gemm`
    (which checks shapes, dtypes, devices, the launch shape and ``escapes``, its escape table) with ``cfg`` its
    :func:`~specpilot.w12.launch.default_config` plus overrides (block_m / block_n / block_k / split_k / num_warps /
    num_stages / w_left). Returns ``[M, N]`` in x's dtype (float32 accumulation). Raises nothing of its own."""
    row_ptr, esc_k, esc_d = escapes
    m, k = x.shape
    n = w12.shape[0]
    bm, bn, bk, split = cfg["block_m"], cfg["block_n"], cfg["block_k"], cfg["split_k"]
    kt = w12.records.shape[1]
    k_pad = kt * RECORD_COLS
    k_per_split = triton.cdiv(triton.cdiv(k_pad, split), bk) * bk
    even = k_per_split * split == k_pad
    out, part, b = _outputs(x, n, split, bias)
    _w12_gemm_kernel[(triton.cdiv(n, bn), split, triton.cdiv(m, bm))](
        x, w12.records, w12.base, b, out, part, row_ptr, esc_k, esc_d, m, n, k, k_pad, x.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, K_PER_SPLIT=k_per_split, SPLIT_K=split, EVEN=even,
        HAS_BIAS=bias is not None, FP32=x.dtype == torch.float32, W_LEFT=bool(cfg["w_left"]),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return _sum_splits(part, out, b, split, bias is not None)


if triton is not None:

    @triton.jit
    def _decode_tile(v, p, base7, FP32: tl.constexpr):
        """Views ``v [BN, BK]`` and packed nibbles ``p [BN, BK/2]`` (uint8), ``base7 [BN]`` = ``B_n << 7``
        -> the weights ``[BN, BK]`` (float32 if FP32, else bf16), bit-exact codes."""
        vi = v.to(tl.int32)
        pi = p.to(tl.int32)
        nib = tl.interleave(pi & 15, pi >> 4)  # column 2c from the low nibble, 2c + 1 from the high one
        bits = ((vi & 0x80) << 8) | (((vi & 0x7F) << 4) + base7[:, None]) | nib
        if FP32:  # one return: compiled Triton rejects a constexpr branch's early return of another dtype
            w = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            w = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return w

    @triton.jit
    def _w12_gemm_kernel(X, Rec, Base, Bias, Out, Part, RowPtr, EscK, EscD, M, N, K, K_PAD, stride_xm,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PER_SPLIT,
                         SPLIT_K: tl.constexpr, EVEN: tl.constexpr, HAS_BIAS: tl.constexpr, FP32: tl.constexpr,
                         W_LEFT: tl.constexpr):
        """Grid ``(cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, BLOCK_M))``: BLOCK_N rows of one record band, one K
        chunk (K_PER_SPLIT, a multiple of BLOCK_K), BLOCK_M activation rows. ``W_LEFT``: ``acc [BN, BM] =
        W xᵀ`` (the weights as the left MMA operand), else ``acc [BM, BN] = x Wᵀ``."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        band_bytes = (K_PAD // 64) * 12288
        row_v = (offs_n // 128) * band_bytes + (offs_n % 128) * 64  # the row's views in the band's record 0
        row_p = (offs_n // 128) * band_bytes + 8192 + (offs_n % 128) * 32
        base7 = tl.load(Base + offs_n, mask=n_ok, other=127).to(tl.int32) << 7
        rk = tl.arange(0, BLOCK_K)
        rk2 = tl.arange(0, BLOCK_K // 2)
        col_v = (rk // 64) * 12288 + rk % 64
        col_p = (rk2 // 32) * 12288 + rk2 % 32
        k0 = pid_k * K_PER_SPLIT
        sk, sd, lo, cnt = _escapes_load(RowPtr, EscK, EscD, offs_n, n_ok & (pid_k == 0))
        if W_LEFT:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kk in range(0, K_PER_SPLIT, BLOCK_K):
            kb = k0 + kk
            offs_k = kb + rk
            a = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=m_ok[:, None] & (offs_k < K)[None, :], other=0.0)
            rec = Rec + (kb // 64) * 12288
            if EVEN:
                v = tl.load(rec + row_v[:, None] + col_v[None, :])
                p = tl.load(rec + row_p[:, None] + col_p[None, :])
            else:
                v = tl.load(rec + row_v[:, None] + col_v[None, :], mask=(offs_k < K_PAD)[None, :], other=0)
                p = tl.load(rec + row_p[:, None] + col_p[None, :], mask=(kb + 2 * rk2 < K_PAD)[None, :], other=0)
            w = _decode_tile(v, p, base7, FP32)
            if FP32:
                if W_LEFT:
                    acc += tl.dot(w, tl.trans(a), input_precision="ieee")
                else:
                    acc += tl.dot(a, tl.trans(w), input_precision="ieee")
            else:
                if W_LEFT:
                    acc += tl.dot(w, tl.trans(a))
                else:
                    acc += tl.dot(a, tl.trans(w))
        if W_LEFT:
            dst = offs_m[None, :] * N + offs_n[:, None]
            ok = n_ok[:, None] & m_ok[None, :]
        else:
            dst = offs_m[:, None] * N + offs_n[None, :]
            ok = m_ok[:, None] & n_ok[None, :]
        if pid_k == 0:
            acc = _add_escapes(acc, X, stride_xm, EscK, EscD, sk, sd, lo, cnt, offs_m, m_ok, W_LEFT)
        _split_end(acc, Part, Part, Bias, Out, M, N, offs_n, n_ok, dst, ok, pid_k, SPLIT_K, False, HAS_BIAS, W_LEFT)


__all__ = ["w12_mma_bytes", "BYTE_KERNEL_SIGNATURE"]
