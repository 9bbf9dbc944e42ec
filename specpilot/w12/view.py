"""The Q pass's GEMM over the W12 8-bit view: ``x [M, K] @ approx_view(W)ᵀ``, 1–256 rows (§4.1, §4.3).

TLV's Q pass is an inspect-only target pass whose projections compute with an approximate weight set nested in the
exact one: the **8-bit view** of each W12 record (its first 8 KB: sign | 4-bit exponent offset | top 3 mantissa
bits), the 4 dropped mantissa bits set to their midpoint ``1000b``, escapes restored exactly. That weight set is
:func:`specpilot.w12.format.approx_view`. The Q pass thus reads 8 of the 12 bits a weight of the records the exact
pass reads, with no second copy of the weights.

- :func:`w12_view_gemm_reference`: ``approx_view`` then a float32 ``F.linear``, the oracle.
- :func:`w12_view_gemm`: the W12 record-word kernels with their ``VIEW`` flag (the one-row GEMV of
  :mod:`specpilot.w12.gemv`, the tensor-core kernel of :mod:`specpilot.w12.mma`; :func:`~specpilot.w12.gemm.w12_gemm`'s
  routing and launch rules): they load the view words only, never the nibble plane, and decode them with every
  nibble at ``1000b`` (:func:`~specpilot.w12.tiles._view_nibbles`).
- :meth:`specpilot.w12.linear.W12Linear.view_forward`: the layer's Q-pass forward.

Escapes. At an escape position the view holds the saturated code's view byte; decoded with the midpoint nibble
it is ``c_e^view`` (:func:`~specpilot.w12.escapes.codes_at` with ``view=True``), and the kernels add
``x[m, k_e] · d_e``, ``d_e = fl32(w_e − c_e^view)``, from ``escape_table(w12, view=True)``: the same rows and
columns as the exact kernels' table, other deltas.

Rounding guarantee (the form of :mod:`specpilot.w12.gemm`'s): for every output ``y[m, n]`` with finite activations
and weights and no overflow, ``|y − y_ref| <= 2 γ_{K+E_n+3} (Σ_k |x_mk| (|a_nk| + |c_nk|) + |b_n|)``, ``y_ref`` =
:func:`w12_view_gemm_reference`, ``a`` = ``approx_view(w12)``, ``c_nk = c^view`` at the channel's ``E_n`` escapes
and ``a_nk`` elsewhere, ``γ_n = n u / (1 − n u)``, ``u = 2^-24``; before the final cast to the output dtype; plus
the kernels' subnormal caveat (a partial sum or product subnormal in the ``2^(112 − B_n)`` scaling and not in the
other: at most ``2^-149`` an operation). Non-finite escapes propagate as in :mod:`specpilot.w12.gemm`. Fixed
order and no atomics in the arithmetic: two runs give bitwise identical outputs.

Untimed on a GPU: the launch rules are the exact kernels' (measured at 12 bits a weight).
"""

from __future__ import annotations

import torch

from specpilot.w12.format import W12Tensor, approx_view
from specpilot.w12.gemm import _check_reference, _linear_f32, _w12_gemm


def w12_view_gemm_reference(x: torch.Tensor, w12: W12Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ approx_view(w12).T + bias`` computed in float32, cast to ``x.dtype`` (§4.3 Q pass reference).

    Args:
        x: ``[M, K]`` (any float dtype, on the device of ``w12``'s records).
        w12: the encoded weight ``[N, K]``.
        bias: ``[N]`` or None.
    Returns: ``[M, N]`` in x's dtype (in float32 exactly ``nn.Linear`` with the approximate weight).
    Raises: W12GemmError for a weight that is not a W12Tensor or a K mismatch; W12FormatError for a malformed ``w12``.
    """
    _check_reference(x, w12, "w12_view_gemm_reference")
    return _linear_f32(x, approx_view(w12), bias)


def w12_view_gemm(x: torch.Tensor, w12: W12Tensor, bias: torch.Tensor | None = None, escapes=None,
                  **overrides) -> torch.Tensor:
    """Triton ``x @ approx_view(w12).T (+ bias)`` read from the view bytes of the records only (module docstring);
    float32 accumulation, output in x's dtype.

    Args:
        x: ``[M, K]``, 1 ≤ M ≤ 256, bfloat16 (GPU) or float32 (the interpreter on the CPU).
        w12: the weight ``[N, K]`` (records on x's device).
        bias: ``[N]`` (any float dtype) or None.
        escapes: ``escape_table(w12, view=True)`` (computed when None;
            :meth:`~specpilot.w12.linear.W12Linear.view_escapes` keeps it). A given table is checked on its first use
            with this weight as :func:`~specpilot.w12.gemm.w12_gemm` checks its table, against the view table (the
            exact kernels' ``escape_table(w12)`` is refused).
        overrides: :func:`~specpilot.w12.gemm.w12_gemm`'s launch overrides, except ``words=False`` (the byte-loading
            kernel has no view mode).
    Returns: ``[M, N]`` in x's dtype; within the module docstring's bound of :func:`w12_view_gemm_reference`.
    Raises: W12GemmError as :func:`~specpilot.w12.gemm.w12_gemm` does (shapes, dtypes, devices, M outside 1..256,
        overrides, a table that is not ``escape_table(w12, view=True)``) and for ``words=False``; W12FormatError for
        a malformed weight given with a table; RuntimeError without triton.
    """
    return _w12_gemm(x, w12, bias, escapes, overrides, trusted=False, view=True)


__all__ = ["w12_view_gemm", "w12_view_gemm_reference"]
