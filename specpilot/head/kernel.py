"""Certified INT8 LM head on the device (§4.1): INT8 bounds, survivor selection and exact rescoring in Triton.

The plain PyTorch reference is :class:`specpilot.head.certified.CertifiedInt8Head` (read its
docstring for the bound); this module computes the same certified argmax without a host sync, so it can be
captured in a CUDA graph. One call, for ``h [R, K]`` (the engine's hidden states cast to W's dtype):

1. ``_bounds_kernel`` (grid: vocab blocks x row tiles; reads the int8 copy ``q [V, K]`` once for up to 64
   rows): ``a_v = s_v * (h . q_v)`` with fp32 accumulation (bf16 x int8 products are exact; fp32 inputs use
   IEEE dots), ``E_v = ||h|| c_v`` with ``c_v`` precomputed per vocab row (``||h||``
   bounded from above in the same loop, from the h tiles it loads anyway), and writes ``U_v = a_v + E_v``
   ``[R, V]`` float32 and, per program, ``max_v L_v`` (``L_v = a_v - E_v``) ``[R, NB]``. The fp32 roundings
   of forming L and U are covered by a relative margin of 2^-20 (on E and |a|) and an absolute 2^-100.
2. ``_select_kernel`` (grid: vocab blocks x rows): ``T_r = max L`` from the row's ``[NB]`` block maxima
   (each program re-reads them: a few KB from L2), then keeps the survivors ``U_v >= T_r`` of each row, up to
   a fixed capacity C (slots taken with one atomic add per program: the *set* is deterministic, its order
   in the slots is not, and nothing below depends on the order). The counters were zeroed by stage 1.
3. ``_rescore_kernel`` (one program per row and survivor slot, so the float64 dots run side by side instead
   of one program looping over K for all of a row's survivors: that loop was 48 µs of latency on the H200):
   the survivor's exact logit in float64 (bf16/fp32 products are exact in float64; the float64 sum's error is
   in the enclosure) and its sum of magnitudes, and, in slot 0, ``||h||²`` in float64.
4. ``_decide_kernel`` (one program per row): the enclosure ``[Lo, Hi]`` of the engine's float32 accumulator,
   rounded (monotone, round-to-nearest-even) to the head's output dtype, and the reference's decision rule:
   decided when exactly one survivor has ``Hi >= max Lo`` or every such survivor is known exactly; the token
   is the lowest vocab index among them with ``Lo == max Lo``.

Returns ``(tokens [R] int64, ok [R] bool)``. ``ok`` is False for rows that are undecided (a near-tie within
rounding), whose survivors exceed the capacity, or whose h is non-finite / could overflow; the caller must
take the full head for those rows (:meth:`CertifiedInt8Head.argmax` does, with a host sync;
:meth:`CertifiedInt8Head.argmax_flagged`, the engine's CUDA-graph form, returns ``needs_full_head = ~ok`` with the
tokens). Where ``ok`` is True the token equals ``argmax(F.linear(h, W).float())`` (ties: lowest index), with the
reference's accumulation units (``u_acc = 2^-23`` on CUDA for both the exact head, a float32-reducing GEMM, and this
kernel's fp32 dots; :mod:`specpilot.head.bound`).

CUDA-graph capturable: shapes depend only on R, V, K and C; no host sync; the survivor counter is zeroed
by the bounds kernel. Four launches per call (bounds, select, rescore, decide). fp16 heads are not supported
here (the reference handles them).
"""

from __future__ import annotations

import math

import torch

from specpilot.head.bound import U_OUT, eps, gamma, matmul_units

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton
    triton = None

#: survivors kept per row (rows with more fall back to the full head)
CAPACITY = 32
#: relative / absolute slack on the fp32 evaluation of L and U in the bounds kernel (see module docstring)
_MARGIN, _TINY = 2.0**-20, 2.0**-100


def default_config(r: int) -> dict:
    """Launch parameters of the bounds kernel for ``r`` rows (static shapes only, so graph and eager agree).

    BLOCK_R: rows padded to one tensor-core tile (16/32/64; more rows: several row tiles, q re-read per
    tile). BLOCK_V 128 vocab rows, BLOCK_K 128 per step, 4 warps, 4 stages: the best of the first H200 sweep
    (``results/lm_head_h200_2026-11-30.json``, Qwen3-8B head: certified head 217 µs at 1 row and 345 µs
    at 32 rows with BLOCK_V 128, 290 / 511 µs with 64; bf16 ``F.linear`` + argmax 295 / 312 µs).
    """
    block_r = 16 if r <= 16 else 32 if r <= 32 else 64
    return dict(block_r=block_r, block_v=128, block_k=128, num_warps=4, num_stages=4)


class Int8HeadKernel:
    """Device state of the certified head for the Triton path (§4.1), built from a reference head.

    Args:
        head: a :class:`~specpilot.head.certified.CertifiedInt8Head` (bf16 or fp32 weight; its
            ``q``, ``scale`` and float64 norms are reused, not copied).
        capacity: survivors kept per row (C; a power of two, 16..128).
        overrides: block_r / block_v / block_k / num_warps / num_stages of the bounds kernel (sweeps, tests).
    Raises:
        RuntimeError: triton is not installed.
        ValueError: fp16 weight, or a capacity that is not a power of two in [16, 128].
    """

    def __init__(self, head, capacity: int = CAPACITY, **overrides):
        if triton is None:
            raise RuntimeError("triton is not installed")
        w = head.weight
        if w.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"the Triton certified head takes bf16 or float32 weights, got {w.dtype}")
        if capacity not in (16, 32, 64, 128):
            raise ValueError(f"capacity must be 16, 32, 64 or 128, got {capacity}")
        self.head, self.capacity, self.overrides = head, capacity, overrides
        self.v, self.k = w.shape
        self.last_survivors: torch.Tensor | None = None
        self._units = None
        self._refresh()

    def _refresh(self) -> None:
        """(Re)compute the per-row constants ``c_v`` and the scalar constants for the current matmul units."""
        head, k = self.head, self.k
        units = matmul_units(head.weight)
        if units == self._units:
            return
        u_in, u_acc = units
        eps_a = eps(k, 0.0, 2.0**-23, 2.0**-24)  # this kernel: exact products, fp32 sums, fp32 scale multiply
        eps_x = eps(k, u_in, u_acc, U_OUT[head.weight.dtype])  # the exact head
        coef = (head.res_norm + eps_a * head.scale.double() * head.q_norm + eps_x * head.w_norm) * (1 + 1e-9)
        self.coef = _up32(coef)
        self.eps_r = (eps(k, u_in, u_acc, 0.0) + gamma(k, 2.0**-53) + 1e-9) * (1 + 1e-6)
        self.eta = (k + 2) * 2.0**-125 * 2
        limit = torch.finfo(head.weight.dtype).max / 4
        # rows with ||h||^2 >= this may overflow the exact head (the reference's test, conservative; an fp32
        # kernel argument, so at most 3e38: rows with ||h|| >= 1.7e19 are always flagged)
        nl = min(limit / (float(head.w_norm.max()) * (1 + 1e-6) + 1e-300), 1.7e19)
        self.norm_limit2 = nl * nl * (1 - 1e-6)
        self._units = units

    def bounds(self, h: torch.Tensor, write_a: bool = False, cnt: torch.Tensor | None = None):
        """Stage 1: ``(U [R, V] f32, lmax [R, NB] f32, a, hn)`` for ``h [R, K]``.

        ``U`` / ``L`` enclose the engine's exact logits (module docstring). Only with ``write_a`` (tests):
        ``a [R, V] f32`` the approximate INT8 logits and ``hn [R] f32`` the kernel's upper bound of ``||h||``
        (else None, None). ``cnt`` (``[R] int32``, optional): survivor counters the kernel zeroes for stage 2.
        Raises ValueError on a shape mismatch.
        """
        self._refresh()
        h = self._check(h)
        r = h.shape[0]
        cfg = {**default_config(r), **{k: v for k, v in self.overrides.items() if v is not None}}
        br, bv, bk = cfg["block_r"], cfg["block_v"], cfg["block_k"]
        nb = triton.cdiv(self.v, bv)
        u = torch.empty(r, self.v, dtype=torch.float32, device=h.device)
        lmax = torch.empty(r, nb, dtype=torch.float32, device=h.device)
        a = torch.empty(r, self.v, dtype=torch.float32, device=h.device) if write_a else u
        hn = torch.empty(r, dtype=torch.float32, device=h.device) if write_a else u
        _bounds_kernel[(nb, triton.cdiv(r, br))](
            h, self.head.q, self.head.scale, self.coef, hn, u, lmax, a, u if cnt is None else cnt, r, self.v, nb,
            h.stride(0), self.head.q.stride(0), _MARGIN, _TINY, 1 + self.k * 2.0**-23, K=self.k, BLOCK_R=br,
            BLOCK_V=bv, BLOCK_K=bk, F32_DOT=h.dtype == torch.float32 or _interpreted(), WRITE_A=write_a,
            ZERO_CNT=cnt is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return (u, lmax, a, hn) if write_a else (u, lmax, None, None)

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Certified argmax of ``h [R, K]``: ``(tokens [R] int64, ok [R] bool)`` on h's device (module
        docstring; where ``ok`` is False the token is a guess, a valid vocabulary id). No host sync; 4 launches (bounds, select, rescore, decide). ``last_survivors`` is set to the
        survivor counts ``[R] int32`` (device; above ``capacity`` means overflow). Raises ValueError on a
        shape mismatch."""
        h = self._check(h)
        r, c = h.shape[0], self.capacity
        cnt = torch.empty(r, dtype=torch.int32, device=h.device)
        u, lmax, _, _ = self.bounds(h, cnt=cnt)
        idx = torch.empty(r, c, dtype=torch.int32, device=h.device)
        bs, nb = 1024, lmax.shape[1]
        _select_kernel[(triton.cdiv(self.v, bs), r)](u, lmax, cnt, idx, self.v, nb, C=c, BLOCK_S=bs,
                                                     BLOCK_NB=triton.next_power_of_2(nb), num_warps=4)
        z = torch.empty(r, c, dtype=torch.float64, device=h.device)
        amag = torch.empty_like(z)
        hsq = torch.empty(r, dtype=torch.float64, device=h.device)
        w = self.head.weight
        bk = min(triton.next_power_of_2(self.k), 2048)
        _rescore_kernel[(r, c)](h, w, idx, cnt, z, amag, hsq, h.stride(0), w.stride(0), K=self.k, C=c, BLOCK_K=bk,
                                num_warps=8)
        tok = torch.empty(r, dtype=torch.int64, device=h.device)
        ok = torch.empty(r, dtype=torch.int8, device=h.device)
        _decide_kernel[(r,)](idx, cnt, z, amag, hsq, tok, ok, self.eps_r, self.eta, self.norm_limit2, C=c,
                             ROUND_BF16=w.dtype == torch.bfloat16, num_warps=1)
        self.last_survivors = cnt
        return tok, ok.view(torch.bool)

    def _check(self, h: torch.Tensor) -> torch.Tensor:
        if h.dim() != 2 or h.shape[1] != self.k:
            raise ValueError(f"hidden states must be [R, {self.k}], got {tuple(h.shape)}")
        h = h.to(self.head.weight.dtype)
        return h if h.stride(1) == 1 else h.contiguous()


def _interpreted() -> bool:
    """Whether Triton runs in its interpreter (CPU tests): its bf16 ``tl.dot`` is wrong in Triton 3.6, so the
    bounds kernel then dots in float32 (bf16 x int8 products are exact in float32 either way)."""
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def _up32(x64: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 rounded up (never below ``x64`` for finite positive values)."""
    x = x64.float()
    return torch.where(x.double() < x64, torch.nextafter(x, torch.full_like(x, math.inf)), x)


if triton is not None:

    @triton.jit
    def _bounds_kernel(H, Q, Scale, Coef, Hn, U, Lmax, A, Cnt, R, V, NB, stride_h, stride_q, MARGIN, TINY, HN_REL,
                       K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr,
                       WRITE_A: tl.constexpr, ZERO_CNT: tl.constexpr):
        """Grid ``(cdiv(V, BLOCK_V), cdiv(R, BLOCK_R))``: U and per-program max L of one vocab block; with
        ``ZERO_CNT`` the first vocab block's programs zero the survivor counters ``Cnt [R]`` of stage 2. K (the
        hidden size) is a compile-time constant: one compile per head, static loop bounds."""
        pid_v = tl.program_id(0)
        pid_r = tl.program_id(1)
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        r_ok = rows < R
        v_ok = cols < V
        acc = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float32)
        hsq = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            hb = tl.load(H + rows[:, None] * stride_h + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            qb = tl.load(Q + cols[:, None].to(tl.int64) * stride_q + ks[None, :],
                         mask=v_ok[:, None] & k_ok[None, :], other=0)
            hf = hb.to(tl.float32)
            hsq += tl.sum(hf * hf, axis=1)
            if F32_DOT:
                acc += tl.dot(hb.to(tl.float32), tl.trans(qb.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(hb, tl.trans(qb.to(hb.dtype)))
        s = tl.load(Scale + cols, mask=v_ok, other=0.0)
        c = tl.load(Coef + cols, mask=v_ok, other=0.0)
        # ||h|| bound: the fp32 sum of K squares is within K 2^-24 (relative) of the real one, sqrt_rn adds
        # 2^-24 (HN_REL = 1 + K 2^-23 covers both); squares that underflow or flush lose < K 2^-126 in all,
        # i.e. < sqrt(K) 2^-63 on the norm, covered by the absolute 2e-15 for K < 3e8
        hn = tl.sqrt_rn(hsq) * HN_REL + 2.0e-15
        a = acc * s[None, :]
        e = hn[:, None] * c[None, :]
        e = e + e * MARGIN + tl.abs(a) * MARGIN + TINY
        both = r_ok[:, None] & v_ok[None, :]
        offs = rows[:, None].to(tl.int64) * V + cols[None, :]
        tl.store(U + offs, a + e, mask=both)
        if WRITE_A:
            tl.store(A + offs, a, mask=both)
            tl.store(Hn + rows, hn, mask=r_ok & (pid_v == 0))
        lo = tl.where(both, a - e, float("-inf"))
        tl.store(Lmax + rows * NB + pid_v, tl.max(lo, axis=1), mask=r_ok)
        if ZERO_CNT:
            tl.store(Cnt + rows, tl.zeros([BLOCK_R], dtype=tl.int32), mask=r_ok & (pid_v == 0))

    @triton.jit
    def _select_kernel(U, Lmax, Cnt, Idx, V, NB, C: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_NB: tl.constexpr):
        """Grid ``(cdiv(V, BLOCK_S), R)``: ``T = max Lmax[r, :NB]``; vocab rows with ``U >= T`` go to free slots of
        ``Idx [R, C]``; ``Cnt [R]`` (zero on entry) counts all survivors (also those past the capacity)."""
        pid = tl.program_id(0)
        r = tl.program_id(1)
        bs = tl.arange(0, BLOCK_NB)
        t = tl.max(tl.load(Lmax + r * NB + bs, mask=bs < NB, other=float("-inf")), axis=0)
        cols = pid * BLOCK_S + tl.arange(0, BLOCK_S)
        v_ok = cols < V
        u = tl.load(U + r.to(tl.int64) * V + cols, mask=v_ok, other=float("-inf"))
        keep = (u >= t) & v_ok
        ki = keep.to(tl.int32)
        base = tl.atomic_add(Cnt + r, tl.sum(ki, axis=0))
        pos = base + tl.cumsum(ki, axis=0) - 1
        tl.store(Idx + r * C + pos, cols, mask=keep & (pos < C))

    @triton.jit
    def _round_bf16(x):
        """float32 -> nearest bf16 (ties to even), returned as float32 (as torch rounds a float32 to bf16)."""
        b = x.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        return b.to(tl.float32, bitcast=True)

    @triton.jit
    def _rescore_kernel(H, W, Idx, Cnt, Z, Amag, Hsq, stride_h, stride_w, K: tl.constexpr, C: tl.constexpr,
                        BLOCK_K: tl.constexpr):
        """Grid ``(R, C)``: program ``(r, j)`` computes, for row r's survivor in slot j (if any), its exact
        logit ``Z[r, j] = Σ h_k w_k`` and ``Amag[r, j] = Σ |h_k w_k|`` in float64; slot 0 also writes
        ``Hsq[r] = ||h_r||²`` in float64 (NaN / inf for non-finite h)."""
        r = tl.program_id(0)
        j = tl.program_id(1)
        valid = j < tl.minimum(tl.load(Cnt + r), C)
        need_h = valid | (j == 0)  # an empty slot reads nothing (slot 0 still needs h for ||h||²)
        v = tl.load(Idx + r * C + j, mask=valid, other=0)
        z = tl.zeros([BLOCK_K], dtype=tl.float64)
        amag = tl.zeros([BLOCK_K], dtype=tl.float64)
        hsq = tl.zeros([BLOCK_K], dtype=tl.float64)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            hv = tl.load(H + r * stride_h + ks, mask=k_ok & need_h, other=0.0).to(tl.float32).to(tl.float64)
            wv = tl.load(W + v.to(tl.int64) * stride_w + ks, mask=valid & k_ok, other=0.0).to(tl.float32).to(tl.float64)
            p = wv * hv
            z += p
            amag += tl.abs(p)
            hsq += hv * hv
        tl.store(Z + r * C + j, tl.sum(z, axis=0))
        tl.store(Amag + r * C + j, tl.sum(amag, axis=0))
        tl.store(Hsq + r, tl.sum(hsq, axis=0), mask=j == 0)

    @triton.jit
    def _decide_kernel(Idx, Cnt, Z, Amag, Hsq, Tok, Ok, EPS_R, ETA, NORM_LIMIT2, C: tl.constexpr,
                       ROUND_BF16: tl.constexpr):
        """Grid ``(R,)``: the reference's decision rule on row r's rescored survivors (module docstring)."""
        r = tl.program_id(0)
        n = tl.load(Cnt + r)
        js = tl.arange(0, C)
        valid = js < n
        idx = tl.load(Idx + r * C + js, mask=valid, other=0)
        z = tl.load(Z + r * C + js, mask=valid, other=0.0)
        d = EPS_R * tl.load(Amag + r * C + js, mask=valid, other=0.0) + ETA
        lo = (z - d).to(tl.float32)  # round-to-nearest is monotone and the engine's accumulator is a float32
        hi = (z + d).to(tl.float32)
        if ROUND_BF16:
            lo = _round_bf16(lo)
            hi = _round_bf16(hi)
        lo = tl.where(valid, lo, float("-inf"))
        hi = tl.where(valid, hi, float("-inf"))
        m = tl.max(lo, axis=0)
        cand = valid & (hi >= m)
        ncand = tl.sum(cand.to(tl.int32), axis=0)
        inexact = tl.sum((cand & (lo != hi)).to(tl.int32), axis=0)
        best = cand & (lo == m)
        tok = tl.min(tl.where(best, idx, 2147483647), axis=0)
        tok = tl.where(ncand >= 1, tok, 0)
        hsq_r = tl.load(Hsq + r)
        ok = ((ncand == 1) | (inexact == 0)) & (ncand >= 1) & (n <= C) & (hsq_r == hsq_r) & (hsq_r < NORM_LIMIT2)
        tl.store(Tok + r, tok.to(tl.int64))
        tl.store(Ok + r, ok.to(tl.int8))


__all__ = ["CAPACITY", "Int8HeadKernel", "default_config"]
