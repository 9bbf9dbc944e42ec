"""The residual add and RMSNorm split across the one-row W12 GEMVs around them (§4.1).

At one row a decoder layer's norms are two launches of ``add_rmsnorm`` (``x += delta``, then RMSNorm of x), each
~2 µs on the H200 plus a graph gap, 72 of them in a Qwen3-8B pass. A norm needs the whole row's sum of squares
before any element can be normalised, which is why fusing it into the *producing* GEMV's last program lost
(its serial tail made the o projection + norm 15.4 µs against 12.9 unfused on the H200,
``results/w12_fusion_probe_whole_row_h200_2026-12-02_4453b8e.json``). Here the work is split across the two
GEMVs instead, with no serial tail and no atomics:

- the producer (o, or down: :func:`w12_add_residual`) stores ``residual + y`` instead of ``y``, rounded to the
  dtype as :func:`~specpilot.kernels.fused.add_rmsnorm` rounds its residual add (the same bits), and each output
  tile's program (16 columns: 256 tiles for a 4096-wide row) stores the float32 sum of squares of its tile;
- the consumer (qkv, or gate_up: :func:`w12_norm_in`) sums those tile sums in a fixed order in every program (1 KB
  read from L2), forms the scale with :func:`~specpilot.kernels.fused.rms_rstd`, and normalises its own columns of
  the row in the activation load with :func:`~specpilot.kernels.fused.rmsnorm_values`, the expression
  ``add_rmsnorm`` stores.

So the residual stream is bitwise what ``add_rmsnorm`` gives, and the normalised activations differ from it only
through the sum of squares: the same float32 products, added in another order (tile sums, then the tile sums),
i.e. within float32 reassociation of the scale, which can move a normalised bf16 value by one rounding. Every
program of a launch computes the same scale (the same loads, the same code), and two runs give the same bits.

- :func:`add_fusable` / :func:`norm_fusable`: whether a pass can take each half (one row, a W12 layer routed to the
  one-row GEMV); otherwise the caller runs ``add_rmsnorm`` and the layer as before.
- :func:`w12_add_residual` / :func:`w12_norm_in`: the fused calls.
- :func:`w12_add_residual_reference` / :func:`w12_norm_in_reference`: the plain PyTorch definitions.

The engine takes this path where both halves are fusable and ``Transformer.fuse_norm`` is on (the default; off
measures the unfused step side by side).
"""

from __future__ import annotations

import math

import torch

from specpilot.kernels.fused import silu_mul_reference
from specpilot.w12.escapes import W12GemmError
from specpilot.w12.gemv import w12_gemv
from specpilot.w12.launch import check_overrides
from specpilot.w12.swiglu import _why_not

#: output columns a tile sum of squares covers: the one-row GEMV's BLOCK_N (:func:`~specpilot.w12.gemv.gemv_config`)
TILE = 16


def _why_not_residual(residual, n: int, dtype, device) -> str | None:
    if not isinstance(residual, torch.Tensor):
        return f"the residual is a {type(residual).__name__}, not a tensor"
    if residual.layout != torch.strided or list(residual.shape) != [1, n] or not residual.is_contiguous():
        return f"needs one contiguous dense residual row [1, {n}], got {residual.layout} {list(residual.shape)}"
    if residual.dtype != dtype or residual.device != device:
        return f"the residual is {residual.dtype} on {residual.device}, the activations {dtype} on {device}"
    return None


def add_fusable(x: torch.Tensor, layer: torch.nn.Module, residual: torch.Tensor, glu: bool = False) -> bool:
    """Whether :func:`w12_add_residual` can run: ``layer`` a :class:`~specpilot.w12.linear.W12Linear` ``[N, K]``
    whose kernel runs for this input, ``x`` one contiguous dense row ``[1, K]`` (``glu``: ``gate_up [1, 2K]``) on its
    device (bfloat16 / float32 on CUDA, float32 in the interpreter), one row of that weight routed to the GEMV,
    and ``residual`` one contiguous row ``[1, N]`` of x's dtype and device. Raises nothing."""
    why = _why_not(x, layer, glu)
    if why is None:
        why = _why_not_residual(residual, layer.out_features, x.dtype, x.device)
    return why is None


def norm_fusable(x: torch.Tensor, layer: torch.nn.Module, weight: torch.Tensor) -> bool:
    """Whether :func:`w12_norm_in` can run: as :func:`add_fusable` for ``x [1, K]`` and ``layer``, and ``weight``
    (the norm's) ``[K]`` of x's dtype and device. Raises nothing."""
    return _why_not(x, layer, False) is None and _why_not_weight(weight, x) is None


def _why_not_weight(weight, x) -> str | None:
    k = x.shape[1]
    if not isinstance(weight, torch.Tensor) or list(weight.shape) != [k] or not weight.is_contiguous():
        return f"the norm weight must be one contiguous [{k}] tensor"
    if weight.dtype != x.dtype or weight.device != x.device:
        return f"the norm weight is {weight.dtype} on {weight.device}, the activations {x.dtype} on {x.device}"
    return None


def w12_add_residual(x: torch.Tensor, layer, residual: torch.Tensor, glu: bool = False,
                     **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual + layer(x)`` for one row, with the tile sums of squares the next :func:`w12_norm_in` needs.

    Args:
        x: ``[1, K]`` (``glu``: ``gate_up [1, 2K]``, the layer then multiplies ``silu(gate) · up``,
            :mod:`~specpilot.w12.swiglu`), bf16 / float32 on CUDA, float32 in the interpreter.
        layer: the :class:`~specpilot.w12.linear.W12Linear` ``[N, K]`` (o or down).
        residual: ``[1, N]`` of x's dtype, the residual stream before the add (not modified).
        overrides: the GEMV's launch overrides (block_k, split_k, num_warps, fused_split, asm; not block_n, which
            fixes the tiles of the sums of squares at :data:`TILE`).
    Returns: ``(new_x [1, N]`` in x's dtype, bitwise ``residual + layer(x)`` rounded once to the dtype with the same
        launch shape, ``sq [cdiv(N, 16)]`` float32, the sum of squares of new_x over each 16-column tile).
    Raises: W12GemmError when :func:`add_fusable` is False (naming the failed condition), or on a bad override.
    """
    why = _why_not(x, layer, glu) or _why_not_residual(residual, layer.out_features, x.dtype, x.device)
    if why is not None:
        raise W12GemmError(f"no fused residual add: {why}")
    check_overrides(overrides)
    if overrides.get("block_n") not in (None, TILE):
        raise W12GemmError(f"the fused residual add runs in {TILE}-column tiles (block_n={overrides['block_n']})")
    n = layer.out_features
    sq = torch.empty(-(-n // TILE), dtype=torch.float32, device=x.device)
    out = w12_gemv(x, layer.w12(), layer.bias, layer.escapes(), overrides | {"lines": True, "block_n": TILE}, glu=glu,
                   add=(residual, sq))
    return out, sq


def w12_norm_in(x: torch.Tensor, sq: torch.Tensor, weight: torch.Tensor, eps: float, layer, **overrides) -> torch.Tensor:
    """``layer(rmsnorm(x))`` for one row, the norm's scale formed from the tile sums of squares ``sq``.

    Args:
        x: ``[1, K]`` the residual stream (bf16 / float32 on CUDA, float32 in the interpreter), e.g. ``new_x`` of
            :func:`w12_add_residual`.
        sq: ``[P]`` float32, sums of squares of x's float32 values over tiles that cover the row once (any tiling;
            :func:`w12_add_residual` gives 16-column tiles); summed in a fixed order in the kernel.
        weight: ``[K]`` the norm's weight, x's dtype. eps: the norm's epsilon.
        layer: the :class:`~specpilot.w12.linear.W12Linear` ``[N, K]`` (qkv or gate_up).
        overrides: the GEMV's launch overrides (:func:`~specpilot.w12.gemm.w12_gemm` names).
    Returns: ``[1, N]`` in x's dtype: ``layer`` applied to ``weight · (x · rstd)`` rounded as
        :func:`~specpilot.kernels.fused.add_rmsnorm` rounds it, ``rstd = 1 / sqrt(Σ sq / K + eps)``.
    Raises: W12GemmError when :func:`norm_fusable` is False, ``sq`` is not a 1-D float32 tensor of 1..K tile sums on
        x's device, ``eps`` is not a finite number ≥ 0, or on a bad override.
    """
    why = _why_not(x, layer, False) or _why_not_weight(weight, x)
    if why is None and (not isinstance(sq, torch.Tensor) or sq.layout != torch.strided or sq.dim() != 1
                        or sq.dtype != torch.float32 or sq.device != x.device or not sq.is_contiguous()
                        or not 1 <= sq.numel() <= x.shape[1]):
        why = (f"sq must be a non-empty contiguous 1-D float32 tensor on the activations' device, at most {x.shape[1]} "
               "tile sums (tiles cover the row once)")
    if why is None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps)
                        or eps < 0):
        why = f"eps must be a finite non-negative number, got {eps!r}"
    if why is not None:
        raise W12GemmError(f"no fused norm: {why}")
    check_overrides(overrides)
    return w12_gemv(x, layer.w12(), layer.bias, layer.escapes(), overrides | {"lines": True},
                    norm=(weight, sq, float(eps)))


def w12_add_residual_reference(x: torch.Tensor, layer: torch.nn.Module, residual: torch.Tensor,
                               glu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch :func:`w12_add_residual`: ``new_x = residual + layer(x)`` (``glu``: ``layer(silu(gate) · up)``)
    and ``sq`` the float32 sums of ``new_x²`` over 16-column tiles (zero-padded), ``[1, N]`` and ``[cdiv(N, 16)]``."""
    y = layer(silu_mul_reference(x) if glu else x)
    new_x = residual + y
    f = new_x.float().reshape(-1)
    f = torch.cat([f, f.new_zeros(-f.numel() % TILE)])
    return new_x, (f * f).reshape(-1, TILE).sum(1)


def w12_norm_in_reference(x: torch.Tensor, sq: torch.Tensor, weight: torch.Tensor, eps: float,
                          layer: torch.nn.Module) -> torch.Tensor:
    """Plain PyTorch :func:`w12_norm_in`: ``layer(weight · (x · rstd))``, ``rstd = rsqrt(sq.sum() / K + eps)`` in
    float32, rounded as :func:`~specpilot.kernels.fused.rmsnorm_reference` rounds. ``x [R, K]`` -> ``[R, N]``."""
    rstd = torch.rsqrt(sq.float().sum() / x.shape[-1] + eps)
    return layer(weight * (x.float() * rstd).to(x.dtype))


__all__ = ["add_fusable", "norm_fusable", "w12_add_residual", "w12_norm_in", "w12_add_residual_reference",
           "w12_norm_in_reference", "TILE"]
