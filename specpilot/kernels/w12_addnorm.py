"""The residual add and RMSNorm after a W12 projection, run by the projection's own last program, at one row
(§4.1, issue 5).

At one row every decoder layer runs ``add_rmsnorm`` twice (after the o projection and after the down projection,
the latter for the next layer's input), each a launch of ~2.2 µs on the H200 (one program reading 16 KB) plus the
~1 µs between kernels of a CUDA graph: about 0.23 ms of a 4.1 ms Qwen3-8B W12 step. The line-coalesced W12 GEMV
(:func:`~specpilot.kernels.w12_gemv.w12_gemv`) already counts its splits' arrivals per tile (``fused_split``); with
``norm`` it also counts stored tiles, and the program that stores the last one reads the whole output row back
from L2 and runs :func:`~specpilot.kernels.fused.add_rmsnorm_row`, the same code the ``add_rmsnorm`` kernel runs
(``new_x = residual + out`` rounded to the dtype, then the norm). One launch fewer a norm.

Not the same bits as the separate kernel on a GPU: that kernel sums the squares across 8 warps, the GEMV's last
program in one, so ``rstd`` may differ in its last float32 bit (``normed`` then by one rounding of the dtype at
most); ``new_x`` is the same add. In the Triton interpreter both sums are numpy's, so CPU tests compare bitwise.

- :func:`addnorm_fusable`: whether a pass takes the fused path.
- :func:`w12_add_rmsnorm`: the fused call, ``(normed, new_x)``.
- :func:`w12_add_rmsnorm_reference`: ``add_rmsnorm_reference(residual, layer(x))``.
"""

from __future__ import annotations

import torch

from .fused import add_rmsnorm_reference, silu_mul_reference
from .w12_gemm import W12GemmError, _check_overrides
from .w12_swiglu import one_row_w12

#: widest output row the last program normalises (its registers hold the row: 8192 bf16 values a warp)
MAX_NORM_WIDTH = 8192


def addnorm_fusable(x: torch.Tensor, layer: torch.nn.Module, residual: torch.Tensor, weight: torch.Tensor,
                    glu: bool = False) -> bool:
    """Whether :func:`w12_add_rmsnorm` can run for these inputs: ``layer`` a W12 projection ``[N, K]`` whose
    one-row GEMV runs for ``x`` (``[1, K]``, or ``gate_up [1, 2K]`` with ``glu``; see
    :func:`~specpilot.kernels.w12_swiglu.one_row_w12`), ``residual [1, N]`` contiguous and ``weight [N]`` of x's
    dtype and device, N ≤ :data:`MAX_NORM_WIDTH`. Raises nothing."""
    if not one_row_w12(x, layer, glu):
        return False
    n = layer.out_features
    return (isinstance(residual, torch.Tensor) and isinstance(weight, torch.Tensor) and n <= MAX_NORM_WIDTH
            and tuple(residual.shape) == (1, n) and residual.is_contiguous() and residual.dtype == x.dtype
            and residual.device == x.device and tuple(weight.shape) == (n,) and weight.dtype == x.dtype
            and weight.device == x.device and weight.is_contiguous())


def w12_add_rmsnorm(x: torch.Tensor, layer, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                    glu: bool = False, **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rmsnorm(residual, layer(x), weight, eps)`` in one launch of the W12 GEMV (one row).

    Args:
        x: ``[1, K]`` activations (bf16 on CUDA, float32 in the interpreter), or with ``glu`` ``gate_up [1, 2K]``
            (the GEMV computes ``silu(gate) · up`` in its load, :mod:`specpilot.kernels.w12_swiglu`).
        layer: the :class:`~specpilot.kernels.w12_gemm.W12Linear` projection ``[N, K]``.
        residual: ``[1, N]`` the residual stream; weight: ``[N]`` the norm weight; eps: the norm's epsilon.
        overrides: the GEMV's launch overrides (as :func:`~specpilot.kernels.w12_gemm.w12_gemm`).
    Returns: ``(normed [1, N], new_x [1, N])`` in x's dtype: ``new_x = residual + layer(x)`` and its RMSNorm
        (module docstring for the bits).
    Raises: W12GemmError when :func:`addnorm_fusable` is False, or on an unknown / non-positive override.
    """
    if not addnorm_fusable(x, layer, residual, weight, glu):
        raise W12GemmError(f"no fused add_rmsnorm for x {tuple(x.shape) if torch.is_tensor(x) else x!r}, "
                           f"{type(layer).__name__} and residual "
                           f"{tuple(residual.shape) if torch.is_tensor(residual) else residual!r}: needs one row, a W12 "
                           f"layer routed to the one-row GEMV, a contiguous [1, N] residual and [N] weight of x's dtype")
    _check_overrides(overrides)
    from .w12_gemv import w12_gemv

    esc = (layer.esc_row_ptr, layer.esc_k, layer.esc_delta_bits.view(torch.float32))
    _, normed, new_x = w12_gemv(x, layer.w12(), layer.bias, esc, overrides | {"lines": True}, glu=glu,
                                norm=(residual, weight, eps))
    return normed, new_x


def w12_add_rmsnorm_reference(x: torch.Tensor, layer, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                              glu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch: ``add_rmsnorm_reference(residual, layer(x or silu_mul(x)), weight, eps)``."""
    return add_rmsnorm_reference(residual, layer(silu_mul_reference(x) if glu else x), weight, eps)


__all__ = ["addnorm_fusable", "w12_add_rmsnorm", "w12_add_rmsnorm_reference", "MAX_NORM_WIDTH"]
