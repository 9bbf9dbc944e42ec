"""W12 GEMM: ``x [M, K] @ W[N, K]ᵀ`` straight from W12 records, 1–256 rows (§4.1, issue 5).

At a few rows a projection is a read of its weight, so reading 12 bits a weight instead of 16 is the gain.
The kernel follows :mod:`specpilot.kernels.gemm` (tile N, split K, pad the rows to one tensor-core tile,
fp32 accumulators, a fixed-order split-K sum) but loads W12 records (:mod:`specpilot.w12.format`) instead
of bf16 weights:

* a program owns ``BLOCK_N`` (16/32/64/128) rows of one 128-row record band and walks its K chunk
  ``BLOCK_K`` (a multiple of 64, i.e. whole records) at a time; per step it loads the rows' 8-bit views
  (``64`` contiguous bytes per row and record) and packed nibbles (``32`` bytes per row and record);
* it rebuilds the bf16 bits in registers, ``sign << 15 | (B_n + offset) << 7 | view_mant3 << 4 | nibble``,
  and feeds ``tl.dot`` (bf16 operands on the GPU; in float32 when the activations are float32, which is
  how the Triton interpreter tests it on the CPU: bf16 values are exact in float32);
* padded columns (``K`` up to a multiple of 64) hold finite codes and meet activations masked to 0; padded
  rows (``N`` up to a multiple of 128) are never stored.

Escapes. At an escape position the records hold a *saturated* code ``c`` (the nearest in-window value of
the right sign), so the main loop computes ``Σ_k x_k c_k``. Each output channel's escapes are kept as
``(k_e, d_e)``, ``d_e = fl32(w_e - c_e)`` (``w_e`` the true bf16 weight), in :func:`escape_table`'s layout: the
channel's first :data:`ESC_SLOTS` in fixed slots (loadable without reading anything first), the rest in a CSR
overflow list. Split 0 of a tile (the only one without split K) loads its slots (after its K loop by default) and
adds ``x[m, k_e] * d_e`` to its own K sum one escape at a time in list order (slots, then overflow:
:func:`_add_escapes`). The split-K sum then adds the partials in split order and the bias.
Everything is in a fixed order and there are no atomics in the arithmetic, so two runs give bitwise identical
outputs, and the in-kernel and the two-kernel split-K sums give the same bits.

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

One row of a short-K, very wide or moderate weight (:func:`one_row_gemv`) goes to
:func:`specpilot.w12.gemv.w12_gemv` instead (decode to float32 in three integer instructions a weight,
FMAs, no tensor cores), as do 2–8 rows with ``gemv=True``.

- :func:`w12_gemm_reference`: decode (:func:`specpilot.w12.format.decode`) then a float32 ``F.linear``,
  the oracle; in float32 it is exactly what ``nn.Linear`` computes with the decoded weight.
- :func:`w12_gemm`: the Triton kernel (interpreter on the CPU in tests).
- :class:`W12Linear`: an ``nn.Module`` holding the records; see :mod:`specpilot.w12.convert` for the
  engine mechanism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from specpilot.errors import SpecPilotError
from specpilot.w12.format import (RECORD_BYTES, RECORD_COLS, RECORD_ROWS, VIEW_BYTES, W12FormatError, W12Tensor, decode,
                          encode)
from specpilot.kernels.gemm import _num_sms

try:
    import triton
    import triton.language as tl

    from specpilot.kernels.fused import rms_rstd, rmsnorm_values, silu_mul_values
except ImportError:  # CPU installs without triton: the reference still works
    triton = None

MAX_ROWS = 256  # rows per kernel launch; more rows are run in chunks of this many
#: W12Linear decodes to bf16 and calls cuBLAS for passes of more than this many rows
#: (:mod:`specpilot.w12.dense`; the tensor-core W12 kernel up to it). H200, Qwen3-8B projections
#: (``results/w12_dense_probe_h200_2026-11-30.json``):
#: at 128 rows the record-word kernel is faster on o / gate_up / down (29.9 / 151.9 / 74.0 µs vs 37.2 /
#: 159.7 / 88.8), from 192 rows decode + cuBLAS is faster on all four (gate_up 163.0 vs 225.5 µs)
DENSE_ROWS = 128


class W12GemmError(SpecPilotError):
    """Activations that do not fit a W12 weight (shape, dtype, layout) or a weight too large for the kernel."""


def w12_gemm_reference(x: torch.Tensor, w12: W12Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ decode(w12).T + bias`` computed in float32, cast to ``x.dtype`` (§4.1 reference).

    Args:
        x: ``[M, K]`` (any float dtype, any device holding ``w12``).
        w12: the encoded weight ``[N, K]``.
        bias: ``[N]`` or None.
    Returns: ``[M, N]`` in x's dtype.
    Raises: W12GemmError on a weight that is not a W12Tensor or a K mismatch; W12FormatError for a malformed ``w12``.
    """
    if not isinstance(w12, W12Tensor):
        raise W12GemmError(f"w12_gemm_reference takes a W12Tensor weight (specpilot.w12.format.encode), "
                           f"got {type(w12).__name__}")
    if x.shape[-1] != w12.shape[1]:
        raise W12GemmError(f"activations have {x.shape[-1]} features, the W12 weight {w12.shape} wants {w12.shape[1]}")
    return _linear_f32(x, decode(w12, check=False), bias)


def _linear_f32(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` in float32, cast to x's dtype (in float32: exactly ``nn.Linear``'s call)."""
    return F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(x.dtype)


def codes_at(w12: W12Tensor, flat: torch.Tensor) -> torch.Tensor:
    """The bf16 values the kernel decodes at flat positions ``flat [E] long`` (``n * K + k``) from the records
    alone (no escape patching): the saturated codes at escape positions. Plain PyTorch. Returns bf16 ``[E]``."""
    k = w12.shape[1]
    n, c = flat // k, flat % k
    rec = (n // RECORD_ROWS * w12.records.shape[1] + c // RECORD_COLS) * RECORD_BYTES  # byte offset of the record
    r, cc = n % RECORD_ROWS, c % RECORD_COLS
    flat_rec = w12.records.reshape(-1)
    v = flat_rec[rec + r * RECORD_COLS + cc].to(torch.int32)
    p = flat_rec[rec + VIEW_BYTES + r * (RECORD_COLS // 2) + cc // 2].to(torch.int32)
    nib = (p >> (4 * (c % 2))) & 15
    e = w12.base[n].to(torch.int32) + ((v >> 3) & 15)
    bits = ((v >> 7) << 15) | (e << 7) | ((v & 7) << 4) | nib
    return (bits - ((bits >> 15) << 16)).to(torch.int16).view(torch.bfloat16)


#: escapes a channel keeps in fixed slots of :func:`escape_table` (the rest go to its overflow list). Random
#: N(0, 0.02) weights of the Qwen3-8B shapes have at most 4 escapes in any channel but down's (K = 12288: 11 of
#: 4096 channels have more), and at most 2–4 in a tile of 64 channels
ESC_SLOTS = 4


def escape_table(w12: W12Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The escape table the kernels read (module docstring): slots, then a CSR overflow list.

    Returns ``(row_ptr, k, delta)`` on ``w12``'s device, ``S = ESC_SLOTS``, ``E`` escapes, ``O`` of them in overflow:
        ``k`` int32 ``[N·S + O]``, ``delta`` float32 ``[N·S + O]``: entry ``n·S + j`` (``j < S``) is channel n's
        j-th escape (input column, ascending, and ``fl32(w_true − w_code)``, ±inf / NaN for non-finite weights),
        or ``(-1, 0.0)`` where the channel has ``j`` escapes or fewer; entries from ``N·S`` on are the overflow
        (escapes ``S, S+1, …`` of each channel, channel by channel);
        ``row_ptr`` int32 ``[N + 1]``: channel n's overflow is ``k[row_ptr[n]:row_ptr[n + 1]]`` (``row_ptr[0] = N·S``).
    """
    n, k = w12.shape
    idx = w12.esc_idx.long()
    order = torch.argsort(idx, stable=True)
    idx = idx[order]
    true = w12.esc_val[order].view(torch.bfloat16).float()
    delta = true - codes_at(w12, idx).float()
    rows = idx // k
    counts = torch.bincount(rows, minlength=n) if idx.numel() else torch.zeros(n, dtype=torch.long, device=idx.device)
    start = torch.cat((counts.new_zeros(1), counts.cumsum(0)))
    j = torch.arange(idx.numel(), device=idx.device) - start[rows]  # rank of each escape in its channel
    slot_k = torch.full((n * ESC_SLOTS,), -1, dtype=torch.int32, device=idx.device)
    slot_d = torch.zeros(n * ESC_SLOTS, dtype=torch.float32, device=idx.device)
    in_slot = j < ESC_SLOTS
    pos = rows[in_slot] * ESC_SLOTS + j[in_slot]
    slot_k[pos] = (idx[in_slot] % k).to(torch.int32)
    slot_d[pos] = delta[in_slot]
    over = (counts - ESC_SLOTS).clamp_min(0)
    row_ptr = (n * ESC_SLOTS + torch.cat((over.new_zeros(1), over.cumsum(0)))).to(torch.int32)
    return (row_ptr, torch.cat((slot_k, (idx[~in_slot] % k).to(torch.int32))),
            torch.cat((slot_d, delta[~in_slot])))


def _escape_layout(w12: W12Tensor, escapes, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``escapes`` as ``(row_ptr, k, delta)`` after checking its container, dtypes, layout in memory, device and
    sizes against ``w12`` (no values read: no device sync). Raises W12GemmError naming ``escape_table``."""
    if not (isinstance(escapes, (tuple, list)) and len(escapes) == 3 and all(isinstance(e, torch.Tensor)
                                                                            for e in escapes)):
        raise W12GemmError("escapes must be escape_table(w12): a (row_ptr, k, delta) tuple of tensors")
    row_ptr, esc_k, esc_d = escapes
    n, k = w12.shape
    if (row_ptr.dtype, esc_k.dtype, esc_d.dtype) != (torch.int32, torch.int32, torch.float32) or not all(
            e.is_contiguous() and e.device == device for e in (row_ptr, esc_k, esc_d)):
        raise W12GemmError("escapes must be escape_table(w12): contiguous int32 row_ptr, int32 k, float32 delta on "
                           f"{device} (the activations' and records' device), got {row_ptr.dtype} / {esc_k.dtype} / "
                           f"{esc_d.dtype} on {row_ptr.device} / {esc_k.device} / {esc_d.device}")
    if (row_ptr.dim(), esc_k.dim(), esc_d.dim()) != (1, 1, 1) or row_ptr.numel() != n + 1 or \
            esc_k.numel() < n * ESC_SLOTS or esc_d.numel() != esc_k.numel():
        raise W12GemmError(f"escapes must be escape_table(w12) of this [{n}, {k}] weight: 1-D row_ptr [{n + 1}] and "
                           f"k / delta of at least {n * ESC_SLOTS} entries, got {tuple(row_ptr.shape)} / "
                           f"{tuple(esc_k.shape)} / {tuple(esc_d.shape)}")
    return row_ptr, esc_k, esc_d


def check_escape_table(w12: W12Tensor, escapes) -> None:
    """Check that ``escapes`` is :func:`escape_table` of ``w12``, so that the W12 kernels read nothing out of bounds
    and add the right escapes.

    Args:
        w12: the weight ``[N, K]`` (a valid :class:`~specpilot.w12.format.W12Tensor`).
        escapes: ``(row_ptr, k, delta)``: contiguous 1-D int32 ``[N + 1]``, int32 ``[T]``, float32 ``[T]`` with
            ``T ≥ N·S`` (``S`` = :data:`ESC_SLOTS`), on the records' device.
    Checks, in this order (the first failure is raised): the container, dtypes, layout, device and sizes; the
    weight itself (:meth:`~specpilot.w12.format.W12Tensor.validate`, as :func:`escape_table` indexes its records
    at the escape positions); ``row_ptr[0] = N·S``; ``row_ptr`` non-decreasing; ``row_ptr[N] = T`` (every entry
    past the slots belongs to one channel's overflow); slot columns ``k[n·S + j]`` in ``[-1, K)`` and a channel's
    filled slots before its empty ones (``-1``: :func:`escape_table` fills slots ``0, 1, …`` in column order);
    overflow columns ``k[N·S:]`` in ``[0, K)``; then equality with ``escape_table(w12)`` (``row_ptr`` and ``k``
    exactly, ``delta`` by value with NaN equal to NaN), which also catches a table of another weight of the same
    shape. The range checks make any table that passes them safe to read; equality makes the output right.
    Cost: :func:`escape_table` (a sort of the E escapes) and one device sync; more copies to the host only when a
    check fails. :func:`w12_gemm` runs it once per table (:func:`_check_escapes_once`).
    Raises: W12GemmError with a one-line message naming the first bad entry (or the layout problem);
        W12FormatError for a malformed ``w12``.
    """
    if not isinstance(w12, W12Tensor):
        raise W12GemmError(f"check_escape_table takes a W12Tensor weight, got {type(w12).__name__}")
    row_ptr, ks, d = _escape_layout(w12, escapes, w12.records.device)
    w12.validate()
    n, k = w12.shape
    s = n * ESC_SLOTS
    total = ks.numel()
    slots = ks[:s].view(n, ESC_SLOTS)
    empty = slots < 0
    over = ks[s:]
    flags = [row_ptr[0] == s, (row_ptr[1:] >= row_ptr[:-1]).all(), row_ptr[-1] == total,
             ((slots >= -1) & (slots < k)).all(), ~(empty[:, :-1] & ~empty[:, 1:]).any(),
             ((over >= 0) & (over < k)).all()]
    ref = escape_table(w12)
    if ref[1].numel() == total:
        same_d = (d == ref[2]) | (d.isnan() & ref[2].isnan())
        flags.append((row_ptr == ref[0]).all() & (ks == ref[1]).all() & same_d.all())
    else:
        flags.append(torch.zeros((), dtype=torch.bool, device=ks.device))
    if all(torch.stack([f.reshape(()) for f in flags]).tolist()):  # the one sync
        return
    raise W12GemmError(_first_bad_escape(w12, (row_ptr, ks, d), ref))


def _first_bad_escape(w12: W12Tensor, escapes, ref) -> str:
    """:func:`check_escape_table`'s message for a table that failed a value check (on host copies)."""
    rp, ks, d = (t.cpu() for t in escapes)
    rp_ref, ks_ref, d_ref = (t.cpu() for t in ref)
    n, k = w12.shape
    s, total, S = n * ESC_SLOTS, ks.numel(), ESC_SLOTS
    at = f"escape table of this [{n}, {k}] weight:"
    if int(rp[0]) != s:
        return f"{at} row_ptr[0] is {int(rp[0])}, want N·ESC_SLOTS = {s}"
    dec = (rp[1:] < rp[:-1]).nonzero()
    if dec.numel():
        i = int(dec[0, 0]) + 1
        return f"{at} row_ptr decreases at entry {i}: row_ptr[{i}] = {int(rp[i])} < row_ptr[{i - 1}] = {int(rp[i - 1])}"
    if int(rp[-1]) != total:
        return f"{at} row_ptr[{n}] is {int(rp[-1])}, want the table's length {total} (N·ESC_SLOTS + the overflow)"
    slots = ks[:s]
    bad = ((slots < -1) | (slots >= k)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        return f"{at} slot k[{i}] (channel {i // S}, slot {i % S}) is {int(slots[i])}, outside [-1, {k})"
    empty = slots.view(n, S) < 0
    bad = (empty[:, :-1] & ~empty[:, 1:]).reshape(-1).nonzero()
    if bad.numel():
        c, j = divmod(int(bad[0, 0]), S - 1)
        i = c * S + j + 1
        return (f"{at} slot k[{i}] (channel {c}, slot {j + 1}) is {int(slots[i])} after an empty slot {j}: "
                "a channel's slots fill from slot 0")
    bad = ((ks[s:] < 0) | (ks[s:] >= k)).nonzero()
    if bad.numel():
        i = s + int(bad[0, 0])
        c = int(torch.searchsorted(rp, torch.tensor(i, dtype=rp.dtype), right=True)) - 1
        return f"{at} overflow k[{i}] (channel {c}) is {int(ks[i])}, outside [0, {k})"
    other = "not escape_table(w12) (a table of another weight?)"
    diff = (rp != rp_ref).nonzero()
    if diff.numel():
        i = int(diff[0, 0])
        return f"{at} {other}: row_ptr[{i}] is {int(rp[i])}, escape_table(w12) has {int(rp_ref[i])}"
    diff = ((ks != ks_ref) | ~((d == d_ref) | (d.isnan() & d_ref.isnan()))).nonzero()
    if diff.numel():
        i = int(diff[0, 0])
        where = f"channel {i // S}, slot {i % S}" if i < s else \
            f"channel {int(torch.searchsorted(rp, torch.tensor(i, dtype=rp.dtype), right=True)) - 1}, overflow"
        return (f"{at} {other}: entry {i} ({where}) is k = {int(ks[i])}, delta = {float(d[i])!r}; escape_table(w12) "
                f"has k = {int(ks_ref[i])}, delta = {float(d_ref[i])!r}")
    return f"{at} {other}"


#: tables :func:`_check_escapes_once` has checked: key (the weight's shape and, for each of the table's three
#: tensors and the weight's four, its storage, offset, shape, strides and dtype) -> (weak references to those
#: storages, their tensors' version counters)
_CHECKED_TABLES: dict = {}
_CHECKED_MAX = 256


def _version(t: torch.Tensor):
    """``t._version``; None for an inference-mode tensor (it has no version counter)."""
    return None if t.is_inference() else t._version  # (not try / except: raising costs ~10 µs a call)


def _check_escapes_once(w12: W12Tensor, escapes) -> None:
    """:func:`check_escape_table` the first time a table is used with a weight, not on later calls while the seven
    tensors (the table's three, the weight's records / base / esc_idx / esc_val) are views of the same storages
    (held by weak reference: their addresses, in the key, are not reused while held) at the same
    offsets, shapes, strides and dtypes, with unchanged version counters (bumped by every in-place write through
    torch, in any view; :meth:`W12Linear.escapes`' fresh dtype view of its buffer hits too). Not re-checked:
    writes that bypass the counter (``.data``, DLPack, raw pointers) and in-place writes to inference-mode
    tensors (no counter). Skipped, and nothing recorded, while the current CUDA stream captures a graph (the check
    syncs). At most :data:`_CHECKED_MAX` tables are remembered (dead entries dropped first, then the oldest)."""
    ts = (*escapes, w12.records, w12.base, w12.esc_idx, w12.esc_val)
    key = (tuple(w12.shape),) + tuple((t.untyped_storage()._cdata, t.storage_offset(), t.shape, t.stride(), t.dtype)
                                      for t in ts)
    hit = _CHECKED_TABLES.get(key)
    versions = tuple(_version(t) for t in ts)
    if hit is not None and hit[1] == versions:  # key equal: the same live storages (a held one's address is not reused)
        return
    if ts[0].is_cuda and torch.cuda.is_current_stream_capturing():
        return
    check_escape_table(w12, escapes)
    if len(_CHECKED_TABLES) >= _CHECKED_MAX:
        for old in [kk for kk, (refs, _) in _CHECKED_TABLES.items() if any(r.expired() for r in refs)]:
            del _CHECKED_TABLES[old]
        while len(_CHECKED_TABLES) >= _CHECKED_MAX:
            del _CHECKED_TABLES[next(iter(_CHECKED_TABLES))]
    _CHECKED_TABLES.pop(key, None)
    _CHECKED_TABLES[key] = (tuple(StorageWeakRef(t.untyped_storage()) for t in ts), versions)


#: programs a launch aims for, per SM (SPLIT_K grows until reached): on the H200 the best split in
#: ``results/w12_mma_sweep_h200_2026-12-01_session8.json`` gave 384–512 programs (qkv 96 x 4, o and down
#: 64 x 8, gate_up 384 x 1) on 132 SMs
PROGRAMS_PER_SM = 2.9


#: rows up to which split K is summed in the kernel (``fused_split``): on the H200 the tensor-core kernel's fused sum
#: saved 6.5–7.7% on Qwen3-8B qkv / o and 3.9–5.2% on down at 1–16 rows; from 32 rows it lost 20–60% on o and
#: down (the last split adds every partial tile alone) and was mixed on qkv: session 9's
#: ``results/w12_mma_sweep_h200_2026-12-01_session9.json``
FUSED_SPLIT_MAX_ROWS = 16


#: registers a thread of the tensor-core kernel at BLOCK_M 16 is capped at when its launch needs more than one wave.
#: Uncapped it takes 86 (offline ptxas, sm_90a, M not a multiple of 16; fewer when M is), so an SM holds
#: :data:`WAVE_PROGRAMS` = 5 four-warp programs (registers are allocated per warp in units of 256); at 80 (no spills,
#: offline) it holds 6. H200 (``probes/w12_waves_probe.py``,
#: ``results/w12_waves_probe_h200_2026-12-02_session18.json``): Qwen3-32B gate_up launches 800 programs at
#: 8–32 rows, 660 fit at 5 an SM (792 at 6), and the second wave of 140 ran nearly alone: 8 rows 128.9 µs uncapped, 109.2 at 80
#: (cuBLAS 129.8); at 16 rows (M a multiple of 16, fewer registers) 106.9 uncapped, 129.4 when allowed 96 (the same
#: cliff). Launches that fit one wave anyway (every Qwen3-8B projection, 32B qkv / o / down: at most 640 programs)
#: gained nothing from the cap (8B at 8–16 rows 0–3% slower capped), so they are not capped. Not applied at 32 rows (BLOCK_M
#: 32: 108 registers uncapped, 80 spills 140 bytes; 32B gate_up 146.7 → 131.3 µs but 32B qkv / o / down 1–5% slower).
WAVE_MAXNREG = 80
WAVE_PROGRAMS = 5


def default_config(m: int, n: int, k: int, num_sms: int = 132) -> dict:
    """Launch parameters for ``[m, k] @ W12[n, k]ᵀ`` from static shapes only (so graphs and eager calls agree).

    BLOCK_M: the rows rounded up to 16/32/64 (more rows: tiles of 64 on a third grid axis). BLOCK_N 64
    (inside a 128-row band), BLOCK_K 64 (one record a step), 4 stages, weights as the left tl.dot operand, the
    record-word kernel (``words``). SPLIT_K: the smallest power of two that gives at least
    :data:`PROGRAMS_PER_SM` programs an SM while every split keeps at least 4 K-blocks and the splits divide
    the padded K into whole blocks. Measured on the H200 (``probes/w12_mma_sweep.py``): BLOCK_K 64 and these
    splits beat the previous default (BLOCK_K 128, one program an SM) by 1.1–1.3x at 8–32 rows.
    ``fused_split`` (the split-K sum inside the kernel) up to :data:`FUSED_SPLIT_MAX_ROWS` rows. ``esc_early`` off:
    split 0 loads its escape slots after the K loop. Loading them before it won 1–3% at 8–16 rows on the split-K 8B
    shapes in session 17 (``results/w12_escape_slots_probe_h200_2026-12-02_session17.json``, with the slot
    steps unrolled), but holds ~28 more registers through the loop (offline ptxas, 16 rows: 78 → 106; with the
    unrolled steps the kernel went 80 → 126 and Qwen3-32B's 640-program launches then no longer fit in one wave:
    32B down at 8 rows 1.39 → 1.07x in ``results/w12_bench_h200_2026-12-02_session17_unrolled.json``).
    ``maxnreg`` (:data:`WAVE_MAXNREG` or None): at BLOCK_M 16, a launch of more programs than the SMs hold at the
    kernel's own register count (:data:`WAVE_PROGRAMS` an SM) runs with its registers capped, so an SM holds one more
    and the second wave shrinks or goes (see :data:`WAVE_MAXNREG`).
    """
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 64, 64
    programs = -(-n // block_n) * -(-m // block_m)
    k_blocks = -(-(-(-k // RECORD_COLS) * RECORD_COLS) // block_k)
    split = 1
    while (programs * split < PROGRAMS_PER_SM * num_sms and k_blocks % (2 * split) == 0
           and k_blocks // (2 * split) >= 4):
        split *= 2
    waves = programs * split > WAVE_PROGRAMS * num_sms  # uncapped, the launch needs a second wave
    return dict(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split, num_warps=4, num_stages=4,
                w_left=True, words=True, fused_split=m <= FUSED_SPLIT_MAX_ROWS, esc_early=False,
                maxnreg=WAVE_MAXNREG if block_m == 16 and waves else None)


def one_row_gemv(n: int, k: int) -> bool:
    """Whether one activation row of ``[1, k] @ W12[n, k]ᵀ`` goes to the GEMV (FMAs) rather than the tensor-core
    kernel: for ``k ≤ 4096``, ``n > 4 k``, or ``n ≤ 4096`` with ``k ≤ 3 n``. Empirical, H200, both kernels timed
    side by side in one run (``results/w12_double_probe_h200_2026-12-01_session13.json``, the line-coalesced
    GEMV): the GEMV wins on Qwen3-8B qkv / o / gate_up (14.29 / 11.01 / 40.76 µs vs 15.08 / 11.90 / 41.18), 8B down
    (23.24 vs 24.07) and Qwen3-32B gate_up (100.3 vs 109.8); the tensor cores win on 32B qkv / o / down (24.9 /
    21.5 / 52.4 vs 27.0 / 22.9 / 56.6), where K is long for the tile count. The third clause is fitted to these
    eight shapes (it takes 8B down and leaves the 32B ones); until session 13 8B down went to the tensor cores
    (session 8's figures, before the lines kernel)."""
    return k <= 4096 or n > 4 * k or (n <= 4096 and k <= 3 * n)


def routes_to_gemv(m: int, n: int, k: int) -> bool:
    """Whether :func:`w12_gemm` without a ``gemv`` override runs ``m`` rows of a ``[n, k]`` weight on the GEMV
    (one row and :func:`one_row_gemv`) rather than the tensor-core kernel."""
    return m == 1 and one_row_gemv(n, k)


#: launch overrides :func:`w12_gemm` takes (any other name is refused: a misspelt tuning knob must not pass silently)
OVERRIDES = frozenset({"block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages", "w_left", "gemv", "words",
                       "fused_split", "asm", "load_stages", "lines", "x_gather", "esc_early", "maxnreg"})


def _check_overrides(overrides: dict) -> None:
    unknown = sorted(set(overrides) - OVERRIDES)
    if unknown:
        raise W12GemmError(f"unknown w12_gemm override(s) {unknown}; known: {sorted(OVERRIDES)}")
    for key in ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages", "load_stages"):
        v = overrides.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise W12GemmError(f"w12_gemm override {key} must be a positive integer, got {v!r}")
    v = overrides.get("maxnreg")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not (v == 0 or 24 <= v <= 255)):
        raise W12GemmError(f"w12_gemm override maxnreg must be 0 (no cap) or a register count in 24..255, got {v!r}")
    for key in ("w_left", "gemv", "words", "fused_split", "asm", "lines", "x_gather", "esc_early"):
        v = overrides.get(key)
        if v is not None and not isinstance(v, bool):
            raise W12GemmError(f"w12_gemm override {key} must be True or False, got {v!r}")


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
        escapes: :func:`escape_table` of ``w12`` (computed when None; :class:`W12Linear` keeps it). A given table
            is checked by :func:`check_escape_table` on its first use with this weight (values, and that it is
            ``escape_table(w12)``: one device sync), then not again while its tensors and the weight's are the same
            memory with unchanged version counters (:func:`_check_escapes_once`); not checked while a CUDA graph
            is being captured (check it before the capture, e.g. with an eager call).
        overrides: block_m / block_n (16–128, dividing 128) / block_k (a multiple of 64) / split_k /
            num_warps / num_stages / w_left, and ``gemv``: True runs
            :func:`~specpilot.w12.gemv.w12_gemv` (FMAs; 1..8 rows), False the tensor-core kernel;
            default: the GEMV for one row when :func:`one_row_gemv` says so, else the tensor-core kernel.
            ``fused_split`` (default: up to :data:`FUSED_SPLIT_MAX_ROWS` rows): with split K, the tile's last split
            adds the partials in the kernel (:func:`_finish_splits`, bitwise the same sum) instead of a second
            launch (record-word tensor-core kernel and GEMV; ignored by ``words=False``; see :func:`split_locks`
            for CUDA graphs).
            ``esc_early``: whether split 0 loads the escape slots before its K loop (:func:`default_config`; the
            one-row GEMV: :func:`~specpilot.w12.gemv.gemv_config`).
            ``maxnreg``: the tensor-core kernel's register cap (registers a thread, 24..255; 0: none; default:
            :func:`default_config`'s, see :data:`WAVE_MAXNREG`); changes no value.
            ``words`` (default True): the tensor-core kernel that reads record words
            (:func:`~specpilot.w12.mma.w12_mma`; on the H200 1.0–1.2x faster than ``words=False``, the
            byte-loading kernel below, at 16–256 rows: ``results/w12_dense_probe_h200_2026-11-30.json``).
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
              trusted: bool) -> torch.Tensor:
    """:func:`w12_gemm`; ``trusted``: ``escapes`` is known to be ``escape_table(w12)`` (:class:`W12Linear`'s own
    table), so its values are not checked (its layout still is: no device sync)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    _check(x, w12, bias)
    _check_overrides(overrides)
    m, k = x.shape
    n = w12.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise W12GemmError(f"w12_gemm takes 1..{MAX_ROWS} rows, got {m}")
    x = x if x.stride(1) == 1 else x.contiguous()
    if escapes is None:
        row_ptr, esc_k, esc_d = escape_table(w12)
    else:
        row_ptr, esc_k, esc_d = _escape_layout(w12, escapes, x.device)
        if not trusted:
            _check_escapes_once(w12, (row_ptr, esc_k, esc_d))
    if overrides.get("gemv", routes_to_gemv(m, n, k)):
        from specpilot.w12.gemv import w12_gemv  # here, not at the top: w12_gemv imports this module's kernels

        return w12_gemv(x, w12, bias, (row_ptr, esc_k, esc_d), overrides)
    cfg = default_config(m, n, k, _num_sms(x.device.index if x.is_cuda else None))
    cfg.update({key: v for key, v in overrides.items() if v is not None})
    bm, bn, bk, split = cfg["block_m"], cfg["block_n"], cfg["block_k"], cfg["split_k"]
    if RECORD_ROWS % bn or bk % RECORD_COLS or bm < 16 or bn < 16:
        raise W12GemmError(f"block_n must divide {RECORD_ROWS}, block_k be a multiple of {RECORD_COLS}, blocks >= 16")
    if cfg.get("words"):
        from specpilot.w12.mma import w12_mma  # here, not at the top: w12_mma imports this module's kernels

        return w12_mma(x, w12, bias, (row_ptr, esc_k, esc_d), cfg)
    kt = w12.records.shape[1]
    k_pad = kt * RECORD_COLS
    k_per_split = triton.cdiv(triton.cdiv(k_pad, split), bk) * bk
    even = k_per_split * split == k_pad
    out, part, b = _outputs(x, n, split, bias)
    _w12_gemm_kernel[(triton.cdiv(n, bn), split, triton.cdiv(m, bm))](
        x, w12.records, w12.base, b, out, part, row_ptr, esc_k, esc_d, m, n, k, k_pad, x.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, K_PER_SPLIT=k_per_split, SPLIT_K=split, EVEN=even,
        HAS_BIAS=bias is not None, FP32=x.dtype == torch.float32, W_LEFT=bool(cfg["w_left"]),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return _sum_splits(part, out, b, split, bias is not None)


def _outputs(x: torch.Tensor, n: int, split: int, bias: torch.Tensor | None):
    """Buffers of one W12 kernel launch: ``out [M, N]`` in x's dtype, the split-K partial sums ``[split, M, N]``
    float32 (``out`` itself without split) and the bias argument (``out`` as a placeholder without bias)."""
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    return out, part, (bias if bias is not None else out)


_LOCKS: dict = {}
_RETIRED: list = []  # outgrown counter buffers: a captured CUDA graph may still point at one, so never freed


def split_locks(device: torch.device, tiles: int) -> torch.Tensor | None:
    """Zeroed int32 counters ``[≥ tiles]`` for in-kernel split-K sums (``fused_split``), one buffer per device and
    current CUDA stream (kernels on one stream run one after another; each tile's last split resets its counter
    to 0, so the buffer stays zeroed between calls and inside replayed CUDA graphs). Grows by reallocation; an
    outgrown buffer is kept alive for graphs that captured it. Graphs captured on one stream share its buffer:
    do not replay two of them at once on different streams.

    Returns None while the current stream is capturing a CUDA graph and has no (large enough) buffer (a new one
    would belong to the graph's memory pool): the caller then uses the two-kernel sum, which gives the same bits.
    Call :func:`reserve_split_locks` for the capture stream before capturing to get the fused path in the graph."""
    dev = torch.device(device)
    key = (dev, torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0)
    buf = _LOCKS.get(key)
    if buf is None or buf.numel() < tiles:
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _new_locks(key, tiles)
    return buf


#: counters reserved for a capture stream (tiles of the largest split-K launch: cdiv(N, 16) x cdiv(M, BLOCK_M))
CAPTURE_LOCKS = 1 << 16


def reserve_split_locks(device: torch.device, stream: "torch.cuda.Stream", tiles: int = CAPTURE_LOCKS) -> None:
    """Before a CUDA graph is captured on ``stream`` (``torch.cuda.graph(...).capture_stream``): give that stream a
    zeroed counter buffer of at least ``tiles`` counters (256 KiB by default), so that the W12 kernels captured
    there sum their split-K partials in the kernel (:func:`split_locks`). Must not be called while capturing
    (raises RuntimeError then); does nothing off CUDA."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("reserve_split_locks must run before the capture, not inside it")
    key = (dev, stream.cuda_stream)
    if key not in _LOCKS or _LOCKS[key].numel() < tiles:
        _new_locks(key, tiles)


def _new_locks(key, tiles: int) -> torch.Tensor:
    """A zeroed counter buffer for ``key`` (device, stream handle); the outgrown one is retired, never freed."""
    if key in _LOCKS:
        _RETIRED.append(_LOCKS[key])
    buf = _LOCKS[key] = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=key[0])
    return buf


def _sum_splits(part, out, b, split: int, has_bias: bool, fused: bool = False, add=None,
                block_n: int = 16) -> torch.Tensor:
    """With split K: add the partial sums in split order (split 0's holds the escapes), then the bias, into ``out``
    (:func:`_w12_split_sum_kernel`; nothing to do when the kernel did it itself, ``fused``); returns ``out``.
    ``add``: the one-row GEMV's fused residual add ``(residual [1, N], sq_out [cdiv(N, block_n)] float32)``
    (:mod:`specpilot.w12.norm`); the sum then runs in the GEMV's tiles (``block_n`` columns, one row, one
    warp)."""
    if split > 1 and not fused:
        m, n = out.shape
        fuse = {} if add is None else dict(ADD=True, Res=add[0], SqOut=add[1])
        bm, bn, warps = (1, block_n, 1) if add is not None else (16, 64, 4)
        _w12_split_sum_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
            part, b, out, m, n, SPLIT_K=split, BLOCK_M=bm, BLOCK_N=bn, HAS_BIAS=has_bias, num_warps=warps, **fuse)
    return out


class W12Linear(nn.Module):
    """A linear layer ``y = x Wᵀ + b`` whose bf16 weight is held in W12 (§4.1): ~12 bits a weight.

    Buffers (move with ``.to(device)``; ``.to(dtype)`` casts only the bias): ``records`` uint8
    ``[ceil(N/128), ceil(K/64), 12288]``, ``base`` uint8 ``[N]``, ``esc_idx`` int32/int64 ``[E]``, ``esc_val``
    int16 ``[E]`` (the :class:`~specpilot.w12.format.W12Tensor`), the kernel's escape table ``esc_row_ptr``
    int32 ``[N + 1]``, ``esc_k`` int32 ``[4N + O]``, ``esc_delta_bits`` int32 ``[4N + O]`` (float32 bits, so a dtype
    cast leaves them alone; :func:`escape_table`'s layout), and ``bias`` ``[N]`` or None.

    Forward: :func:`w12_gemm` on CUDA for bf16 / float32 activations up to
    :data:`DENSE_ROWS` rows; wider passes (prefill) decode the weight once with
    :func:`~specpilot.w12.dense.w12_decode_dense` and call ``F.linear`` (bf16: bit for bit the bf16
    layer's output); elsewhere
    the reference, :func:`w12_gemm_reference` (in float32 bitwise ``nn.Linear`` with the decoded weight). On
    CUDA (float16 activations) the reference decodes on every call and caches nothing; on the CPU, where the
    path exists for correctness tests and a full decode per pass would dominate, the decoded bf16 weight is
    kept after the first call (2 more bytes a weight, not a buffer: ``state_dict`` holds the records only).
    ``use_kernel``: None = as above; True forces the kernel (the Triton interpreter on the CPU in tests);
    False forces the reference.
    """

    def __init__(self, w12: W12Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        w12.validate()
        self.out_features, self.in_features = w12.shape
        self.sha256 = w12.sha256
        for name in ("records", "base", "esc_idx", "esc_val"):
            self.register_buffer(name, getattr(w12, name))
        row_ptr, esc_k, delta = escape_table(w12)
        self.register_buffer("esc_row_ptr", row_ptr)
        self.register_buffer("esc_k", esc_k)
        self.register_buffer("esc_delta_bits", delta.view(torch.int32))
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise W12GemmError(f"bias must be [{self.out_features}], got {tuple(bias.shape)}")
        self.register_buffer("bias", None if bias is None else bias.detach().to(w12.records.device))
        self.use_kernel: bool | None = None
        self._dense: torch.Tensor | None = None  # CPU only: the decoded weight, see the class docstring

    @classmethod
    def from_w12(cls, w12: W12Tensor, bias: torch.Tensor | None = None) -> "W12Linear":
        """Wrap an encoded weight (e.g. from a packed directory) and an optional bias ``[N]``."""
        return cls(w12, bias)

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> "W12Linear":
        """Encode ``layer``'s weight on its device (losslessly) and keep its bias.

        Raises:
            W12FormatError: the weight is not made of bfloat16 values (W12 is lossless only for bf16; a
                float32 / float16 weight qualifies when every value is exactly a bf16 value, e.g. a bf16
                checkpoint loaded in float32).
        """
        w = layer.weight.detach()
        wb = w.to(torch.bfloat16)
        if w.dtype != torch.bfloat16 and not torch.equal(wb.to(w.dtype), w):
            raise W12FormatError(f"W12 needs bfloat16 weights: this {str(w.dtype).removeprefix('torch.')} weight "
                                 f"{tuple(w.shape)} has values that are not bfloat16 values (use a bf16 checkpoint)")
        return cls(encode(wb, device=w.device), layer.bias)

    def w12(self) -> W12Tensor:
        """The held weight as a :class:`~specpilot.w12.format.W12Tensor` (views of the buffers)."""
        return W12Tensor(self.records, self.base, self.esc_idx, self.esc_val, (self.out_features, self.in_features),
                         self.sha256)

    def escapes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kernel's escape table of the held weight: ``(row_ptr int32 [N + 1], k int32 [4N + O], delta float32
        [4N + O])`` (views of the buffers; :func:`escape_table`'s layout, O the escapes past a channel's 4 slots)."""
        return self.esc_row_ptr, self.esc_k, self.esc_delta_bits.view(torch.float32)

    def decoded_weight(self) -> torch.Tensor:
        """The exact bf16 weight ``[N, K]`` (reference decode; checks nothing)."""
        return decode(self.w12(), check=False)

    def _kernel_ok(self, x: torch.Tensor) -> bool:
        if self.use_kernel is not None:
            return self.use_kernel
        return x.is_cuda and triton is not None and x.dtype in (torch.bfloat16, torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` -> ``[..., N]`` in x's dtype. Raises W12GemmError when the last dim is not K."""
        if x.shape[-1] != self.in_features:
            raise W12GemmError(f"W12Linear takes {self.in_features} features, got shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0 or not self._kernel_ok(x2):
            w = self._dense if self._dense is not None and self._dense.device == self.records.device else None
            if w is None:
                w = self.decoded_weight()
                self._dense = None if w.is_cuda else w
            y = _linear_f32(x2, w, self.bias)
        elif x2.shape[0] > DENSE_ROWS:  # wide pass (prefill): decode once, then the bf16 model's own GEMM
            from specpilot.w12.dense import w12_decode_dense

            w = w12_decode_dense(self.w12())
            y = F.linear(x2, w, self.bias) if x2.dtype == torch.bfloat16 else _linear_f32(x2, w, self.bias)
        else:
            esc = self.escapes()
            w12 = self.w12()  # its own escape_table: trusted, no value check and no sync
            y = torch.cat([_w12_gemm(x2[i:i + MAX_ROWS], w12, self.bias, esc, {}, trusted=True)
                           for i in range(0, x2.shape[0], MAX_ROWS)]) if x2.shape[0] > MAX_ROWS else \
                _w12_gemm(x2, w12, self.bias, esc, {}, trusted=True)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, escapes={self.esc_idx.numel()}")


if triton is not None:
    _SLOTS = tl.constexpr(ESC_SLOTS)

    @triton.jit
    def _decode_tile(v, p, base7, FP32: tl.constexpr):
        """Views ``v [BN, BK]`` and packed nibbles ``p [BN, BK/2]`` (uint8), ``base7 [BN]`` = ``B_n << 7``
        -> the weights ``[BN, BK]`` (float32 if FP32, else bf16), bit-exact codes."""
        vi = v.to(tl.int32)
        pi = p.to(tl.int32)
        nib = tl.interleave(pi & 15, pi >> 4)  # column 2c from the low nibble, 2c + 1 from the high one
        bits = ((vi & 0x80) << 8) | (((vi & 0x7F) << 4) + base7[:, None]) | nib
        if FP32:  # one return: compiled Triton rejects a constexpr branch's early return of another dtype
            w = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            w = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return w

    @triton.jit
    def _x_load(ptr, mask, up_offset, GLU: tl.constexpr, NORM: tl.constexpr = False, w_ptr=None, rstd=None):
        """Activations at ``ptr`` (masked to 0): the values there, or with ``GLU`` ``silu(gate) · up`` of the gate
        at ``ptr`` and the up value ``up_offset`` elements further (:func:`~specpilot.kernels.fused.silu_mul_values`;
        silu(0) · 0 = 0 where masked), or with ``NORM`` the RMSNorm of the values there: ``w · (x · rstd)`` with the
        norm weights at ``w_ptr`` (:func:`~specpilot.kernels.fused.rmsnorm_values`, :mod:`~specpilot.w12.norm`)."""
        if GLU:
            xv = silu_mul_values(tl.load(ptr, mask=mask, other=0.0), tl.load(ptr + up_offset, mask=mask, other=0.0))
        elif NORM:
            xv = rmsnorm_values(tl.load(ptr, mask=mask, other=0.0), tl.load(w_ptr, mask=mask, other=0.0), rstd)
        else:
            xv = tl.load(ptr, mask=mask, other=0.0)
        return xv

    @triton.jit
    def _norm_rstd(SqIn, n_sq, K, eps, SQ_BLOCK: tl.constexpr):
        """The fused norm's scale (:mod:`~specpilot.w12.norm`): the ``n_sq`` float32 tile sums of squares at
        ``SqIn`` (``SQ_BLOCK`` ≥ n_sq, a power of two) summed by ``tl.sum`` (a fixed order for a given layout: every
        program of a launch gets the same bits), then :func:`~specpilot.kernels.fused.rms_rstd` over K columns."""
        i = tl.arange(0, SQ_BLOCK)
        return rms_rstd(tl.sum(tl.load(SqIn + i, mask=i < n_sq, other=0.0), axis=0), K, eps)

    @triton.jit
    def _escapes_load(RowPtr, EscK, EscD, offs_n, ok):
        """The escape data a tile's split 0 needs after its K loop, loaded before it (nothing waits on these loads
        until the epilogue): slot columns ``sk [BN, S]`` int32 (-1: empty), slot deltas ``sd [BN, S]`` float32, and
        the overflow list's start ``lo [BN]`` and length ``cnt [BN]`` (:func:`escape_table`). ``ok [BN]``: the
        channels to load (pass ``n_ok & (pid_k == 0)``: other splits load nothing)."""
        j = tl.arange(0, _SLOTS)
        at = offs_n[:, None] * _SLOTS + j[None, :]
        sk = tl.load(EscK + at, mask=ok[:, None], other=-1)
        sd = tl.load(EscD + at, mask=ok[:, None], other=0.0)
        lo = tl.load(RowPtr + offs_n, mask=ok, other=0)
        cnt = tl.load(RowPtr + offs_n + 1, mask=ok, other=0) - lo
        return sk, sd, lo, cnt

    @triton.jit
    def _add_escapes(acc, X, stride_xm, EscK, EscD, sk, sd, lo, cnt, offs_m, m_ok, TRANS: tl.constexpr,
                     GLU: tl.constexpr = False, NORM: tl.constexpr = False, NormW=None, rstd=None):
        """``acc[m, n] += x[m, k_e] d_e`` for channel n's escapes one at a time in list order (:func:`_escapes_load`'s
        ``sk, sd, lo, cnt``): its slots, then its overflow list (the loop runs to the tile's longest overflow, usually
        0 times); a channel with fewer escapes is left alone in the other steps.
        ``acc`` is ``[BN, BM]`` when TRANS, else ``[BM, BN]``. ``GLU``: X is a contiguous ``gate_up [M, 2K]``
        (``stride_xm`` = 2K) and ``x[m, k] = silu(gate[m, k]) · up[m, k]``
        (:func:`~specpilot.kernels.fused.silu_mul_values`, the bits :func:`~specpilot.kernels.fused.silu_mul` stores).
        ``NORM``: ``x[m, k]`` is the RMSNorm of X's value with weight ``NormW[k]`` and scale ``rstd`` (:func:`_x_load`;
        the lines GEMV only, untransposed)."""
        col = tl.arange(0, _SLOTS)[None, :]
        filled = tl.max(tl.sum((sk >= 0).to(tl.int32), axis=1), axis=0)  # slots the tile's fullest channel uses
        # a loop, not unrolled: unrolled, the four steps' gathers were live together (offline ptxas, 16-row
        # tensor-core tile: 100 registers against 78, and spills at 64 rows)
        for j in range(0, filled):  # slot j of every channel: one [BN] column of the [BN, S] loads
            k = tl.sum(tl.where(col == j, sk, 0), axis=1)
            d = tl.sum(tl.where(col == j, sd, 0.0), axis=1)  # exact: one value plus zeros
            acc = _add_escape(acc, X, stride_xm, k, d, k >= 0, offs_m, m_ok, TRANS, GLU, NORM, NormW, rstd)
        for j in range(0, tl.max(cnt, axis=0)):
            more = j < cnt
            k = tl.load(EscK + lo + j, mask=more, other=0)
            d = tl.load(EscD + lo + j, mask=more, other=0.0)
            acc = _add_escape(acc, X, stride_xm, k, d, more, offs_m, m_ok, TRANS, GLU, NORM, NormW, rstd)
        return acc

    @triton.jit
    def _add_escape(acc, X, stride_xm, k, d, has, offs_m, m_ok, TRANS: tl.constexpr, GLU: tl.constexpr,
                    NORM: tl.constexpr, NormW, rstd):
        """``acc[m, n] += x[m, k_n] · d_n`` where ``has[n]`` (one escape of each channel: ``k, d, has [BN]``), else
        ``acc`` unchanged; x read as :func:`_add_escapes` says."""
        if TRANS:
            ok = has[:, None] & m_ok[None, :]
            xv = _x_load(X + offs_m[None, :] * stride_xm + k[:, None], ok, stride_xm // 2, GLU)
            acc = tl.where(ok, acc + xv.to(tl.float32) * d[:, None], acc)
        else:
            ok = m_ok[:, None] & has[None, :]
            if NORM:
                xv = _x_load(X + offs_m[:, None] * stride_xm + k[None, :], ok, 0, False, True, NormW + k[None, :], rstd)
            else:
                xv = _x_load(X + offs_m[:, None] * stride_xm + k[None, :], ok, stride_xm // 2, GLU)
            acc = tl.where(ok, acc + xv.to(tl.float32) * d[None, :], acc)
        return acc

    @triton.jit
    def _w12_gemm_kernel(X, Rec, Base, Bias, Out, Part, RowPtr, EscK, EscD, M, N, K, K_PAD, stride_xm,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PER_SPLIT,
                         SPLIT_K: tl.constexpr, EVEN: tl.constexpr, HAS_BIAS: tl.constexpr, FP32: tl.constexpr,
                         W_LEFT: tl.constexpr):
        """Grid ``(cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, BLOCK_M))``: BLOCK_N rows of one record band, one K
        chunk (K_PER_SPLIT, a multiple of BLOCK_K), BLOCK_M activation rows. ``W_LEFT``: ``acc [BN, BM] =
        W xᵀ`` (the weights as the left MMA operand), else ``acc [BM, BN] = x Wᵀ``."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        band_bytes = (K_PAD // 64) * 12288
        row_v = (offs_n // 128) * band_bytes + (offs_n % 128) * 64  # the row's views in the band's record 0
        row_p = (offs_n // 128) * band_bytes + 8192 + (offs_n % 128) * 32
        base7 = tl.load(Base + offs_n, mask=n_ok, other=127).to(tl.int32) << 7
        rk = tl.arange(0, BLOCK_K)
        rk2 = tl.arange(0, BLOCK_K // 2)
        col_v = (rk // 64) * 12288 + rk % 64
        col_p = (rk2 // 32) * 12288 + rk2 % 32
        k0 = pid_k * K_PER_SPLIT
        sk, sd, lo, cnt = _escapes_load(RowPtr, EscK, EscD, offs_n, n_ok & (pid_k == 0))
        if W_LEFT:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kk in range(0, K_PER_SPLIT, BLOCK_K):
            kb = k0 + kk
            offs_k = kb + rk
            a = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=m_ok[:, None] & (offs_k < K)[None, :], other=0.0)
            rec = Rec + (kb // 64) * 12288
            if EVEN:
                v = tl.load(rec + row_v[:, None] + col_v[None, :])
                p = tl.load(rec + row_p[:, None] + col_p[None, :])
            else:
                v = tl.load(rec + row_v[:, None] + col_v[None, :], mask=(offs_k < K_PAD)[None, :], other=0)
                p = tl.load(rec + row_p[:, None] + col_p[None, :], mask=(kb + 2 * rk2 < K_PAD)[None, :], other=0)
            w = _decode_tile(v, p, base7, FP32)
            if FP32:
                if W_LEFT:
                    acc += tl.dot(w, tl.trans(a), input_precision="ieee")
                else:
                    acc += tl.dot(a, tl.trans(w), input_precision="ieee")
            else:
                if W_LEFT:
                    acc += tl.dot(w, tl.trans(a))
                else:
                    acc += tl.dot(a, tl.trans(w))
        if W_LEFT:
            dst = offs_m[None, :] * N + offs_n[:, None]
            ok = n_ok[:, None] & m_ok[None, :]
        else:
            dst = offs_m[:, None] * N + offs_n[None, :]
            ok = m_ok[:, None] & n_ok[None, :]
        if pid_k == 0:
            acc = _add_escapes(acc, X, stride_xm, EscK, EscD, sk, sd, lo, cnt, offs_m, m_ok, W_LEFT)
        _split_end(acc, Part, Part, Bias, Out, M, N, offs_n, n_ok, dst, ok, pid_k, SPLIT_K, False, HAS_BIAS, W_LEFT)

    @triton.jit
    def _store_out(acc, Bias, Out, offs_n, n_ok, dst, ok, HAS_BIAS: tl.constexpr, TRANS: tl.constexpr,
                   ADD: tl.constexpr = False, Res=None, SqOut=None):
        """The shared end of the W12 kernels: ``acc`` (the K sum with its escapes, float32, ``[BN, BM]`` when TRANS
        else ``[BM, BN]``) plus the bias, stored to ``Out + dst`` in Out's dtype. ``ADD`` (one row, untransposed;
        :mod:`~specpilot.w12.norm`): what is stored is ``Res[dst] + y`` (y the output rounded to the dtype,
        the sum rounded to it too: the bits :func:`~specpilot.kernels.fused.add_rmsnorm` gives the residual
        stream), and the float32 sum of its squares over the tile goes to ``SqOut[program_id(0)]``."""
        if HAS_BIAS:
            bias = tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            if TRANS:
                acc += bias[:, None]
            else:
                acc += bias[None, :]
        y = acc.to(Out.dtype.element_ty)
        if ADD:
            y = tl.load(Res + dst, mask=ok, other=0.0) + y  # rounded to the dtype, as add_rmsnorm's residual add
            yf = tl.where(ok, y.to(tl.float32), 0.0)
            tl.store(SqOut + tl.program_id(0), tl.sum(tl.sum(yf * yf, axis=1), axis=0))
        tl.store(Out + dst, y, mask=ok)

    @triton.jit
    def _split_end(acc, Part, Lock, Bias, Out, M, N, offs_n, n_ok, dst, ok, pid_k, SPLIT_K: tl.constexpr,
                   FUSED: tl.constexpr, HAS_BIAS: tl.constexpr, TRANS: tl.constexpr, ADD: tl.constexpr = False,
                   Res=None, SqOut=None):
        """Every W12 kernel's end after its K loop and escapes: without split K, :func:`_store_out`; with it, this
        split's partial to ``Part + pid_k M N + dst`` and, with ``FUSED``, :func:`_finish_splits` (``Lock``: the
        tile's counter)."""
        if SPLIT_K == 1:
            _store_out(acc, Bias, Out, offs_n, n_ok, dst, ok, HAS_BIAS, TRANS, ADD, Res, SqOut)
        else:
            tl.store(Part + pid_k * M * N + dst, acc, mask=ok)
            if FUSED:
                _finish_splits(Part, Lock, Bias, Out, M, N, offs_n, n_ok, dst, ok, SPLIT_K, HAS_BIAS, TRANS, ADD, Res,
                               SqOut)

    @triton.jit
    def _finish_splits(Part, Lock, Bias, Out, M, N, offs_n, n_ok, dst, ok, SPLIT_K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, TRANS: tl.constexpr, ADD: tl.constexpr = False, Res=None, SqOut=None):
        """In-kernel split-K sum (``fused_split``), after this program stored its partial tile at ``Part + pid_k M N
        + dst``: a barrier, then one ``acq_rel`` atomic increment of the tile's counter ``Lock``; the program that
        sees ``SPLIT_K − 1`` (the last split of the tile to finish) adds the partials in split order (reading past
        L1) and the bias, exactly as :func:`_w12_split_sum_kernel` does, stores ``Out`` and resets the counter. The
        result does not depend on which split finishes last. ``dst`` / ``ok``: the tile's element offsets in
        ``[M, N]`` and mask (``[BN, BM]`` when TRANS, else ``[BM, BN]``). ``ADD``: see :func:`_store_out`."""
        tl.debug_barrier()  # every thread's partial is stored before the release below
        seen = tl.atomic_add(Lock, 1, sem="acq_rel", scope="gpu")
        if seen == SPLIT_K - 1:
            acc = tl.load(Part + dst, mask=ok, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                acc += tl.load(Part + s * M * N + dst, mask=ok, other=0.0, cache_modifier=".cg")
            _store_out(acc, Bias, Out, offs_n, n_ok, dst, ok, HAS_BIAS, TRANS, ADD, Res, SqOut)
            tl.atomic_xchg(Lock, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _w12_split_sum_kernel(Part, Bias, Out, M, N, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, ADD: tl.constexpr = False,
                              Res=None, SqOut=None):
        """``Out = Σ_s Part[s]`` in split order (split 0's partial holds the escapes), then the bias (``ADD``: plus
        the residual, see :func:`_store_out`; the launch's BLOCK_N is then the GEMV's, so tile ``program_id(0)`` is the
        GEMV's tile)."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        n_ok = offs_n < N
        ok = m_ok[:, None] & n_ok[None, :]
        dst = offs_m[:, None] * N + offs_n[None, :]
        acc = tl.load(Part + dst, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLIT_K):  # unrolled: the partials' loads issue together, summed in split order
            acc += tl.load(Part + s * M * N + dst, mask=ok, other=0.0)
        _store_out(acc, Bias, Out, offs_n, n_ok, dst, ok, HAS_BIAS, False, ADD, Res, SqOut)


__all__ = ["w12_gemm", "w12_gemm_reference", "W12Linear", "W12GemmError", "default_config", "escape_table", "one_row_gemv",
           "check_escape_table",
           "split_locks",
           "codes_at", "MAX_ROWS", "DENSE_ROWS"]
