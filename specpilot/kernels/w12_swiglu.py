"""SwiGLU computed inside the W12 down projection's activation load, at one row (§4.1, issue 5).

At one row the MLP ends with two launches: ``silu_mul`` (``gate_up [1, 2I]`` -> ``[1, I]``, ~1.2 µs on the H200)
and the down projection's GEMV, which then reads the ``[1, I]`` product back. Owning the W12 GEMV, the engine can
instead hand it ``gate_up`` and let the line-coalesced kernel (:func:`~specpilot.kernels.w12_gemv.w12_gemv`,
``glu=True``) compute ``silu(gate) · up`` for each step's columns (and for the escapes' columns in the epilogue)
from the very expression :func:`~specpilot.kernels.fused.silu_mul` stores
(:func:`~specpilot.kernels.fused.silu_mul_values`: silu in float32, rounded to the activation dtype, then the
product in that dtype). The values the GEMV multiplies are therefore the same bits, and so is its output: this
is a fusion that saves a launch and a round trip through memory, not a change of the arithmetic. Every program of
the GEMV recomputes silu for its K chunk (``N / 16`` programs a column; for Qwen3-8B's down projection 256 ``exp``
a column, ~3M in all, against 50M weights decoded).

- :func:`swiglu_fusable`: whether a pass takes the fused path (one row, a W12 down projection routed to the
  one-row GEMV, PDL off); otherwise the caller runs ``silu_mul`` and the layer as before.
- :func:`w12_swiglu_down`: the fused call.
- :func:`w12_swiglu_down_reference`: ``layer(silu_mul_reference(gate_up))``, the plain PyTorch definition.

The engine takes the fused path where :func:`swiglu_fusable` holds and ``Transformer.fuse_swiglu`` is on (the
default; off measures the unfused step side by side).
"""

from __future__ import annotations

import torch

from . import pdl
from .fused import silu_mul_reference
from .w12_gemm import W12GemmError, W12Linear, _check_overrides, one_row_gemv, triton


def swiglu_fusable(gate_up: torch.Tensor, layer: torch.nn.Module) -> bool:
    """Whether :func:`w12_swiglu_down` can run ``layer(silu(gate) · up)`` for ``gate_up``: ``layer`` is a
    :class:`~specpilot.kernels.w12_gemm.W12Linear` whose kernel runs for this input (CUDA, or ``use_kernel=True``:
    the Triton interpreter in tests), ``gate_up`` one contiguous bf16 / float32 row ``[1, 2K]`` for the layer's K,
    one row of that shape goes to the GEMV (:func:`~specpilot.kernels.w12_gemm.one_row_gemv`), and PDL is off (the
    lines kernel has no PDL path). Raises nothing."""
    if triton is None or not isinstance(layer, W12Linear) or not isinstance(gate_up, torch.Tensor):
        return False
    k = layer.in_features
    return (gate_up.dim() == 2 and tuple(gate_up.shape) == (1, 2 * k) and gate_up.is_contiguous()
            and gate_up.dtype in (torch.bfloat16, torch.float32) and gate_up.device == layer.records.device
            and layer._kernel_ok(gate_up) and one_row_gemv(layer.out_features, k)
            and not pdl.launch_kw(gate_up.device)["PDL"])


def w12_swiglu_down(gate_up: torch.Tensor, layer: W12Linear, **overrides) -> torch.Tensor:
    """``layer(silu(gate) · up)`` for one row ``gate_up [1, 2K]`` (gate first, then up; bf16 on CUDA, float32 in
    the interpreter), ``layer`` the W12 down projection ``[N, K]``: one launch of the line-coalesced GEMV (two
    with split K and ``fused_split=False``) computing the SwiGLU in its activation load. ``overrides``: the GEMV's
    launch overrides (block_n, block_k, split_k, num_warps, fused_split, asm; :func:`w12_gemm` names).

    Returns: ``[1, N]`` in gate_up's dtype, bitwise ``layer(silu_mul(gate_up))`` with the same launch shape.
    Raises: W12GemmError when :func:`swiglu_fusable` is False, or on an unknown / non-positive override.
    """
    if not swiglu_fusable(gate_up, layer):
        raise W12GemmError(f"no fused SwiGLU for gate_up {tuple(gate_up.shape) if torch.is_tensor(gate_up) else gate_up!r}"
                           f" and {type(layer).__name__}: needs one contiguous row [1, 2K] and a W12 layer routed to "
                           f"the one-row GEMV (see swiglu_fusable)")
    _check_overrides(overrides)
    from .w12_gemv import w12_gemv  # here, not at the top, as in w12_gemm

    esc = (layer.esc_row_ptr, layer.esc_k, layer.esc_delta_bits.view(torch.float32))
    return w12_gemv(gate_up, layer.w12(), layer.bias, esc, overrides | {"lines": True}, glu=True)


def w12_swiglu_down_reference(gate_up: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """``layer(silu(gate) · up)`` in plain PyTorch: ``gate_up [R, 2K]`` -> ``[R, N]``
    (:func:`~specpilot.kernels.fused.silu_mul_reference`, then the layer's own forward)."""
    return layer(silu_mul_reference(gate_up))


__all__ = ["swiglu_fusable", "w12_swiglu_down", "w12_swiglu_down_reference"]
