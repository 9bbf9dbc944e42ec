"""SwiGLU computed inside the W12 down projection's activation load, at one row (§4.1).

At one row the MLP ends with two launches: ``silu_mul`` (``gate_up [1, 2I]`` -> ``[1, I]``, ~1.2 µs on the H200)
and the down projection's GEMV, which then reads the ``[1, I]`` product back. Owning the W12 GEMV, the engine can
instead hand it ``gate_up`` and let the line-coalesced kernel (:func:`~specpilot.w12.gemv.w12_gemv`,
``glu=True``) compute ``silu(gate) · up`` for each step's columns (and for the escapes' columns in the epilogue)
from the very expression :func:`~specpilot.kernels.fused.silu_mul` stores
(:func:`~specpilot.kernels.fused.silu_mul_values`: silu in float32, rounded to the activation dtype, then the
product in that dtype). The values the GEMV multiplies are therefore the same bits, and so is its output: this
is a fusion that saves a launch and a round trip through memory, not a change of the arithmetic. Every program of
the GEMV recomputes silu for its K chunk (``N / 16`` programs a column; for Qwen3-8B's down projection 256 ``exp``
a column, ~3M in all, against 50M weights decoded).

- :func:`swiglu_fusable`: whether a pass takes the fused path (one row, a W12 down projection routed to the
  one-row GEMV); otherwise the caller runs ``silu_mul`` and the layer as before.
- :func:`w12_swiglu_down`: the fused call.
- :func:`w12_swiglu_down_reference`: ``layer(silu_mul_reference(gate_up))``, the plain PyTorch definition.

The engine takes the fused path where :func:`swiglu_fusable` holds and ``Transformer.fuse_swiglu`` is on (the
default; off measures the unfused step side by side).
"""

from __future__ import annotations

import torch

from specpilot.kernels.fused import silu_mul_reference
from specpilot.w12.escapes import W12GemmError
from specpilot.w12.gemv import triton, w12_gemv
from specpilot.w12.launch import check_overrides, one_row_gemv
from specpilot.w12.linear import W12Linear


def _why_not(x, layer, glu: bool = True) -> str | None:
    """Why :func:`w12_swiglu_down` cannot run for ``x`` and ``layer`` (see :func:`swiglu_fusable`), or None.
    ``glu=False``: the same conditions for a plain row ``x [1, K]`` (the fused norm, :mod:`~specpilot.w12.norm`)."""
    name = "gate_up" if glu else "x"
    if triton is None:
        return "triton is not installed"
    if not isinstance(layer, W12Linear):
        return f"the layer is a {type(layer).__name__}, not a W12Linear"
    if not isinstance(x, torch.Tensor):
        return f"{name} is a {type(x).__name__}, not a tensor"
    k, n = layer.in_features, layer.out_features
    want = [1, 2 * k if glu else k]
    if x.layout != torch.strided or list(x.shape) != want or not x.is_contiguous():
        return f"needs one contiguous dense row {name} {want}, got {x.layout} {list(x.shape)}" + (
            "" if x.layout != torch.strided or x.is_contiguous() else " (not contiguous)")
    if x.device != layer.records.device:
        return f"{name} is on {x.device}, the layer on {layer.records.device}"
    if x.dtype not in ((torch.bfloat16, torch.float32) if x.is_cuda else (torch.float32,)):
        return f"{x.dtype} {name}: the kernel takes bfloat16 or float32 on CUDA, float32 in the interpreter"
    if not layer._kernel_ok(x):
        return "the layer's kernel is off for this input (on the CPU set layer.use_kernel = True: the interpreter)"
    if layer.bias is not None and tuple(layer.bias.shape) != (n,):
        return f"the layer's bias is {list(layer.bias.shape)}, not [{n}]"
    if layer.bias is not None and (layer.bias.device != x.device or not layer.bias.is_floating_point()):
        return f"the layer's bias is {layer.bias.dtype} on {layer.bias.device}, not floating point on {x.device}"
    if not one_row_gemv(n, k):
        return f"one row of a [{n}, {k}] weight goes to the tensor-core kernel, not the GEMV"
    return None


def swiglu_fusable(gate_up: torch.Tensor, layer: torch.nn.Module) -> bool:
    """Whether :func:`w12_swiglu_down` can run ``layer(silu(gate) · up)`` for ``gate_up``: ``layer`` is a
    :class:`~specpilot.w12.linear.W12Linear` ``[N, K]`` whose kernel runs for this input (CUDA, or
    ``use_kernel=True``: the Triton interpreter in tests), ``gate_up`` one contiguous dense row ``[1, 2K]`` on the
    layer's device (bfloat16 / float32 on CUDA, float32 in the interpreter), the bias (if any) ``[N]``, one row of
    that weight goes to the GEMV (:func:`~specpilot.w12.launch.one_row_gemv`). Raises nothing."""
    return _why_not(gate_up, layer) is None


def w12_swiglu_down(gate_up: torch.Tensor, layer: W12Linear, **overrides) -> torch.Tensor:
    """``layer(silu(gate) · up)`` for one row ``gate_up [1, 2K]`` (gate first, then up; bf16 on CUDA, float32 in
    the interpreter), ``layer`` the W12 down projection ``[N, K]``: one launch of the line-coalesced GEMV (two
    with split K and ``fused_split=False``) computing the SwiGLU in its activation load. ``overrides``: the GEMV's
    launch overrides (block_n, block_k, split_k, num_warps, fused_split, asm; :data:`~specpilot.w12.launch.OVERRIDES`).

    Returns: ``[1, N]`` in gate_up's dtype, bitwise ``layer(silu_mul(gate_up))`` with the same launch shape.
    Raises: W12GemmError when :func:`swiglu_fusable` is False (saying which condition failed), or on an unknown /
        non-positive override.
    """
    why = _why_not(gate_up, layer)
    if why is not None:
        raise W12GemmError(f"no fused SwiGLU: {why}")
    check_overrides(overrides)
    return w12_gemv(gate_up, layer.w12(), layer.bias, layer.escapes(), overrides | {"lines": True}, glu=True)


def w12_swiglu_down_reference(gate_up: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """``layer(silu(gate) · up)`` in plain PyTorch: ``gate_up [R, 2K]`` -> ``[R, N]``
    (:func:`~specpilot.kernels.fused.silu_mul_reference`, then the layer's own forward)."""
    return layer(silu_mul_reference(gate_up))


__all__ = ["swiglu_fusable", "w12_swiglu_down", "w12_swiglu_down_reference"]
