"""W12 GEMM: ``x [M, K] @ W[N, K]ᵀ`` straight from W12 records, 1–256 rows (§4.1): the reference and the dispatch.

At a few rows a projection is a read of its weight, so reading 12 bits a weight instead of 16 is the gain. The
kernels rebuild the bf16 weights from the records (:mod:`specpilot.w12.format`) in registers and accumulate in
float32; this module checks a call and sends it to one of them (:mod:`specpilot.w12.launch` decides which, and
with which launch shape):

* one row of most projections: the FMA GEMV (:mod:`specpilot.w12.gemv`; 2–8 rows with ``gemv=True``);
* otherwise the tensor-core kernel over record words (:mod:`specpilot.w12.mma`), or with ``words=False`` the first
  tensor-core kernel, which loads the records byte by byte (:mod:`specpilot.w12.mma_bytes`).

Escapes. At an escape position the records hold a *saturated* code ``c`` (the nearest in-window value of the right
sign), so the main loop computes ``Σ_k x_k c_k``; split 0 of a tile then adds ``x[m, k_e] · d_e``, ``d_e = fl32(w_e
- c_e)``, one escape at a time in list order (:mod:`specpilot.w12.escapes` for the table,
:mod:`specpilot.w12.epilogue` for the kernels' shared end). The split-K sum then adds the partials in split order
and the bias. Everything is in a fixed order and there are no atomics in the arithmetic, so two runs give bitwise
identical outputs, and the in-kernel and the two-kernel split-K sums give the same bits.

Rounding guarantee (float32 accumulation, unit ``u = 2^-24``, ``γ_n = n u / (1 - n u)``): for every output
``y[m, n]`` with finite activations and weights and no overflow,
``|y - y_ref| <= 2 γ_{K+E_n+3} (Σ_k |x_mk| (|w_nk| + |c_nk|) + |b_n|)``, where ``y_ref`` is the reference
(decode, then a float32 matmul, any summation order), ``E_n`` the channel's escapes, ``c_nk = w_nk`` off
the escapes and ``b`` the bias; before the final cast to the output dtype. (Both results are within
``γ`` of the exact sum: the reference by ``γ_K (Σ|x||w| + |b|)``, this kernel by ``γ (Σ_k |x_k||c_k| + Σ_e
|x_e| (|w_e| + |c_e|) + |b|)``, counting the rounding of ``d_e`` and of each product; together at most twice
the bracket.) Saturated codes lie in the channel's window, so the bound is that of the channel's own
weights; tests check it element by element.

Non-finite weights (±inf, NaN escapes). ``d_e`` is then ±inf / NaN and, for finite activations, the
escape term ``x[m, k_e] * d_e`` is exactly the reference's product term (NaN when ``x = 0`` and
``w = ±inf``, or for any NaN), added to a finite main sum: the output is NaN where the reference's is NaN
and ±inf (same sign) where the reference's is ±inf. Non-finite activations: the output is non-finite
exactly where the reference's is and NaN where it is NaN, but may be NaN where the reference's is ±inf
(an infinite activation meeting a non-zero escape below the window: saturated code and correction give
infinities of opposite signs). A finite ``y_ref`` that overflows float32 in one order and not the other
is outside the guarantee, as for any two float32 GEMMs.

- :func:`w12_gemm_reference`: decode (:func:`specpilot.w12.format.decode`) then a float32 ``F.linear``,
  the oracle; in float32 it is exactly what ``nn.Linear`` computes with the decoded weight.
- :func:`w12_gemm`: the Triton kernels (interpreter on the CPU in tests).
- :class:`~specpilot.w12.linear.W12Linear`: an ``nn.Module`` holding the records; see
  :mod:`specpilot.w12.convert` for the engine mechanism.

The escape-table, launch-rule and split-lock names this module imports are re-exported here (``__all__``), so
``from specpilot.w12.gemm import escape_table, default_config, reserve_split_locks`` keeps working.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specpilot.kernels.gemm import _num_sms
from specpilot.w12.epilogue import CAPTURE_LOCKS, reserve_split_locks, split_locks
from specpilot.w12.escapes import (ESC_SLOTS, W12GemmError, check_escape_table, check_escapes_once, codes_at,
                                   escape_layout, escape_table)
from specpilot.w12.format import RECORD_COLS, RECORD_ROWS, W12Tensor, decode
from specpilot.w12.gemv import w12_gemv
from specpilot.w12.launch import (FUSED_SPLIT_MAX_ROWS, MAX_ROWS, OVERRIDES, PROGRAMS_PER_SM, WAVE_MAXNREG,
                                  check_overrides, default_config, one_row_gemv, routes_to_gemv)
from specpilot.w12.mma import w12_mma
from specpilot.w12.mma_bytes import w12_mma_bytes

try:
    import triton
except ImportError:  # CPU installs without triton: the reference still works
    triton = None


def w12_gemm_reference(x: torch.Tensor, w12: W12Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ decode(w12).T + bias`` computed in float32, cast to ``x.dtype`` (§4.1 reference).

    Args:
        x: ``[M, K]`` (any float dtype, any device holding ``w12``).
        w12: the encoded weight ``[N, K]``.
        bias: ``[N]`` or None.
    Returns: ``[M, N]`` in x's dtype.
    Raises: W12GemmError on a weight that is not a W12Tensor or a K mismatch; W12FormatError for a malformed ``w12``.
    """
    _check_reference(x, w12, "w12_gemm_reference")
    return _linear_f32(x, decode(w12, check=False), bias)


def _check_reference(x: torch.Tensor, w12: W12Tensor, name: str) -> None:
    """A reference's input checks: ``w12`` a W12Tensor and x's last dim its K. Raises W12GemmError naming ``name``."""
    if not isinstance(w12, W12Tensor):
        raise W12GemmError(f"{name} takes a W12Tensor weight (specpilot.w12.format.encode), got {type(w12).__name__}")
    if x.shape[-1] != w12.shape[1]:
        raise W12GemmError(f"activations have {x.shape[-1]} features, the W12 weight {w12.shape} wants {w12.shape[1]}")


def _linear_f32(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` in float32, cast to x's dtype (in float32: exactly ``nn.Linear``'s call)."""
    return F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(x.dtype)


def _check(x: torch.Tensor, w12: W12Tensor, bias: torch.Tensor | None) -> None:
    if not isinstance(w12, W12Tensor):
        raise W12GemmError(f"w12_gemm takes a W12Tensor weight (specpilot.w12.format.encode), got {type(w12).__name__}")
    if not isinstance(x, torch.Tensor):
        raise W12GemmError(f"x must be a torch.Tensor, got {type(x).__name__}")
    n, k = w12.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise W12GemmError(f"want x [M, {k}] for a W12 weight {tuple(w12.shape)}, got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise W12GemmError(f"the W12 kernel takes bfloat16 or float32 activations, got {x.dtype}")
    if bias is not None and (tuple(bias.shape) != (n,)):
        raise W12GemmError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if w12.records.numel() >= 2**31:
        raise W12GemmError(f"W12 weight {tuple(w12.shape)} has records of 2 GiB or more (32-bit offsets)")
    if x.device != w12.records.device:
        raise W12GemmError(f"x is on {x.device}, the W12 records on {w12.records.device}")


def w12_gemm(x: torch.Tensor, w12: W12Tensor, bias: torch.Tensor | None = None, escapes=None,
             **overrides) -> torch.Tensor:
    """Triton ``x @ decode(w12).T (+ bias)`` read from the records; fp32 accumulation, output in x's dtype.

    Args:
        x: ``[M, K]``, 1 ≤ M ≤ 256, bfloat16 (GPU) or float32 (decoded weights in float32; the interpreter).
        w12: the weight ``[N, K]`` (records on x's device).
        bias: ``[N]`` (any float dtype) or None.
        escapes: :func:`escape_table` of ``w12`` (computed when None; :class:`~specpilot.w12.linear.W12Linear`
            keeps it). A given table is checked by :func:`check_escape_table` on its first use with this weight
            (values, and that it is ``escape_table(w12)``: one device sync), then not again while its tensors and the
            weight's are the same memory with unchanged version counters
            (:func:`~specpilot.w12.escapes.check_escapes_once`); not checked while a CUDA graph is being captured
            (check it before the capture, e.g. with an eager call).
        overrides: block_m / block_n (16–128, dividing 128) / block_k (a multiple of 64) / split_k /
            num_warps / num_stages / w_left, and ``gemv``: True runs
            :func:`~specpilot.w12.gemv.w12_gemv` (FMAs; 1..8 rows), False the tensor-core kernel;
            default: the GEMV for one row when :func:`one_row_gemv` says so, else the tensor-core kernel.
            ``fused_split`` (default: up to :data:`FUSED_SPLIT_MAX_ROWS` rows): with split K, the tile's last split
            adds the partials in the kernel (:func:`~specpilot.w12.epilogue._finish_splits`, bitwise the same sum)
            instead of a second launch (record-word tensor-core kernel and GEMV; ignored by ``words=False``; see
            :func:`split_locks` for CUDA graphs).
            ``esc_early``: whether split 0 loads the escape slots before its K loop (:func:`default_config`; the
            one-row GEMV: :func:`~specpilot.w12.launch.gemv_config`).
            ``maxnreg``: the tensor-core kernel's register cap (registers a thread, 24..255; 0: none; default:
            :func:`default_config`'s, see :data:`WAVE_MAXNREG`); changes no value.
            ``words`` (default True): the tensor-core kernel that reads record words
            (:func:`~specpilot.w12.mma.w12_mma`; on the H200 1.0–1.2x faster than ``words=False``, the
            byte-loading kernel of :mod:`~specpilot.w12.mma_bytes`, at 16–256 rows:
            ``results/w12_dense_probe_h200_2026-11-30.json``).
    Returns: ``[M, N]`` in x's dtype; within the module docstring's bound of :func:`w12_gemm_reference`.
    Raises: W12GemmError on bad shapes / dtypes / devices, M outside 1..256 (1..8 with ``gemv=True``), a weight
        that is not a W12Tensor, an unknown override name (:data:`OVERRIDES`), a non-positive block / split /
        warp / stage count or a register cap outside 0 / 24..255, an escape table that is not this weight's
        :func:`escape_table` (:func:`check_escape_table`); W12FormatError for a malformed weight given with a
        table (:meth:`~specpilot.w12.format.W12Tensor.validate`, with the table's check); RuntimeError without
        triton. Nothing is launched before these checks.
    """
    return _w12_gemm(x, w12, bias, escapes, overrides, trusted=False)


def _w12_gemm(x: torch.Tensor, w12: W12Tensor, bias: torch.Tensor | None, escapes, overrides: dict,
              trusted: bool, view: bool = False) -> torch.Tensor:
    """:func:`w12_gemm`; ``trusted``: ``escapes`` is known to be ``escape_table(w12, view)``
    (:class:`~specpilot.w12.linear.W12Linear`'s own table), so its values are not checked (its layout still is: no
    device sync). ``view``: :func:`~specpilot.w12.view.w12_view_gemm` (the 8-bit view; the record-word kernels only,
    so ``words=False`` is refused)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    _check(x, w12, bias)
    check_overrides(overrides)
    m, k = x.shape
    n = w12.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise W12GemmError(f"w12_gemm takes 1..{MAX_ROWS} rows, got {m}")
    x = x if x.stride(1) == 1 else x.contiguous()
    if view and overrides.get("words") is False:
        raise W12GemmError("the 8-bit-view GEMM runs on the record-word kernels only (words=False is the byte kernel)")
    if escapes is None:
        escapes = escape_table(w12, view)
    else:
        escapes = escape_layout(w12, escapes, x.device)
        if not trusted:
            check_escapes_once(w12, escapes, view)
    if overrides.get("gemv", routes_to_gemv(m, n, k)):
        return w12_gemv(x, w12, bias, escapes, overrides, view=view)
    cfg = default_config(m, n, k, _num_sms(x.device.index if x.is_cuda else None))
    cfg.update({key: v for key, v in overrides.items() if v is not None})
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    if RECORD_ROWS % bn or bk % RECORD_COLS or bm < 16 or bn < 16:
        raise W12GemmError(f"block_n must divide {RECORD_ROWS}, block_k be a multiple of {RECORD_COLS}, blocks >= 16")
    if cfg.get("words"):
        return w12_mma(x, w12, bias, escapes, cfg, view)
    return w12_mma_bytes(x, w12, bias, escapes, cfg)


__all__ = ["w12_gemm", "w12_gemm_reference", "W12GemmError", "MAX_ROWS", "OVERRIDES", "default_config",
           "one_row_gemv", "routes_to_gemv", "PROGRAMS_PER_SM", "FUSED_SPLIT_MAX_ROWS", "WAVE_MAXNREG", "ESC_SLOTS",
           "escape_table", "check_escape_table", "codes_at", "split_locks", "reserve_split_locks", "CAPTURE_LOCKS"]
