"""Fused glue of a hybrid target's static verify pass (§4.2): three kernels where plain PyTorch launches ~50 a layer.

At a Qwen3.5-27B-like shape on an H200 the static pass spent ~12.5 ms of its 27.5 ms in ~4,000 small kernels (copies,
dtype casts, multiplies, the RMS norms' means; docs/hybrid.md, "Where the excess goes"), most of them the per-layer
glue between the GEMMs. These kernels replace that glue in :mod:`specpilot.model.hybrid_static` when the cache runs
the GDN kernels:

- :func:`gdn_premix`: from the fused input projection's ``mixed, b, a`` columns, the depthwise causal conv + SiLU
  along each row's root path (the pass's conv index), the split into q, k, v, the per-head L2 norms (q scaled by
  ``d_k^-½``), key heads repeated for their value heads, and the gates ``β = sigmoid(b)``,
  ``g = −exp(A_log) · softplus(a + dt_bias)``; k, v, g, β and the rows' conv inputs go straight into the pass's
  record (:class:`~specpilot.model.hybrid_static.StaticRecord`), q comes back. One program per (row, key head) and
  (row, value head).
- :func:`gated_rmsnorm`: the GDN output's per-head RMS norm, weight, ``· silu(z)``
  (:class:`~specpilot.model.gdn.GatedRMSNorm`), one program per (row, value head).
- :func:`zc_rmsnorm`: the zero-centred RMS norm of the layer norms
  (:class:`~specpilot.model.hybrid.ZeroCentredRMSNorm`, ``x̂ · (1 + w)``), optionally after the residual add, one
  program per row.

Each rounds where its reference (the ``*_reference`` functions, the model's own op order) rounds: to the model dtype
after each conv product, the conv sum, the SiLU, ``sigmoid(b)``, the normalised GDN output and its weight product;
everything else in float32. In float32 the kernels equal the references up to float32 reassociation (sums, rsqrt;
``tests/test_hybrid_glue.py``, Triton's interpreter on the CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl

    from specpilot.kernels.fused import add_rmsnorm, rms_rstd, rmsnorm_values
except ImportError:  # CPU installs without triton: the references still work
    triton = None


def gdn_premix_reference(mixed, window, conv_idx, conv_weight, b, a, a_log, dt_bias, hk: int, dk: int):
    """The GDN layer's step inputs from its projections, as :class:`~specpilot.model.gdn.GatedDeltaNet` computes them
    (:meth:`~specpilot.model.gdn.GatedDeltaNet.inputs`' gates, :meth:`conv`, :meth:`qkv`).

    Args:
        mixed: ``[R, C]`` the conv inputs (model dtype), ``C = 2 hk dk + H d_v``; window: ``[K − 1, C]`` the
            committed conv inputs; conv_idx: ``[R, K] long`` into ``cat(window, mixed)``, each row's root path oldest
            first (:func:`~specpilot.model.hybrid_static.conv_index_on_device`); conv_weight: ``[C, 1, K]``;
        b, a: ``[R, H]`` model dtype (gate projections); a_log, dt_bias: ``[H]``; hk / dk: key heads and their dim.
    Returns:
        ``(q, k [R, H, dk], v [R, H, d_v], g, beta [R, H])``, all float32.
    """
    r, h = b.shape
    beta = b.sigmoid().float()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    seq = torch.cat((window.to(mixed.dtype), mixed))
    conv = F.silu((seq[conv_idx] * conv_weight[:, 0, :].t()[None]).sum(1))
    q, k, v = conv.float().split([hk * dk, hk * dk, conv.shape[1] - 2 * hk * dk], dim=-1)
    q = q.reshape(r, hk, dk).repeat_interleave(h // hk, dim=1)
    k = k.reshape(r, hk, dk).repeat_interleave(h // hk, dim=1)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) / dk**0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q, k, v.reshape(r, h, -1), g, beta


def gated_rmsnorm_reference(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`~specpilot.model.gdn.GatedRMSNorm` of the GDN output cast to the model dtype: ``o [R, H, d_v]``
    float32, ``z [R, H, d_v]`` model dtype, ``weight [d_v]`` -> ``[R, H · d_v]`` in ``z``'s dtype."""
    dt = z.dtype
    h = o.to(dt).float()
    h = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dt)
    return (h * F.silu(z.float())).to(dt).reshape(o.shape[0], -1)


def zc_rmsnorm_reference(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """``(zero-centred rmsnorm(x + delta), x + delta)`` (:class:`~specpilot.model.hybrid.ZeroCentredRMSNorm`: float32,
    ``· (1 + w)``, cast at the end); ``delta`` None means no add. ``x, delta [R, D]``, ``weight [D]``."""
    if delta is not None:
        x = x + delta
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype), x


def _rows(t: torch.Tensor, name: str, r: int, width: int) -> int:
    """Row stride of a ``[R, width]`` view with unit column stride (a column slice of a fused projection's output).
    Raises ValueError."""
    if t.dim() != 2 or t.shape != (r, width) or t.stride(1) != 1:
        raise ValueError(f"{name} must be [{r}, {width}] with unit column stride, got {tuple(t.shape)} "
                         f"strides {t.stride()}")
    return t.stride(0)


def gdn_premix(mixed, window, conv_idx, conv_weight, b, a, a_log, dt_bias, hk: int, dk: int,
               k_out, v_out, g_out, beta_out, mixed_out) -> torch.Tensor:
    """Triton :func:`gdn_premix_reference` in one launch, writing k, v, g, β and the conv inputs in place.

    Args:
        mixed, b, a: ``[R, C]``, ``[R, H]``, ``[R, H]`` model dtype, unit column stride (column views of one fused
            projection's output are fine); window, conv_idx, conv_weight, a_log, dt_bias, hk, dk: as the reference
            (``d_k``, ``d_v`` powers of two, ``K ≥ 2``).
        k_out ``[R, H, dk]``, v_out ``[R, H, d_v]``, g_out, beta_out ``[R, H]``: contiguous float32, written;
        mixed_out: ``[R, C]`` contiguous, model dtype, written with ``mixed`` (the record's conv inputs).
    Returns:
        ``q [R, H, dk]`` float32 contiguous.
    Raises:
        ValueError: shapes, dtypes or layouts that do not fit.
    """
    r, c = mixed.shape
    h, kern = b.shape[1], conv_idx.shape[1]
    dv = (c - 2 * hk * dk) // h
    pow2 = lambda n: n >= 1 and n & (n - 1) == 0  # noqa: E731
    want = {"k_out": (k_out, (r, h, dk)), "v_out": (v_out, (r, h, dv)), "g_out": (g_out, (r, h)),
            "beta_out": (beta_out, (r, h))}
    for name, (t, shape) in want.items():
        if t.shape != shape or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 {shape}, got {t.dtype} {tuple(t.shape)}")
    if (not (pow2(dk) and pow2(dv)) or h % hk or c != 2 * hk * dk + h * dv or kern < 2
            or window.shape != (kern - 1, c) or not window.is_contiguous() or conv_idx.shape != (r, kern)
            or conv_weight.shape != (c, 1, kern) or not conv_weight.is_contiguous() or a_log.shape != (h,)
            or dt_bias.shape != (h,) or mixed_out.shape != (r, c) or not mixed_out.is_contiguous()
            or mixed_out.dtype != mixed.dtype or b.dtype != mixed.dtype or a.dtype != mixed.dtype):
        raise ValueError(f"gdn_premix: bad shapes mixed {tuple(mixed.shape)} {mixed.dtype}, window "
                         f"{tuple(window.shape)}, conv_idx {tuple(conv_idx.shape)}, conv weight "
                         f"{tuple(conv_weight.shape)}, b {tuple(b.shape)}, {hk} key heads of {dk}")
    sm, sb, sa = _rows(mixed, "mixed", r, c), _rows(b, "b", r, h), _rows(a, "a", r, h)
    q = torch.empty((r, h, dk), dtype=torch.float32, device=mixed.device)
    _premix_kernel[(r, hk + h)](mixed, window, conv_idx.contiguous(), conv_weight, b, a, a_log, dt_bias, q, k_out,
                                v_out, g_out, beta_out, mixed_out, sm, sb, sa, dk**0.5, KS=kern, HK=hk, H=h,
                                DK=dk, DV=dv, C=c, REP=h // hk, num_warps=1 if max(dk, dv) <= 64 else 2)
    return q


def gated_rmsnorm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton :func:`gated_rmsnorm_reference`: ``o [R, H, d_v]`` float32 contiguous, ``z [R, H, d_v]`` (unit last
    stride, head stride ``d_v``; a view of a fused projection is fine), ``weight [d_v]`` in ``z``'s dtype ->
    ``[R, H · d_v]`` contiguous in ``z``'s dtype (the out projection's input). Raises ValueError."""
    r, h, dv = o.shape
    if (o.dtype != torch.float32 or not o.is_contiguous() or z.shape != o.shape or z.stride()[1:] != (dv, 1)
            or weight.shape != (dv,) or weight.dtype != z.dtype or dv & (dv - 1)):
        raise ValueError(f"gated_rmsnorm: want float32 o [R, H, d_v] (d_v a power of two), z like it and weight "
                         f"[d_v] in z's dtype; got o {o.dtype} {tuple(o.shape)}, z {z.dtype} {tuple(z.shape)} "
                         f"strides {z.stride()}, weight {weight.dtype} {tuple(weight.shape)}")
    out = torch.empty((r, h * dv), dtype=z.dtype, device=o.device)
    _gated_rmsnorm_kernel[(r, h)](o, z, weight, out, z.stride(0), eps, H=h, DV=dv,
                                  num_warps=1 if dv <= 64 else 2)
    return out


def zc_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """Triton :func:`zc_rmsnorm_reference` in one pass over each row: the dense path's fused add + norm
    (:func:`~specpilot.kernels.fused.add_rmsnorm`) with its zero-centred weight.

    Args:
        x: ``[R, D]`` contiguous (the residual stream); delta: ``[R, D]`` contiguous, same dtype, added to x first
            (the token mixer's output), or None; weight: ``[D]`` (any float dtype: used as ``1 + float(w)``).
    Returns: ``(normed [R, D], new_x [R, D])`` in x's dtype; new_x is x itself when delta is None.
    Raises: ValueError on shape / dtype / layout mismatch.
    """
    return add_rmsnorm(x, delta, weight, eps, zero_centred=True)


if triton is not None:

    @triton.jit
    def _silu(x):
        return x / (1.0 + tl.exp(-x))

    @triton.jit
    def _conv(Mixed, Win, Idx, CW, row, ch, sm, KS: tl.constexpr, C: tl.constexpr):
        """SiLU of the depthwise causal conv of channels ``ch`` at ``row``: each product and the sum rounded to the
        model dtype as the reference's ``(seq[idx] * w).sum(1)`` is, SiLU in float32 then rounded; float32 out."""
        acc = tl.zeros(ch.shape, dtype=tl.float32)
        for t in tl.static_range(KS):
            i = tl.load(Idx + row * KS + t)  # < KS − 1: a committed window entry, else a row of mixed
            xw = tl.load(Win + tl.minimum(i, KS - 2) * C + ch)
            xm = tl.load(Mixed + tl.maximum(i - (KS - 1), 0) * sm + ch)
            x = tl.where(i < KS - 1, xw.to(xm.dtype), xm)
            w = tl.load(CW + ch * KS + t)
            acc += (x.to(tl.float32) * w.to(tl.float32)).to(xm.dtype).to(tl.float32)
        dt = Mixed.dtype.element_ty
        return _silu(acc.to(dt).to(tl.float32)).to(dt).to(tl.float32)

    @triton.jit
    def _softplus(x):
        """torch's softplus (threshold 20); log1p(e) as ``log(u) · e / (u − 1)``, ``u = 1 + e`` (exact where
        ``u`` rounds to 1), so tiny ``e`` keeps its relative precision without a libdevice call."""
        e = tl.exp(tl.minimum(x, 20.0))
        u = 1.0 + e
        lp = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
        return tl.where(x > 20.0, x, lp)

    @triton.jit
    def _key_head(Mixed, Win, Idx, CW, MixOut, Out, row, ch, sm, q_div, KS: tl.constexpr, C: tl.constexpr,
                  H: tl.constexpr, DK: tl.constexpr, REP: tl.constexpr, head, IS_Q: tl.constexpr):
        """One key head's q (``IS_Q``) or k: its conv inputs recorded, conv, L2 norm (q also ``/ √d_k``), stored for
        each of the head's value heads."""
        tl.store(MixOut + row * C + ch, tl.load(Mixed + row * sm + ch))
        x = _conv(Mixed, Win, Idx, CW, row, ch, sm, KS, C)
        x = x * (1.0 / tl.sqrt(tl.sum(x * x, 0) + 1e-6))
        if IS_Q:
            x = x / q_div
        offs = tl.arange(0, DK)
        for j in tl.static_range(REP):
            tl.store(Out + (row * H + head * REP + j) * DK + offs, x)

    @triton.jit
    def _premix_kernel(Mixed, Win, Idx, CW, B, A, ALog, DtB, Q, K, V, G, Beta, MixOut, sm, sb, sa, q_div,
                       KS: tl.constexpr, HK: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       C: tl.constexpr, REP: tl.constexpr):
        """Program ``(row, head)``: heads ``[0, HK)`` are key heads (q and k, written to their ``REP = H / HK``
        value heads), heads ``[HK, HK + H)`` value heads (v, g, β)."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        dt = Mixed.dtype.element_ty
        if head < HK:
            # Triton's compiler merges a name bound in both branches of an `if` and needs one type for it (the
            # interpreter does not check): the key and value channel ranges keep their own names (DK != DV).
            kch = head * DK + tl.arange(0, DK)
            _key_head(Mixed, Win, Idx, CW, MixOut, Q, row, kch, sm, q_div, KS, C, H, DK, REP, head, True)
            _key_head(Mixed, Win, Idx, CW, MixOut, K, row, kch + HK * DK, sm, q_div, KS, C, H, DK, REP, head, False)
        else:
            vh = head - HK
            offs = tl.arange(0, DV)
            vch = 2 * HK * DK + vh * DV + offs
            tl.store(MixOut + row * C + vch, tl.load(Mixed + row * sm + vch))
            tl.store(V + (row * H + vh) * DV + offs, _conv(Mixed, Win, Idx, CW, row, vch, sm, KS, C))
            b = tl.load(B + row * sb + vh).to(tl.float32)
            tl.store(Beta + row * H + vh, (1.0 / (1.0 + tl.exp(-b))).to(dt).to(tl.float32))
            a = tl.load(A + row * sa + vh).to(tl.float32) + tl.load(DtB + vh).to(tl.float32)
            tl.store(G + row * H + vh, -tl.exp(tl.load(ALog + vh).to(tl.float32)) * _softplus(a))

    @triton.jit
    def _gated_rmsnorm_kernel(O, Z, W, Out, sz, eps, H: tl.constexpr, DV: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        offs = tl.arange(0, DV)
        dt = Z.dtype.element_ty
        x = tl.load(O + (row * H + head) * DV + offs).to(dt)
        xf = x.to(tl.float32)
        y = rmsnorm_values(x, tl.load(W + offs), rms_rstd(tl.sum(xf * xf, 0), DV, eps))
        z = tl.load(Z + row * sz + head * DV + offs).to(tl.float32)
        tl.store(Out + (row * H + head) * DV + offs, (y.to(tl.float32) * _silu(z)).to(dt))

