"""Tree attention for a batched exact pass: every request's rows over its own slot of the KV pool, one launch.

One layer. Request ``b`` owns pool slot ``slot[b]``; its ``count[b]`` rows sit at ``row_off[b]`` of the packed
``q [R, H, D]`` and their K/V are already written at ``[start[b], start[b] + count[b])`` of its slot. Each row
attends to its request's committed slots ``[0, start[b])`` and to the request's rows its packed mask allows (the
ancestor-or-self mask of a tree, lower-triangular for a prompt or chain): :mod:`specpilot.model.batch`'s rows in
one kernel (§2.2, §4.4; the per-request flash-attention loop of :mod:`specpilot.kernels.tree_attention`, with the
request as a grid axis). Starts, counts, offsets and slots are read on the device, so one CUDA graph per
(requests, rows) bucket can replay any step.

- :func:`batch_tree_attention_reference`: plain PyTorch, float32 softmax, request by request; the oracle.
- :func:`batch_tree_attention`: the Triton kernel; grid ``(row blocks, KV heads, requests)``, fp32 accumulators,
  no split-KV (a batch of requests fills the GPU by itself), deterministic.

Aligned to AR: the keys are walked in ``BLOCK_N`` blocks aligned to absolute positions (0, 64, 128, ...), the
request's own rows inside the same blocks as its committed keys, masked rather than moved to a loop of their own.
A row whose visible keys are exactly the positions below it (an AR row, a chain row, a prompt row; a tree row on
the path whose slots are its positions) then runs the very loads, products and sums an AR row at its position runs
(a masked key adds an exact zero), so with batch-invariant GEMMs a chain's accepted rows carry AR's bits in bf16 too,
and a prompt prefilled after a reused prefix gets the bits of its whole prefill. Rows elsewhere in a tree see their
ancestors at other lanes than AR would, so their bits may differ at near ties (the output stays the exact pass's).
"""

from __future__ import annotations

import torch

from specpilot.kernels.tree_attention import tree_attention_reference, triton

if triton is not None:  # CPU installs without triton: the reference and the mask packing still work
    import triton.language as tl

    from specpilot.kernels.tree_attention import _attend, _block_scores, _online_update


def pack_batch_masks(masks: torch.Tensor) -> torch.Tensor:
    """``[B, R_max, R_max]`` bool -> ``[B, R_max, ceil(R_max / 32)]`` int32 words, bit j of word w of a row = column
    32w + j (:func:`~specpilot.kernels.tree_attention.pack_tree_mask`'s layout, per request). Graph-capturable."""
    b, r, _ = masks.shape
    w = -(-r // 32)
    m = torch.nn.functional.pad(masks, (0, 32 * w - r)).view(b, r, w, 32).to(torch.int64)
    words = (m << torch.arange(32, device=masks.device)).sum(-1)
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)


def batch_tree_attention_reference(q, k_pool, v_pool, slots, starts, counts, row_off, masks, scale):
    """Reference: :func:`~specpilot.kernels.tree_attention.tree_attention_reference` request by request.

    Args:
        q: ``[R, H, D]`` packed rows of every request.
        k_pool, v_pool: ``[N, S, KVH, D]``, one layer of the pool (``pool.k[:, layer]``).
        slots / starts / counts / row_off: ``[B]`` integer tensors (or lists): each request's slot, committed
            slots, rows and first row in ``q``.
        masks: ``[B, R_max, R_max]`` bool, each request's mask among its rows (top-left ``count[b]`` square used).
        scale: softmax scale.
    Returns:
        ``[R, H, D]`` in q's dtype (rows that belong to no request stay zero).
    """
    out = torch.zeros_like(q)
    for s, l, c, o, m in zip(*(torch.as_tensor(x).tolist() for x in (slots, starts, counts, row_off)), masks):
        out[o:o + c] = tree_attention_reference(q[o:o + c], k_pool[s], v_pool[s], l, m[:c, :c].cpu().to(q.device),
                                                scale)
    return out


def batch_tree_attention(q, k_pool, v_pool, slots, starts, counts, row_off, mask_words, r_max: int, scale,
                         block_m: int = 32, block_n: int = 64, num_warps: int = 4) -> torch.Tensor:
    """Triton batched tree attention (module doc); same arguments as the reference, with the masks packed
    (:func:`pack_batch_masks`, ``[B, r_max, W]`` int32) and the integer tensors ``[B]`` int32 on q's device.

    Raises:
        ValueError: shapes or dtypes that do not fit; RuntimeError: triton not installed.
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    if q.dim() != 3 or k_pool.dim() != 4 or v_pool.shape != k_pool.shape or k_pool.shape[-1] != q.shape[-1]:
        raise ValueError(f"want q [R, H, D], pools [N, S, KVH, D]; got {tuple(q.shape)}, {tuple(k_pool.shape)}")
    h, d = q.shape[1], q.shape[2]
    kvh = k_pool.shape[2]
    if h % kvh or d not in (16, 32, 64, 128) or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise ValueError(f"unsupported heads / head_dim / dtypes: H {h}, KVH {kvh}, D {d}, {q.dtype}, {k_pool.dtype}")
    if block_n not in (16, 32, 64):  # a block then spans at most three mask words (_attend_straddle)
        raise ValueError(f"block_n must be 16, 32 or 64, got {block_n}")
    b = slots.numel()
    if mask_words.shape[:2] != (b, r_max) or mask_words.dtype != torch.int32:
        raise ValueError(f"mask words must be int32 [{b}, {r_max}, W], got {mask_words.dtype} {tuple(mask_words.shape)}")
    g = h // kvh
    out = torch.zeros_like(q)
    grid = (triton.cdiv(r_max * g, block_m), kvh, b)
    _batch_tree_attn_fwd[grid](
        q, k_pool, v_pool, slots, starts, counts, row_off, mask_words, out, float(scale) * 1.4426950408889634,
        k_pool.shape[1], q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), out.stride(0), out.stride(1), mask_words.stride(0),
        mask_words.stride(1), mask_words.shape[2], G=g, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, FP32=q.dtype == torch.float32,
        num_warps=num_warps)
    return out


if triton is not None:

    @triton.jit
    def _attend_straddle(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, start_n, hi, tm_base, stride_tm, NW,
                         L, row, m_ok, qk_scale, offs_d, BLOCK_N: tl.constexpr, FP32: tl.constexpr):
        """One KV block ``[start_n, start_n + BLOCK_N)`` at or past ``L``'s aligned block: key ``n < L`` visible, key
        ``n >= L`` visible where bit ``n - L`` of the row's packed mask is set, ``n >= hi`` masked. The arithmetic is
        :func:`_attend`'s (only which keys count differs), so a masked key changes no bit of the running sums."""
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        sc, v = _block_scores(q, k_base, v_base, stride_ks, stride_vs, offs_n, n_ok, offs_d, qk_scale, FP32=FP32)
        t = offs_n - L  # the key's index among the request's rows (negative: a committed key)
        w0 = tl.maximum(start_n - L, 0) // 32  # a block of BLOCK_N <= 64 keys covers at most 3 mask words
        words = tm_base + row * stride_tm
        a0 = tl.load(words + w0, mask=m_ok & (w0 < NW), other=0)
        a1 = tl.load(words + w0 + 1, mask=m_ok & (w0 + 1 < NW), other=0)
        a2 = tl.load(words + w0 + 2, mask=m_ok & (w0 + 2 < NW), other=0)
        tc = tl.maximum(t, 0)
        wi = (tc // 32 - w0)[None, :]
        word = tl.where(wi == 0, a0[:, None], tl.where(wi == 1, a1[:, None], a2[:, None]))
        bit = (word >> (tc % 32)[None, :]) & 1
        ok = ((t < 0)[None, :] | (bit != 0)) & n_ok[None, :]
        return _online_update(acc, m_i, l_i, sc, ok, v, FP32=FP32)

    @triton.jit
    def _batch_tree_attn_fwd(Q, K, V, Slots, Starts, Counts, RowOff, Words, Out, qk_scale, S, stride_qr, stride_qh,
                             stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh, stride_or, stride_oh,
                             stride_wb, stride_wr, NW, G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, FP32: tl.constexpr):
        """Grid ``(cdiv(R_max * G, BLOCK_M), KVH, B)``: packed rows ``m = r * G + g`` of one KV head of one request."""
        pid_m = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        slot = tl.load(Slots + b).to(tl.int64)
        L = tl.load(Starts + b).to(tl.int32)
        R = tl.load(Counts + b).to(tl.int32)
        off = tl.load(RowOff + b).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        row = offs_m // G
        head = kvh * G + offs_m % G
        m_ok = offs_m < R * G
        q = tl.load(Q + (off + row)[:, None] * stride_qr + head[:, None] * stride_qh + offs_d[None, :],
                    mask=m_ok[:, None], other=0.0)
        k_base = K + slot * stride_kn + kvh * stride_kh
        v_base = V + slot * stride_vn + kvh * stride_vh
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        # Keys in blocks aligned to absolute positions: [0, L') without a mask, L' = L rounded down to BLOCK_N, then
        # [L', L + R) through the packed mask (committed keys below L always visible). So a chain row at position p
        # walks the same blocks, lanes and arithmetic as an AR row at p (module doc: "Aligned to AR").
        lo = tl.minimum((L // BLOCK_N) * BLOCK_N, S)
        t_hi = tl.minimum(L + R, S)
        # a program past the request's rows (the grid spans r_max rows: a plan's largest tree, while an AR step has
        # one) walks no keys; it stored nothing before either, but walked them all
        idle = pid_m * BLOCK_M >= R * G
        lo = tl.where(idle, 0, lo)
        t_hi = tl.where(idle, lo, t_hi)
        for start_n in range(0, lo, BLOCK_N):
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, start_n, lo,
                                    Words + b * stride_wb, stride_wr, L, row, m_ok, qk_scale, offs_d,
                                    BLOCK_N=BLOCK_N, TREE=False, FP32=FP32)
        for start_n in range(lo, t_hi, BLOCK_N):
            acc, m_i, l_i = _attend_straddle(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, start_n, t_hi,
                                             Words + b * stride_wb, stride_wr, NW, L, row, m_ok, qk_scale, offs_d,
                                             BLOCK_N=BLOCK_N, FP32=FP32)
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(Out + (off + row)[:, None] * stride_or + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(Out.dtype.element_ty), mask=m_ok[:, None])
