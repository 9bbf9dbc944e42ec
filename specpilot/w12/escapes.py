"""W12 escapes as the kernels read them (§4.1): the escape table, its checks, and the kernel's error type.

At an escape position (a weight outside its channel's 16-binade window, a zero, a denormal, ±inf, NaN) the W12
records hold a *saturated* code ``c`` (the nearest in-window value of the right sign), so a kernel's main loop
computes ``Σ_k x_k c_k``. Each output channel's escapes are kept as ``(k_e, d_e)``, ``d_e = fl32(w_e - c_e)``
(``w_e`` the true bf16 weight), in :func:`escape_table`'s layout: the channel's first :data:`ESC_SLOTS` in fixed
slots (loadable without reading anything first), the rest in a CSR overflow list. The kernels add ``x[m, k_e] d_e``
one escape at a time in list order (:mod:`specpilot.w12.epilogue`).

- :func:`codes_at`: the saturated codes the records hold (plain PyTorch).
- :func:`escape_table`: the table of a weight. With ``view=True`` the table of the 8-bit-view kernels (§4.3 Q pass,
  :mod:`specpilot.w12.view`): those decode the view byte with the 4 dropped mantissa bits at ``1000b``, so their
  ``c_e`` is that value and ``d_e = fl32(w_e − c_e^view)`` (same rows and columns, other deltas).
- :func:`escape_layout` / :func:`check_escape_table`: a caller's table checked for layout (no device sync) and for
  values (one sync); :func:`check_escapes_once` runs the value check once per table.
- :class:`W12GemmError`: what every W12 kernel module raises for bad inputs (defined here, the lowest of them).
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from specpilot.errors import SpecPilotError
from specpilot.w12.format import RECORD_BYTES, RECORD_COLS, RECORD_ROWS, VIEW_BYTES, W12Tensor


class W12GemmError(SpecPilotError):
    """Activations that do not fit a W12 weight (shape, dtype, layout) or a weight too large for the kernel."""


def codes_at(w12: W12Tensor, flat: torch.Tensor, view: bool = False) -> torch.Tensor:
    """The bf16 values the kernel decodes at flat positions ``flat [E] long`` (``n * K + k``) from the records
    alone (no escape patching): the saturated codes at escape positions. ``view``: what the 8-bit-view kernels
    decode (§4.3 Q pass), the view byte with the 4 dropped mantissa bits at their midpoint ``1000b``; the nibble
    plane is not read. Plain PyTorch. Returns bf16 ``[E]``."""
    k = w12.shape[1]
    n, c = flat // k, flat % k
    rec = (n // RECORD_ROWS * w12.records.shape[1] + c // RECORD_COLS) * RECORD_BYTES  # byte offset of the record
    r, cc = n % RECORD_ROWS, c % RECORD_COLS
    flat_rec = w12.records.reshape(-1)
    v = flat_rec[rec + r * RECORD_COLS + cc].to(torch.int32)
    if view:
        nib = 8
    else:
        p = flat_rec[rec + VIEW_BYTES + r * (RECORD_COLS // 2) + cc // 2].to(torch.int32)
        nib = (p >> (4 * (c % 2))) & 15
    e = w12.base[n].to(torch.int32) + ((v >> 3) & 15)
    bits = ((v >> 7) << 15) | (e << 7) | ((v & 7) << 4) | nib
    return (bits - ((bits >> 15) << 16)).to(torch.int16).view(torch.bfloat16)


#: escapes a channel keeps in fixed slots of :func:`escape_table` (the rest go to its overflow list). Random
#: N(0, 0.02) weights of the Qwen3-8B shapes have at most 4 escapes in any channel but down's (K = 12288: 11 of
#: 4096 channels have more), and at most 2–4 in a tile of 64 channels
ESC_SLOTS = 4


def escape_table(w12: W12Tensor, view: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The escape table the kernels read (module docstring): slots, then a CSR overflow list. ``view``: the table of
    the 8-bit-view kernels (§4.3 Q pass, :func:`~specpilot.w12.view.w12_view_gemm`), whose codes are decoded with the
    midpoint nibble (:func:`codes_at` with ``view``): the same rows and columns, ``delta = fl32(w_true − c_view)``.

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
    delta = true - codes_at(w12, idx, view).float()
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



def escape_layout(w12: W12Tensor, escapes, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


def check_escape_table(w12: W12Tensor, escapes, view: bool = False) -> None:
    """Check that ``escapes`` is :func:`escape_table` of ``w12`` (``escape_table(w12, view=True)`` with ``view``: the
    8-bit-view kernels' table), so that the W12 kernels read nothing out of bounds and add the right escapes.

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
    check fails. :func:`~specpilot.w12.gemm.w12_gemm` runs it once per table (:func:`check_escapes_once`).
    Raises: W12GemmError with a one-line message naming the first bad entry (or the layout problem);
        W12FormatError for a malformed ``w12``.
    """
    if not isinstance(w12, W12Tensor):
        raise W12GemmError(f"check_escape_table takes a W12Tensor weight, got {type(w12).__name__}")
    row_ptr, ks, d = escape_layout(w12, escapes, w12.records.device)
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
    ref = escape_table(w12, view)
    if ref[1].numel() == total:
        same_d = (d == ref[2]) | (d.isnan() & ref[2].isnan())
        flags.append((row_ptr == ref[0]).all() & (ks == ref[1]).all() & same_d.all())
    else:
        flags.append(torch.zeros((), dtype=torch.bool, device=ks.device))
    if all(torch.stack([f.reshape(()) for f in flags]).tolist()):  # the one sync
        return
    raise W12GemmError(_first_bad_escape(w12, (row_ptr, ks, d), ref, view))


def _first_bad_escape(w12: W12Tensor, escapes, ref, view: bool = False) -> str:
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
    name = "escape_table(w12, view=True)" if view else "escape_table(w12)"
    other = f"not {name} (a table of another weight{', or the exact kernels table,' if view else ''}?)"
    diff = (rp != rp_ref).nonzero()
    if diff.numel():
        i = int(diff[0, 0])
        return f"{at} {other}: row_ptr[{i}] is {int(rp[i])}, {name} has {int(rp_ref[i])}"
    diff = ((ks != ks_ref) | ~((d == d_ref) | (d.isnan() & d_ref.isnan()))).nonzero()
    if diff.numel():
        i = int(diff[0, 0])
        where = f"channel {i // S}, slot {i % S}" if i < s else \
            f"channel {int(torch.searchsorted(rp, torch.tensor(i, dtype=rp.dtype), right=True)) - 1}, overflow"
        return (f"{at} {other}: entry {i} ({where}) is k = {int(ks[i])}, delta = {float(d[i])!r}; {name} "
                f"has k = {int(ks_ref[i])}, delta = {float(d_ref[i])!r}")
    return f"{at} {other}"


#: tables :func:`check_escapes_once` has checked: key (the weight's shape, whether a view table, and, for each of the table's three
#: tensors and the weight's four, its storage, offset, shape, strides and dtype) -> (weak references to those
#: storages, their tensors' version counters)
_CHECKED_TABLES: dict = {}
_CHECKED_MAX = 256


def _version(t: torch.Tensor):
    """``t._version``; None for an inference-mode tensor (it has no version counter)."""
    return None if t.is_inference() else t._version  # (not try / except: raising costs ~10 µs a call)


def check_escapes_once(w12: W12Tensor, escapes, view: bool = False) -> None:
    """:func:`check_escape_table` (with ``view``: as the 8-bit-view kernels' table; a table checked for one use is
    checked again for the other) the first time a table is used with a weight, not on later calls while the seven
    tensors (the table's three, the weight's records / base / esc_idx / esc_val) are views of the same storages
    (held by weak reference: their addresses, in the key, are not reused while held) at the same offsets, shapes,
    strides and dtypes, with unchanged version counters (bumped by every in-place write through torch, in any view;
    :meth:`~specpilot.w12.linear.W12Linear.escapes`' fresh dtype view of its buffer hits too). Not re-checked: writes
    that bypass the counter (``.data``, DLPack, raw pointers) and in-place writes to inference-mode
    tensors (no counter). Skipped, and nothing recorded, while the current CUDA stream captures a graph (the check
    syncs). At most :data:`_CHECKED_MAX` tables are remembered (dead entries dropped first, then the oldest)."""
    ts = (*escapes, w12.records, w12.base, w12.esc_idx, w12.esc_val)
    key = (tuple(w12.shape), bool(view)) + tuple((t.untyped_storage()._cdata, t.storage_offset(), t.shape, t.stride(), t.dtype)
                                      for t in ts)
    hit = _CHECKED_TABLES.get(key)
    versions = tuple(_version(t) for t in ts)
    if hit is not None and hit[1] == versions:  # key equal: the same live storages (a held one's address is not reused)
        return
    if ts[0].is_cuda and torch.cuda.is_current_stream_capturing():
        return
    check_escape_table(w12, escapes, view)
    if len(_CHECKED_TABLES) >= _CHECKED_MAX:
        for old in [kk for kk, (refs, _) in _CHECKED_TABLES.items() if any(r.expired() for r in refs)]:
            del _CHECKED_TABLES[old]
        while len(_CHECKED_TABLES) >= _CHECKED_MAX:
            del _CHECKED_TABLES[next(iter(_CHECKED_TABLES))]
    _CHECKED_TABLES.pop(key, None)
    _CHECKED_TABLES[key] = (tuple(StorageWeakRef(t.untyped_storage()) for t in ts), versions)


__all__ = ["W12GemmError", "ESC_SLOTS", "codes_at", "escape_table", "escape_layout", "check_escape_table",
           "check_escapes_once"]
