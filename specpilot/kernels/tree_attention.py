"""Tree attention over a static KV cache: the committed prefix ``[0, L)`` plus the R verified rows.

One layer, one request. Row r (root = row 0, then the draft-tree nodes) attends to every committed slot
``[0, L)`` and to the tree slots ``L + c`` with ``tree_mask[r, c]`` (its ancestors and itself); the rows'
K/V are already written at ``[L, L + R)`` (paper §4.2, tree verification; DESIGN.md "Tree verification").

- :func:`tree_attention_reference`: plain PyTorch, float32 softmax; the oracle.
- :func:`tree_attention`: Triton, flash-attention style (Dao et al. 2022, online softmax over KV blocks,
  fp32 accumulators) with a split-KV "flash-decoding" variant (Dao et al. 2023) and a fixed-order combine
  (no atomics: bitwise deterministic for fixed shapes). ``L`` is read from a device tensor, so one CUDA
  graph replays for every prefix length; only slots ``[0, L + R)`` are read. One program serves one KV
  head and its group of G query heads, packed into the M dimension of the tile as ``m = r * G + g``, so
  K/V are read once per group and tensor cores are used even at R = 1. The tree mask travels bit-packed
  (:func:`pack_tree_mask`), the tree slots in blocks of 32, one mask word per row.
- :func:`attention`: Triton on CUDA, the reference elsewhere.

A row with no allowed slot at all (only possible at ``L = 0`` with an all-False mask row) returns zeros.
"""

from __future__ import annotations

import functools
import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: the reference still works
    triton = None

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)


def _check(q, k_cache, v_cache, tree_mask, packed_ok=False):
    """Shape checks shared by both paths; returns ``(R, H, D, S, KVH)``. Raises ValueError."""
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(f"want q [R, H, D], k/v [S, KVH, D]; got {tuple(q.shape)}, {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    r, h, d = q.shape
    s, kvh, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"head_dim of q ({d}) != head_dim of the cache ({dk})")
    if h % kvh != 0:
        raise ValueError(f"n_heads {h} is not a multiple of n_kv_heads {kvh}")
    if tuple(tree_mask.shape) != (r, r) or tree_mask.dtype != torch.bool:
        if not (packed_ok and tree_mask.dtype == torch.int32 and tuple(tree_mask.shape) == (r, -(-r // 32))):
            raise ValueError(f"tree_mask must be bool [{r}, {r}]" + (" or packed int32" if packed_ok else "")
                             + f", got {tree_mask.dtype} {tuple(tree_mask.shape)}")
    if r > s:
        raise ValueError(f"{r} rows do not fit a cache of {s} slots")
    return r, h, d, s, kvh


def pack_tree_mask(tree_mask: torch.Tensor) -> torch.Tensor:
    """Bit-pack ``[R, R]`` bool into ``[R, ceil(R / 32)]`` int32: bit j of word w of row r = mask[r, 32w + j].

    :func:`tree_attention` packs a bool mask itself; pack once per step and pass the words to skip that in
    every layer. Graph-capturable (torch ops only).
    """
    r = tree_mask.shape[0]
    w = -(-r // 32)
    m = torch.nn.functional.pad(tree_mask, (0, 32 * w - r)).view(r, w, 32).to(torch.int64)
    words = (m << torch.arange(32, device=tree_mask.device)).sum(-1)
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)


def tree_attention_reference(q, k_cache, v_cache, prefix_len, tree_mask, scale):
    """Reference tree attention in plain PyTorch (float32 math).

    Args:
        q: ``[R, H, D]`` bf16 / fp16 / fp32, the rows' queries (RoPE applied).
        k_cache, v_cache: ``[S, KVH, D]``, one layer's cache; slots ``[prefix_len, prefix_len + R)`` hold
            the rows' own K/V.
        prefix_len: int or 0-d integer tensor ``L``, committed slots (``L + R <= S``).
        tree_mask: ``[R, R]`` bool, ``tree_mask[r, c]`` = row r may attend row c (ancestor-or-self).
        scale: softmax scale (usually ``D ** -0.5``).
    Returns:
        ``[R, H, D]`` in q's dtype. Head h reads KV head ``h // (H // KVH)``; a row with no allowed slot
        gives zeros.
    Raises:
        ValueError: bad shapes, H % KVH != 0, or ``L + R > S``.
    """
    r, h, d, s, kvh = _check(q, k_cache, v_cache, tree_mask)
    n = int(prefix_len) + r
    if n > s:
        raise ValueError(f"prefix_len + R = {n} exceeds the cache ({s} slots)")
    g = h // kvh
    k = k_cache[:n].float().repeat_interleave(g, dim=1)  # [N, H, D]
    v = v_cache[:n].float().repeat_interleave(g, dim=1)
    scores = torch.einsum("rhd,nhd->hrn", q.float(), k) * scale
    allowed = torch.cat([torch.ones(r, n - r, dtype=torch.bool, device=q.device), tree_mask.to(q.device)], dim=1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows -> zeros
    return torch.einsum("hrn,nhd->rhd", p, v).to(q.dtype)


def attention(q, k_cache, v_cache, prefix_len, tree_mask, scale):
    """Dispatch: :func:`tree_attention` on CUDA (when triton is installed and D is supported), else the
    reference. Same arguments, shapes and errors as :func:`tree_attention_reference`."""
    if q.is_cuda and triton is not None and q.shape[-1] in SUPPORTED_HEAD_DIMS:
        if not torch.is_tensor(prefix_len):
            prefix_len = torch.tensor(prefix_len, dtype=torch.int32, device=q.device)
        return tree_attention(q, k_cache, v_cache, prefix_len, tree_mask, scale)
    return tree_attention_reference(q, k_cache, v_cache, prefix_len, tree_mask, scale)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return 132  # H200 SXM; only used to size splits
    return torch.cuda.get_device_properties(device_index).multi_processor_count


#: the split-KV combine unrolls its loop over the splits when each thread then holds at most this many float32
#: partials (one row of Qwen3-8B, 17 splits: 68 with 4 warps, 254 registers and no spill on sm_90a; 2 rows and up
#: spilled 4–45 KB when always unrolled; offline ptxas, ``tests/test_tree_attention.py``)
COMBINE_UNROLL_PER_THREAD = 80


def default_config(r: int, g: int, kvh: int, s: int, d: int, num_sms: int = 132) -> dict:
    """Launch parameters for ``r`` rows, group ``g``, ``kvh`` KV heads, ``s`` cache slots, head_dim ``d``.

    Depends on static shapes only (never on the device-side prefix length), so a captured graph and an
    eager call make the same choice and give bitwise equal results. Defaults aimed at H200 (132 SMs):
    BLOCK_M = packed rows R*G rounded up to 16/32/64; BLOCK_N = 64; split the prefix when the grid fills
    less than half the SMs, with at least 4 KV blocks per split when the cache is full.
    """
    m = r * g
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64
    programs = -(-m // block_m) * kvh
    splits = 1
    if 2 * programs < num_sms:
        max_blocks = -(-max(s - r, 0) // block_n)
        splits = max(1, min(-(-num_sms // programs), max_blocks // 4, 32))
    return dict(block_m=block_m, block_n=block_n, num_splits=splits, num_warps=4,
                num_stages=3 if d <= 64 else 2)


def combine_config(m: int, block_m: int, d: int, splits: int, num_warps: int) -> dict:
    """Launch of the split-KV combine for ``m`` packed rows (rows x group): ``block_m`` no more than the rows there
    are (one row x 4 heads: 4, not the forward's 16); its loop over the ``splits`` partials ``unroll``-ed when each
    thread then holds at most :data:`COMBINE_UNROLL_PER_THREAD` float32 partials, with 8 warps instead of
    ``num_warps`` if that makes them fit; rolled, 8 warps when a 4-warp program would hold more than 32 floats of
    accumulator a thread (64 rows x 128 spilled). Static shapes only (graphs and eager agree)."""
    bmc = min(block_m, triton.next_power_of_2(m))
    per = bmc * d * splits  # float32 partials a program holds when its loop over the splits is unrolled
    for warps in (num_warps, max(num_warps, 8)):
        if per <= COMBINE_UNROLL_PER_THREAD * 32 * warps:
            return dict(block_m=bmc, num_warps=warps, unroll=True)
    # rolled: the accumulator and one split's partial; more than 32 floats a thread each spilled (64 x 128, 4 warps)
    return dict(block_m=bmc, num_warps=num_warps if bmc * d <= 32 * 32 * num_warps else max(num_warps, 8), unroll=False)


def tree_attention(q, k_cache, v_cache, prefix_len, tree_mask, scale, *, block_m=None, block_n=None,
                   num_splits=None, num_warps=None, num_stages=None):
    """Triton tree attention; reads only KV slots ``[0, prefix_len + R)``.

    Args:
        q: ``[R, H, D]`` bf16 / fp16 / fp32 (last dim contiguous), D in 16/32/64/128 (64 and 128 are the
            ones that matter; 16 exists for interpreter tests).
        k_cache, v_cache: ``[S, KVH, D]`` same dtype as q, last dim contiguous (a ``cache.k[layer]`` view).
        prefix_len: 0-d int32/int64 tensor on q's device, ``L``; read on the device (graph-replayable).
            The caller guarantees ``L + R <= S`` (not checked: checking would synchronize); loads past S
            are masked off anyway.
        tree_mask: ``[R, R]`` bool on q's device (ancestor-or-self; padded rows should at least see
            themselves, else at ``L = 0`` they return zeros), or its :func:`pack_tree_mask` words.
        scale: softmax scale.
        block_m, block_n, num_splits, num_warps, num_stages: overrides of :func:`default_config`
            (tests); ``num_splits > 1`` splits ``[0, L)`` into that many chunks (the last one also takes
            the tree slots) and combines them in fixed order.
    Returns:
        ``[R, H, D]`` in q's dtype; fp32 accumulation; p is cast to the V dtype for the P·V product
        (bf16/fp16), fp32 inputs use IEEE fp32 dots (no TF32).
    Raises:
        ValueError: bad shapes, H % KVH != 0, unsupported head_dim, dtype mismatch.
        RuntimeError: triton not installed.
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    r, h, d, s, kvh = _check(q, k_cache, v_cache, tree_mask, packed_ok=True)
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {d} not supported (supported: {SUPPORTED_HEAD_DIMS})")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"dtype mismatch: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last dim")
    if (not torch.is_tensor(prefix_len) or prefix_len.numel() != 1 or prefix_len.is_floating_point()
            or prefix_len.device != q.device or tree_mask.device != q.device):
        raise ValueError("prefix_len (0-d integer tensor) and tree_mask must be on q's device")
    g = h // kvh
    cfg = default_config(r, g, kvh, s, d, _num_sms(q.device.index if q.is_cuda else None))
    for key, val in dict(block_m=block_m, block_n=block_n, num_splits=num_splits, num_warps=num_warps,
                         num_stages=num_stages).items():
        if val is not None:
            cfg[key] = val
    m = r * g
    bm, bn, splits = cfg["block_m"], cfg["block_n"], cfg["num_splits"]
    out = torch.empty_like(q)
    tm = pack_tree_mask(tree_mask) if tree_mask.dtype == torch.bool else tree_mask.contiguous()
    qk_scale = float(scale) * 1.4426950408889634  # log2(e): the kernel uses exp2
    if splits > 1:
        part_acc = torch.empty((splits, kvh, m, d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((2, splits, kvh, m), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    grid = (triton.cdiv(m, bm), kvh, splits)
    _tree_attn_fwd[grid](
        q, k_cache, v_cache, prefix_len.reshape(()), tm, out, part_acc, part_ml,
        qk_scale, r, s, kvh,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), tm.stride(0),
        G=g, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, NUM_SPLITS=splits, FP32=q.dtype == torch.float32,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if splits > 1:
        c = combine_config(m, bm, d, splits, cfg["num_warps"])
        _combine[(triton.cdiv(m, c["block_m"]), kvh)](
            part_acc, part_ml, out, r, kvh, out.stride(0), out.stride(1),
            G=g, HEAD_DIM=d, BLOCK_M=c["block_m"], NUM_SPLITS=splits, UNROLL=c["unroll"], num_warps=c["num_warps"],
        )
    return out


if triton is not None:

    @triton.jit
    def _attend(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, start_n, hi, tm_base, stride_tm, L,
                row, m_ok, qk_scale, offs_d, BLOCK_N: tl.constexpr, TREE: tl.constexpr, FP32: tl.constexpr):
        """One KV block ``[start_n, start_n + BLOCK_N)`` (slots >= hi masked) of the online softmax.

        TREE: BLOCK_N is 32 and the block starts at a multiple of 32 past L, so the packed mask gives one
        int32 word per row (a [BM, BN] tile of mask pointers spills registers at BLOCK_M 64, D 128)."""
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        sc, v = _block_scores(q, k_base, v_base, stride_ks, stride_vs, offs_n, n_ok, offs_d, qk_scale, FP32=FP32)
        if TREE:
            word = tl.load(tm_base + row * stride_tm + (start_n - L) // 32, mask=m_ok, other=0)
            bit = (word[:, None] >> tl.arange(0, BLOCK_N)[None, :]) & 1
            ok = (bit != 0) & n_ok[None, :]
        else:
            ok = n_ok[None, :]
        return _online_update(acc, m_i, l_i, sc, ok, v, FP32=FP32)

    @triton.jit
    def _block_scores(q, k_base, v_base, stride_ks, stride_vs, offs_n, n_ok, offs_d, qk_scale, FP32: tl.constexpr):
        """The keys ``offs_n`` (``n_ok`` loaded, others zero): scaled scores ``q k^T`` ``[BM, BN]`` and the values."""
        k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        if FP32:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        return sc * qk_scale, v

    @triton.jit
    def _online_update(acc, m_i, l_i, sc, ok, v, FP32: tl.constexpr):
        """One block of the online softmax over the keys ``ok`` allows (a masked key adds an exact zero)."""
        sc = tl.where(ok, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: avoid -inf - -inf
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(sc - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if FP32:
            acc += tl.dot(p, v, input_precision="ieee")
        else:
            acc += tl.dot(p.to(v.dtype), v)
        return acc, m_new, l_i

    @triton.jit
    def _tree_attn_fwd(Q, K, V, PrefixLen, TreeMask, Out, PartAcc, PartML, qk_scale, R, S, KVH,
                       stride_qr, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_or, stride_oh,
                       stride_tm, G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, FP32: tl.constexpr):
        """Grid ``(cdiv(R*G, BLOCK_M), KVH, NUM_SPLITS)``: packed rows ``m = r*G + g`` of one KV head.
        TreeMask: the packed words ``[R, ceil(R/32)]`` int32."""
        pid_m = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        M = R * G
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        row = offs_m // G
        head = kvh * G + offs_m % G
        m_ok = offs_m < M
        q = tl.load(Q + row[:, None] * stride_qr + head[:, None] * stride_qh + offs_d[None, :],
                    mask=m_ok[:, None], other=0.0)
        L = tl.load(PrefixLen).to(tl.int32)
        k_base = K + kvh * stride_kh
        v_base = V + kvh * stride_vh
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        # committed prefix: this split's chunk of [0, L), whole blocks of BLOCK_N
        per_split = tl.cdiv(tl.cdiv(L, BLOCK_N), NUM_SPLITS) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(tl.minimum(lo + per_split, L), S)
        for start_n in range(lo, hi, BLOCK_N):
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, start_n, hi,
                                    TreeMask, stride_tm, L, row, m_ok, qk_scale, offs_d,
                                    BLOCK_N=BLOCK_N, TREE=False, FP32=FP32)
        # tree slots [L, L + R) with the ancestor mask: last split only
        t_hi = tl.minimum(tl.where(split == NUM_SPLITS - 1, L + R, L), S)
        for start_n in range(L, t_hi, 32):
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, start_n, t_hi,
                                    TreeMask, stride_tm, L, row, m_ok, qk_scale, offs_d,
                                    BLOCK_N=32, TREE=True, FP32=FP32)
        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(Out + row[:, None] * stride_or + head[:, None] * stride_oh + offs_d[None, :],
                     out.to(Out.dtype.element_ty), mask=m_ok[:, None])
        else:
            base = (split * KVH + kvh) * M + offs_m
            tl.store(PartAcc + base[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=m_ok[:, None])
            tl.store(PartML + base, m_i, mask=m_ok)
            tl.store(PartML + NUM_SPLITS * KVH * M + base, l_i, mask=m_ok)

    @triton.jit
    def _merge_split(acc, l_sum, PartAcc, PartML, sp, kvh, KVH, M, offs_m, offs_d, m_ok, m_use,
                     HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
        """Add split ``sp``'s partial (acc, l), rescaled to the common max ``m_use``, to ``acc [BLOCK_M, HEAD_DIM]``
        and ``l_sum [BLOCK_M]``."""
        base = (sp * KVH + kvh) * M + offs_m
        m_s = tl.load(PartML + base, mask=m_ok, other=float("-inf"))
        l_s = tl.load(PartML + NUM_SPLITS * KVH * M + base, mask=m_ok, other=0.0)
        a_s = tl.load(PartAcc + base[:, None] * HEAD_DIM + offs_d[None, :], mask=m_ok[:, None], other=0.0)
        w = tl.exp2(m_s - m_use)
        return acc + a_s * w[:, None], l_sum + l_s * w

    @triton.jit
    def _combine(PartAcc, PartML, Out, R, KVH, stride_or, stride_oh, G: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr, UNROLL: tl.constexpr):
        """Merge the splits' (acc, m, l) in split order (deterministic): grid ``(cdiv(R*G, BLOCK_M), KVH)``. The
        loop over the splits' maxima is unrolled (``static_range``), and the loop over their partials too when
        ``UNROLL`` (the host's choice: the unrolled partials fit in registers), so their loads issue together: as
        plain loops, 2 x 17 dependent L2 round trips made this kernel 5.5 µs a call at one row on the H200, more
        than the attention; unrolled at every row count it spilled from 2 rows on. Same sum, same order either way."""
        pid_m = tl.program_id(0)
        kvh = tl.program_id(1)
        M = R * G
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        m_ok = offs_m < M
        m_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        if UNROLL:
            for sp in tl.static_range(NUM_SPLITS):
                m_max = tl.maximum(m_max, tl.load(PartML + (sp * KVH + kvh) * M + offs_m, mask=m_ok,
                                                  other=float("-inf")))
        else:
            for sp in range(NUM_SPLITS):
                m_max = tl.maximum(m_max, tl.load(PartML + (sp * KVH + kvh) * M + offs_m, mask=m_ok,
                                                  other=float("-inf")))
        m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        if UNROLL:
            for sp in tl.static_range(NUM_SPLITS):
                acc, l_sum = _merge_split(acc, l_sum, PartAcc, PartML, sp, kvh, KVH, M, offs_m, offs_d, m_ok, m_use,
                                          HEAD_DIM, NUM_SPLITS)
        else:
            for sp in range(NUM_SPLITS):
                acc, l_sum = _merge_split(acc, l_sum, PartAcc, PartML, sp, kvh, KVH, M, offs_m, offs_d, m_ok, m_use,
                                          HEAD_DIM, NUM_SPLITS)
        out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
        row = offs_m // G
        head = kvh * G + offs_m % G
        tl.store(Out + row[:, None] * stride_or + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=m_ok[:, None])
