"""W12: a lossless 12-bit format for 2-D bfloat16 weights (§4.1 of the paper).

Codes. A bf16 weight is ``sign(1) | exponent(8, biased) | mantissa(7)``. For each output channel (row) n of
a weight ``[N, K]`` we pick a window of 16 binades, biased exponents ``[B_n, B_n + 15]`` with
``1 <= B_n <= 239`` (so the window holds only normal numbers; the paper's ``E_n`` is ``B_n + 15``). ``B_n``
is the start of the window holding the most normal weights of the row (the lowest such start on a tie). A
weight whose exponent ``e`` lies in the window is the 12-bit code ``sign | (e - B_n)(4) | mantissa(7)``,
which restores it exactly. The code is split into

* the **8-bit view** ``sign << 7 | offset << 3 | mantissa >> 4`` (what a Q pass reads), and
* the **nibble** ``mantissa & 15`` (the 4 low mantissa bits).

Escapes. Every other weight (exponent outside the window, ±0, denormals, ±inf, NaN with any payload) is
an escape: its flat position ``n * K + k`` and its exact 16-bit pattern go to a sparse list sorted by
position, so grouped per channel. The code stored at an escape position *saturates* into the window:
exponent below the window (this includes ±0 and denormals) -> ``sign | 0 | 0000000``; above the window
(this includes ±inf and NaN) -> ``sign | 15 | 1111111``. Decoding overwrites every escape position, so a
kernel must patch escapes; a kernel that does not sees the nearest in-window value of the right sign.

Record layout (the unit a GEMM kernel loads). ``N`` is padded up to a multiple of 128 and ``K`` to a
multiple of 64; padded positions hold code 0 (view 0, nibble 0; a finite value a kernel must mask in K or
crop in N) and are never escapes. Record ``(t, j)`` covers output rows ``[128 t, 128 t + 128)`` and input
columns ``[64 j, 64 j + 64)`` and is 12288 bytes:

* bytes ``[0, 8192)``: the views, row-major: byte ``64 r + c`` is the view of weight ``(128 t + r, 64 j + c)``;
* bytes ``[8192, 12288)``: the nibbles, row-major, two per byte: byte ``8192 + 32 r + c // 2`` holds the
  nibble of column ``c`` in its low 4 bits when ``c`` is even and in its high 4 bits when ``c`` is odd.

Records are stored ``[N_pad / 128, K_pad / 64, 12288]`` uint8 (row band major, then K), so a kernel that
owns a 128-row band walks its K records at consecutive addresses, and a kernel tiling N by 16, 32 or 64
rows finds the views of its rows (``64 * rows`` bytes) and their nibbles (``32 * rows`` bytes) as two
contiguous runs inside the record.

Stored bytes (counted by :attr:`W12Tensor.bits_per_weight`): records (12 bits per padded weight), one byte
of ``B_n`` per row, and per escape 4 bytes of position (8 when ``N * K >= 2**31``) + 2 bytes of bits.

Only bfloat16 has W12: :func:`encode` refuses float16/float32 (:class:`W12FormatError`); the pack tool
stores such tensors as they are (:mod:`specpilot.w12.pack`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from specpilot.errors import CheckpointError

RECORD_ROWS, RECORD_COLS = 128, 64
VIEW_BYTES, NIBBLE_BYTES = RECORD_ROWS * RECORD_COLS, RECORD_ROWS * RECORD_COLS // 2
RECORD_BYTES = VIEW_BYTES + NIBBLE_BYTES  # 12288
WINDOW = 16
MIN_BASE, MAX_BASE = 1, 254 - (WINDOW - 1)  # windows hold normal exponents only
_CHUNK = 1 << 22  # weights per encode/decode band (bounds the int32 temporaries to ~16 MB each)


class W12FormatError(CheckpointError):
    """A W12 tensor or directory (§4.1) is malformed, corrupted, truncated, or its source is not bfloat16."""


@dataclass
class W12Tensor:
    """One W12-encoded bf16 weight ``[N, K]`` (§4.1).

    Attributes:
        records: uint8 ``[ceil(N/128), ceil(K/64), 12288]``, layout in the module docstring.
        base: uint8 ``[N]``, ``B_n`` = lowest biased exponent of row n's window (1..239).
        esc_idx: int32 (int64 when ``N*K >= 2**31``) ``[E]``, flat positions ``n*K + k``, strictly ascending.
        esc_val: int16 ``[E]``, the exact bf16 bit patterns at those positions.
        shape: ``(N, K)`` of the source.
        sha256: hex sha256 of the source's row-major little-endian bf16 bytes.
    """

    records: torch.Tensor
    base: torch.Tensor
    esc_idx: torch.Tensor
    esc_val: torch.Tensor
    shape: tuple[int, int]
    sha256: str

    @property
    def num_weights(self) -> int:
        """``N * K``."""
        return self.shape[0] * self.shape[1]

    @property
    def num_escapes(self) -> int:
        """Number of escaped weights E."""
        return int(self.esc_idx.numel())

    @property
    def nbytes(self) -> int:
        """All stored bytes: records + per-row bases + escape positions and values."""
        return sum(t.numel() * t.element_size() for t in (self.records, self.base, self.esc_idx, self.esc_val))

    @property
    def bits_per_weight(self) -> float:
        """``8 * nbytes / (N * K)`` (padding included)."""
        return 8.0 * self.nbytes / max(self.num_weights, 1)

    @property
    def escape_rate(self) -> float:
        """Escaped weights / ``N * K``."""
        return self.num_escapes / max(self.num_weights, 1)

    def validate(self) -> None:
        """Check dtypes, shapes and ranges (not the hash; see :func:`decode`).

        Raises:
            W12FormatError: naming the first inconsistency found.
        """
        n, k = self.shape
        nt, kt = -(-n // RECORD_ROWS), -(-k // RECORD_COLS)
        want = {"records": (torch.uint8, (nt, kt, RECORD_BYTES)), "base": (torch.uint8, (n,)),
                "esc_val": (torch.int16, (self.num_escapes,))}
        for name, (dtype, shape) in want.items():
            t = getattr(self, name)
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise W12FormatError(f"{name} is {t.dtype} {tuple(t.shape)}, expected {dtype} {shape} for a {n}x{k} weight")
        if self.esc_idx.dtype not in (torch.int32, torch.int64) or self.esc_idx.dim() != 1:
            raise W12FormatError(f"esc_idx is {self.esc_idx.dtype} {tuple(self.esc_idx.shape)}, expected 1-D int32/int64")
        if n and ((self.base < MIN_BASE) | (self.base > MAX_BASE)).any():
            raise W12FormatError(f"window base out of range [{MIN_BASE}, {MAX_BASE}]")
        idx = self.esc_idx.long()
        if idx.numel() and (idx[0] < 0 or idx[-1] >= n * k or (idx.numel() > 1 and (idx[1:] <= idx[:-1]).any())):
            raise W12FormatError("escape positions are out of range or not strictly ascending")


def pack_bases(base: torch.Tensor) -> torch.Tensor:
    """The rows' window bases ``base`` uint8 ``[N]`` as a compact blob for W12 files (format version 2):
    byte 0 the smallest base ``b0``, byte 1 the width ``w`` (0..8 bits) of the largest ``base − b0``, then
    the ``N`` deltas of ``w`` bits each, least significant bit first, as ``ceil(N w / 8)`` bytes (padding
    bits 0). A trained model's rows share their window within a few binades (spread 1–3 on the bundled
    target), so 1–2 bits a row replace a byte: at K = 256 that is 0.008 instead of 0.031 bits a weight.
    Returns uint8 ``[2 + ceil(N w / 8)]`` on base's device. Raises nothing for uint8 input."""
    b = base.to(torch.int64)
    b0 = int(b.min()) if b.numel() else 0
    d = b - b0
    w = int(d.max()).bit_length() if d.numel() else 0
    head = torch.tensor([b0, w], dtype=torch.uint8, device=base.device)
    if w == 0:
        return head
    bits = ((d[:, None] >> torch.arange(w, device=base.device)) & 1).reshape(-1)
    bits = torch.cat((bits, bits.new_zeros(-bits.numel() % 8))).reshape(-1, 8)
    body = (bits << torch.arange(8, device=base.device)).sum(dim=1).to(torch.uint8)
    return torch.cat((head, body))


def unpack_bases(blob: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bases`: uint8 ``[n]`` window bases from ``blob``.

    Raises:
        W12FormatError: blob not uint8 1-D, a width above 8, a length that does not fit ``n`` rows of that
            width, or bases above 255 (range checks of the bases themselves: :meth:`W12Tensor.validate`).
    """
    if blob.dtype != torch.uint8 or blob.dim() != 1 or blob.numel() < 2:
        raise W12FormatError(f"window bases: expected a uint8 blob of at least 2 bytes, got {blob.dtype} "
                             f"{tuple(blob.shape)}")
    b0, w = int(blob[0]), int(blob[1])
    if w > 8 or blob.numel() != 2 + -(-n * w // 8):
        raise W12FormatError(f"window bases: {blob.numel()} bytes do not hold {n} rows of {w} bits")
    if w == 0:
        return torch.full((n,), b0, dtype=torch.uint8, device=blob.device)
    bits = ((blob[2:].to(torch.int64)[:, None] >> torch.arange(8, device=blob.device)) & 1).reshape(-1)[:n * w]
    d = (bits.reshape(n, w) << torch.arange(w, device=blob.device)).sum(dim=1)
    if n and int(d.max()) + b0 > 255:
        raise W12FormatError("window bases: a base above 255")
    return (d + b0).to(torch.uint8)


def sha256_of(w: torch.Tensor) -> str:
    """Hex sha256 (str) of a tensor's row-major bytes (any dtype and device; little-endian, as safetensors stores
    them); the source hash W12 checks against (§4.1). Raises nothing."""
    t = w.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(memoryview(t.view(torch.uint8).numpy())).hexdigest()


def sha256_of_file(path) -> str:
    """Hex sha256 (str) of the bytes of the file at ``path`` (read in 1 MiB chunks).

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _band_rows(k: int) -> int:
    """Rows per encode/decode band: a multiple of 128 holding about ``_CHUNK`` weights."""
    return max(RECORD_ROWS, (_CHUNK // max(k, 1)) // RECORD_ROWS * RECORD_ROWS)


def _records_from_codes(view: torch.Tensor, nib: torch.Tensor) -> torch.Tensor:
    """``view, nib [n_pad, k_pad] uint8`` (n_pad % 128 == 0, k_pad % 64 == 0) -> records ``[nt, kt, 12288]``."""
    n, k = view.shape
    nt, kt = n // RECORD_ROWS, k // RECORD_COLS
    v = view.reshape(nt, RECORD_ROWS, kt, RECORD_COLS).permute(0, 2, 1, 3).reshape(nt, kt, VIEW_BYTES)
    packed = nib[:, 0::2] | (nib[:, 1::2] << 4)
    p = packed.reshape(nt, RECORD_ROWS, kt, RECORD_COLS // 2).permute(0, 2, 1, 3).reshape(nt, kt, NIBBLE_BYTES)
    return torch.cat((v, p), dim=-1)


def _codes_from_records(rec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_records_from_codes`: ``[nt, kt, 12288]`` -> ``view, nib [nt*128, kt*64]`` uint8."""
    nt, kt, _ = rec.shape
    v = rec[..., :VIEW_BYTES].reshape(nt, kt, RECORD_ROWS, RECORD_COLS).permute(0, 2, 1, 3)
    p = rec[..., VIEW_BYTES:].reshape(nt, kt, RECORD_ROWS, RECORD_COLS // 2).permute(0, 2, 1, 3)
    nib = torch.stack((p & 15, p >> 4), dim=-1)
    return v.reshape(nt * RECORD_ROWS, kt * RECORD_COLS), nib.reshape(nt * RECORD_ROWS, kt * RECORD_COLS)


def encode(w: torch.Tensor, device: str | torch.device | None = None) -> W12Tensor:
    """Encode a 2-D bfloat16 weight ``[N, K]`` (N output channels) to W12 (§4.1), losslessly.

    Args:
        w: bfloat16 ``[N, K]`` on any device.
        device: where to encode and keep the result (default: the CPU); a GPU encodes a large model's
            projections in seconds where the CPU takes minutes. Same bytes on every device.
    Returns:
        :class:`W12Tensor` with tensors on ``device``.
    Raises:
        W12FormatError: when ``w`` is not 2-D or not bfloat16 (W12 exists only for bf16 sources).
    """
    if w.dtype != torch.bfloat16:
        raise W12FormatError(f"W12 encodes bfloat16 weights only, got {str(w.dtype).removeprefix('torch.')}")
    if w.dim() != 2:
        raise W12FormatError(f"W12 encodes 2-D weights [N, K], got shape {tuple(w.shape)}")
    dev = torch.device("cpu") if device is None else torch.device(device)
    w = w.detach().to(dev).contiguous()
    n, k = w.shape
    nt, kt = -(-n // RECORD_ROWS), -(-k // RECORD_COLS)
    kp = kt * RECORD_COLS
    band = _band_rows(kp)
    recs, bases, idxs, vals = [], [], [], []
    for r0 in range(0, n, band):
        wb = w[r0:r0 + band].view(torch.int16)
        bits = wb.to(torch.int32) & 0xFFFF
        rows = bits.shape[0]
        sign, e, m = bits >> 15, (bits >> 7) & 0xFF, bits & 0x7F
        normal = (e >= 1) & (e <= 254)
        slot = torch.arange(rows, dtype=torch.int32, device=dev)[:, None] * 256 + e
        hist = torch.bincount(slot[normal], minlength=rows * 256).view(rows, 256)
        cs = torch.nn.functional.pad(hist.cumsum(1), (1, 0))  # cs[:, x] = #normals with exponent < x
        cover = cs[:, MIN_BASE + WINDOW:MAX_BASE + WINDOW + 1] - cs[:, MIN_BASE:MAX_BASE + 1]
        base = (cover.argmax(dim=1) + MIN_BASE).to(torch.int32)  # first maximum = lowest start
        lo, hi = base[:, None], base[:, None] + (WINDOW - 1)
        below, above = e < lo, e > hi
        mant = torch.where(below, 0, torch.where(above, 0x7F, m))
        off = (e - lo).clamp(0, WINDOW - 1)
        view = torch.zeros(-(-rows // RECORD_ROWS) * RECORD_ROWS, kp, dtype=torch.uint8, device=dev)
        nib = torch.zeros_like(view)
        view[:rows, :k] = ((sign << 7) | (off << 3) | (mant >> 4)).to(torch.uint8)
        nib[:rows, :k] = (mant & 15).to(torch.uint8)
        recs.append(_records_from_codes(view, nib))
        bases.append(base.to(torch.uint8))
        esc = (below | above).reshape(-1)
        idxs.append(esc.nonzero().squeeze(1) + r0 * k)
        vals.append(wb.reshape(-1)[esc])
    idx_dtype = torch.int32 if n * k < 2**31 else torch.int64
    empty = torch.zeros(0, dtype=torch.int64, device=dev)
    return W12Tensor(
        records=torch.cat(recs) if recs else torch.zeros(nt, kt, RECORD_BYTES, dtype=torch.uint8, device=dev),
        base=torch.cat(bases) if bases else torch.zeros(0, dtype=torch.uint8, device=dev),
        esc_idx=torch.cat(idxs or [empty]).to(idx_dtype),
        esc_val=torch.cat(vals) if vals else torch.zeros(0, dtype=torch.int16, device=dev),
        shape=(n, k), sha256=sha256_of(w))


def _restore(t: W12Tensor, midpoint: bool) -> torch.Tensor:
    """bf16 ``[N, K]`` from records + bases (nibbles, or 8 = midpoint of the 4 dropped bits), escapes patched."""
    n, k = t.shape
    band = _band_rows(t.records.shape[1] * RECORD_COLS)
    out = torch.empty(n, k, dtype=torch.int16, device=t.records.device)
    for r0 in range(0, n, band):
        rows = min(band, n - r0)
        view, nib = _codes_from_records(t.records[r0 // RECORD_ROWS:-(-(r0 + rows) // RECORD_ROWS)])
        v = view[:rows, :k].to(torch.int32)
        low = 8 if midpoint else nib[:rows, :k].to(torch.int32)
        e = t.base[r0:r0 + rows, None].to(torch.int32) + ((v >> 3) & 15)
        bits = ((v >> 7) << 15) | (e << 7) | ((v & 7) << 4) | low
        out[r0:r0 + rows] = (bits - ((bits >> 15) << 16)).to(torch.int16)  # exact wrap to signed 16 bits
    out.view(-1)[t.esc_idx.long()] = t.esc_val
    return out.view(torch.bfloat16)


def decode(t: W12Tensor, check: bool = True) -> torch.Tensor:
    """Restore the exact bf16 weight ``[N, K]`` (pure PyTorch reference decode, vectorised; §4.1).

    Args:
        t: the encoded tensor (on any device).
        check: validate ``t`` and compare the restored bytes with ``t.sha256``.
    Raises:
        W12FormatError: malformed ``t``, or (``check``) restored bytes that differ from the stored hash.
    """
    if check:
        t.validate()
    w = _restore(t, midpoint=False)
    if check and sha256_of(w) != t.sha256:
        raise W12FormatError("restored weight does not match its stored sha256 (corrupted records or escapes)")
    return w


def approx_view(t: W12Tensor) -> torch.Tensor:
    """The approximate weight set of the 8-bit view (§4.1, §4.3 Q pass): bf16 ``[N, K]``.

    In-window weights keep sign, exponent and the top 3 mantissa bits, with the 4 dropped bits set to their
    midpoint ``1000b`` (error at most 8/128 of the binade start, so at most 2**-4 relative); escapes are
    restored exactly.

    Raises:
        W12FormatError: malformed ``t``.
    """
    t.validate()
    return _restore(t, midpoint=True)


__all__ = ["W12Tensor", "W12FormatError", "encode", "decode", "approx_view", "sha256_of", "sha256_of_file",
           "pack_bases", "unpack_bases", "RECORD_ROWS",
           "RECORD_COLS", "RECORD_BYTES", "VIEW_BYTES", "NIBBLE_BYTES", "WINDOW"]
