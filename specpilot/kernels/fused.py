"""Fused elementwise kernels of a decoder layer: one launch where plain PyTorch takes 5–25.

At one verification row an 8B model's exact pass is ~1000 tiny kernels when written op by op (float32
RMSNorm = cast, square, mean, add, rsqrt, mul, cast, mul; RoPE = neg, cat, 2 mul, add per tensor; K/V
stores), about 3 ms of a 9 ms step on an H200. Three kernels replace them:

- :func:`add_rmsnorm`: ``x += delta`` (the residual add) then RMSNorm, one program per row.
- :func:`qk_norm_rope_store`: split the fused qkv output, Qwen3's per-head q/k RMSNorm, RoPE on q and k,
  K and V stored into the cache at slots ``start + r`` (``start`` read on the device, graph-replayable), or
  for a batched pass at each row's own (pool slot, position), read on the device too.
- :func:`silu_mul`: ``silu(gate) * up`` of the fused gate_up output.

Each rounds where Hugging Face's op-by-op bf16 code rounds (the normalised value before the weight
multiply, each RoPE product, silu before the product), so the fused pass stays within one bf16 rounding
of the reference per op; in float32 the kernels equal the references up to float32 reassociation.
The ``*_reference`` functions are the plain PyTorch definitions the kernels are tested against
(``tests/test_fused.py``; Triton interpreter on the CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: the references still work
    triton = None


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: ``weight * (x * rsqrt(mean(x²) + eps))`` computed in float32, normalised value
    cast to x's dtype before the weight multiply. ``x [..., D]``, ``weight [D]`` -> x's shape and dtype."""
    dt = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dt)


def add_rmsnorm_reference(x, delta, weight, eps):
    """``(rmsnorm(x + delta), x + delta)``; ``delta`` None means no add. ``x, delta [R, D]``."""
    if delta is not None:
        x = x + delta
    return rmsnorm_reference(x, weight, eps), x


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [R, H, D]`` by ``cos, sin [R, D]`` (HF's rotate-half convention, in x's dtype)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None, :] + torch.cat((-x2, x1), dim=-1) * sin[:, None, :]


def qk_norm_rope_store_reference(qkv, q_norm_w, k_norm_w, cos, sin, k_cache, v_cache, start, n_heads,
                                 n_kv_heads, eps, rows=None):
    """Reference of :func:`qk_norm_rope_store`; writes ``k_cache / v_cache [start : start + R]``, or with ``rows``
    each row ``r`` at ``[rows[0][r], rows[1][r]]`` of a pool layer.

    Args:
        qkv: ``[R, (H + 2 KVH) D]``, the fused projection's output (q heads, then k heads, then v heads).
        q_norm_w, k_norm_w: ``[D]`` per-head RMSNorm weights (Qwen3), or None (llama / qwen2).
        cos, sin: ``[R, D]`` in qkv's dtype (see ``Transformer.rope``).
        k_cache, v_cache: ``[S, KVH, D]``, one layer of the cache; with ``rows`` ``[N, S, KVH, D]``, one layer of
            a :class:`~specpilot.model.cache.KVPool` (``pool.k[:, layer]``).
        start: int or 0-d long tensor, the first slot of the rows (ignored with ``rows``).
        rows: None, or ``(slot, pos)``, ``[R] long`` each: the pool slot and position of each row's K/V.
    Returns: ``q [R, H, D]`` (normed, rotated).
    """
    r = qkv.shape[0]
    d = k_cache.shape[-1]
    q, k, v = qkv.split([n_heads * d, n_kv_heads * d, n_kv_heads * d], dim=-1)
    q, k, v = q.reshape(r, n_heads, d), k.reshape(r, n_kv_heads, d), v.reshape(r, n_kv_heads, d)
    if q_norm_w is not None:
        q, k = rmsnorm_reference(q, q_norm_w, eps), rmsnorm_reference(k, k_norm_w, eps)
    q, k = rope_reference(q, cos, sin), rope_reference(k, cos, sin)
    if rows is not None:
        k_cache[rows[0], rows[1]] = k
        v_cache[rows[0], rows[1]] = v
        return q
    slots = start + torch.arange(r, device=qkv.device)
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)
    return q


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [R, 2I]`` (gate first) -> ``[R, I]``."""
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u


def _row_block(d: int) -> int:
    return triton.next_power_of_2(d)


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                zero_centred: bool = False):
    """Triton ``(rmsnorm(x + delta), x + delta)`` in one pass over each row; ``zero_centred``: the hybrids' norm,
    ``float32 normed · (1 + float(w))`` cast once at the end (:class:`~specpilot.model.hybrid.ZeroCentredRMSNorm`;
    ``weight`` then of any float dtype), else HF's ``w · normed.to(dtype)``.

    Args:
        x: ``[R, D]`` contiguous, the residual stream (bf16 / fp16 / fp32).
        delta: ``[R, D]`` same dtype, added to x first (the previous block's output), or None.
        weight: ``[D]`` same dtype.
    Returns: ``(normed [R, D], new_x [R, D])``; new_x is x itself when delta is None.
    Raises: ValueError on shape / dtype / layout mismatch.
    """
    if x.dim() != 2 or not x.is_contiguous() or weight.shape != (x.shape[1],) or (
            weight.dtype != x.dtype and not zero_centred):
        raise ValueError(f"want contiguous x [R, D] and weight [D] of one dtype, got {tuple(x.shape)} "
                         f"{x.dtype}, {tuple(weight.shape)} {weight.dtype}")
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype or not delta.is_contiguous()):
        raise ValueError(f"delta must match x {tuple(x.shape)} {x.dtype}, got {tuple(delta.shape)} {delta.dtype}")
    r, d = x.shape
    normed = torch.empty_like(x)
    new_x = x if delta is None else torch.empty_like(x)
    _add_rmsnorm_kernel[(r,)](x, x if delta is None else delta, weight, normed, new_x, d, eps,
                              HAS_DELTA=delta is not None, ZERO_CENTRED=zero_centred, BLOCK=_row_block(d),
                              num_warps=8 if d >= 4096 else 4)
    return normed, new_x


def qk_norm_rope_store(qkv, q_norm_w, k_norm_w, cos, sin, k_cache, v_cache, start, n_heads, n_kv_heads, eps,
                       rows=None):
    """Triton version of :func:`qk_norm_rope_store_reference` (same arguments; ``start`` must be a 0-d
    integer tensor on qkv's device, or ``rows`` long tensors there). One program per (row, head) of q, k and v.
    The caller guarantees ``start + R <= S`` or valid ``rows`` (not checked: checking would synchronise).

    Returns: ``q [R, H, D]`` contiguous. Raises: ValueError on shape / dtype / layout mismatch.
    """
    r = qkv.shape[0]
    if rows is not None:
        if k_cache.dim() != 4 or len(rows) != 2 or any(t.shape != (r,) or t.device != qkv.device for t in rows):
            raise ValueError(f"rows want a pool layer [N, S, KVH, D] and two [{r}] tensors on qkv's device")
        row_slot, row_pos = rows
        stride_cn = k_cache.stride(0)
        k_cache, v_cache = k_cache[0], v_cache[0]  # base pointers; each row adds slot * stride_cn
        start = row_slot
    else:
        row_pos, stride_cn = qkv, 0
    s, kvh, d = k_cache.shape
    if (qkv.dim() != 2 or qkv.shape[1] != (n_heads + 2 * n_kv_heads) * d or kvh != n_kv_heads
            or not qkv.is_contiguous() or cos.shape != (r, d) or sin.shape != (r, d)
            or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride() or k_cache.dtype != qkv.dtype
            or d & (d - 1)):
        raise ValueError(f"qk_norm_rope_store: bad shapes qkv {tuple(qkv.shape)}, cache {tuple(k_cache.shape)}, "
                         f"cos {tuple(cos.shape)}, heads {n_heads}/{n_kv_heads}")
    if rows is None and (not torch.is_tensor(start) or start.numel() != 1 or start.device != qkv.device):
        raise ValueError("start must be a 0-d integer tensor on qkv's device")
    q = torch.empty((r, n_heads, d), dtype=qkv.dtype, device=qkv.device)
    norm = q_norm_w is not None
    _qk_norm_rope_store_kernel[(r, n_heads + 2 * n_kv_heads)](
        qkv, q_norm_w if norm else qkv, k_norm_w if norm else qkv, cos.contiguous(), sin.contiguous(),
        k_cache, v_cache, start.reshape(-1), row_pos, q, qkv.stride(0), stride_cn, k_cache.stride(0), k_cache.stride(1),
        eps, H=n_heads, KVH=n_kv_heads, D=d, NORM=norm, ROWS=rows is not None, num_warps=1 if d <= 64 else 2)
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton ``silu(gate) * up`` for contiguous ``gate_up [R, 2I]`` -> ``[R, I]``. Raises ValueError."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.is_contiguous():
        raise ValueError(f"want contiguous gate_up [R, 2I], got {tuple(gate_up.shape)}")
    r, two_i = gate_up.shape
    i = two_i // 2
    out = torch.empty((r, i), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(r, triton.cdiv(i, block))](gate_up, out, i, BLOCK=block, num_warps=4)
    return out


if triton is not None:

    @triton.jit
    def _add_rmsnorm_kernel(X, Delta, W, Normed, NewX, D, eps, HAS_DELTA: tl.constexpr, ZERO_CENTRED: tl.constexpr,
                            BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        ok = offs < D
        x = tl.load(X + row * D + offs, mask=ok, other=0.0)
        if HAS_DELTA:
            x = x + tl.load(Delta + row * D + offs, mask=ok, other=0.0)  # rounded to the dtype: HF's bf16 add
            tl.store(NewX + row * D + offs, x, mask=ok)
        xf = x.to(tl.float32)
        rstd = rms_rstd(tl.sum(xf * xf, 0), D, eps)
        w = tl.load(W + offs, mask=ok, other=0.0)
        if ZERO_CENTRED:
            tl.store(Normed + row * D + offs, (xf * rstd * (1.0 + w.to(tl.float32))).to(x.dtype), mask=ok)
        else:
            tl.store(Normed + row * D + offs, rmsnorm_values(x, w, rstd), mask=ok)

    @triton.jit
    def rms_rstd(sum_sq, D, eps):
        """``1 / sqrt(sum_sq / D + eps)`` in float32: RMSNorm's scale from a row's float32 sum of squares. The one
        definition :func:`add_rmsnorm` and the W12 GEMV's fused norm (:mod:`specpilot.w12.norm`) share."""
        return 1.0 / tl.sqrt(sum_sq / D + eps)

    @triton.jit
    def rmsnorm_values(x, w, rstd):
        """``w · (x · rstd)`` of loaded values ``x`` (any shape, the activation dtype) and weights ``w`` (same
        shape, same dtype), rounded where HF rounds: the normalised value in float32 cast to the dtype, then the
        weight product in the dtype (what :func:`add_rmsnorm` stores; shared with the W12 GEMV's fused norm)."""
        y = (x.to(tl.float32) * rstd).to(x.dtype)
        return (w * y).to(x.dtype)

    @triton.jit
    def _rmsnorm_head(x, W, offs, eps, D: tl.constexpr):
        xf = x.to(tl.float32)
        return rmsnorm_values(x, tl.load(W + offs), rms_rstd(tl.sum(xf * xf, 0), D, eps))

    @triton.jit
    def _rope(x, xr, cos, sin, offs, D: tl.constexpr):
        """HF rotate-half: ``x * cos + cat(-x2, x1) * sin``, each product rounded to the dtype."""
        rot = tl.where(offs < D // 2, -xr, xr)
        return ((x * cos).to(x.dtype) + (rot * sin).to(x.dtype)).to(x.dtype)

    @triton.jit
    def _qk_norm_rope_store_kernel(QKV, QW, KW, Cos, Sin, KC, VC, Start, Pos, Q, stride_qkv, stride_cn, stride_cs,
                                   stride_ch, eps, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                                   NORM: tl.constexpr, ROWS: tl.constexpr):
        """``ROWS``: ``Start`` holds each row's pool slot and ``Pos`` its position; else the rows go to
        ``Start[0] + row`` of one cache layer."""
        row = tl.program_id(0)
        head = tl.program_id(1)  # q heads [0, H), k heads [H, H + KVH), v heads after
        offs = tl.arange(0, D)
        half = (offs + D // 2) % D  # partner lane of rotate-half
        base = QKV + row * stride_qkv + head * D
        x = tl.load(base + offs)
        if ROWS:
            dest = tl.load(Start + row).to(tl.int64) * stride_cn + tl.load(Pos + row).to(tl.int64) * stride_cs
        else:
            dest = (tl.load(Start).to(tl.int64) + row) * stride_cs
        if head < H + KVH:
            xr = tl.load(base + half)
            if NORM:  # xr is the same head, permuted: same rstd
                if head < H:
                    x, xr = _rmsnorm_head(x, QW, offs, eps, D), _rmsnorm_head(xr, QW, half, eps, D)
                else:
                    x, xr = _rmsnorm_head(x, KW, offs, eps, D), _rmsnorm_head(xr, KW, half, eps, D)
            cos = tl.load(Cos + row * D + offs)
            sin = tl.load(Sin + row * D + offs)
            y = _rope(x, xr, cos, sin, offs, D)
            if head < H:
                tl.store(Q + (row * H + head) * D + offs, y)
            else:
                tl.store(KC + dest + (head - H) * stride_ch + offs, y)
        else:
            tl.store(VC + dest + (head - H - KVH) * stride_ch + offs, x)

    @triton.jit
    def _silu_mul_kernel(GU, Out, I, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < I
        g = tl.load(GU + row * 2 * I + offs, mask=ok, other=0.0)
        u = tl.load(GU + row * 2 * I + I + offs, mask=ok, other=0.0)
        tl.store(Out + row * I + offs, silu_mul_values(g, u), mask=ok)

    @triton.jit
    def silu_mul_values(g, u):
        """``silu(g) * u`` of loaded gate / up values (any shape, one dtype), rounded where HF rounds: silu in
        float32, cast to the dtype, then the product in the dtype. The one definition :func:`silu_mul` and the W12
        GEMV's fused SwiGLU load (:mod:`specpilot.w12.swiglu`) share, so both give the same bits."""
        gf = g.to(tl.float32)
        s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        return (s * u).to(g.dtype)
