"""The shared end of the W12 kernels (§4.1): escapes, bias, store, and the fixed-order split-K sum.

Every W12 matmul kernel (:mod:`~specpilot.w12.gemv`, :mod:`~specpilot.w12.mma`, :mod:`~specpilot.w12.mma_bytes`)
ends the same way, with the Triton helpers here:

* split 0 of a tile (the only one without split K) loads its escape slots (:func:`_escapes_load`) and adds
  ``x[m, k_e] · d_e`` to its own K sum one escape at a time in list order (:func:`_add_escapes`; the table:
  :func:`~specpilot.w12.escapes.escape_table`); :func:`_x_load` reads x as the kernel does (plain, ``silu(gate) ·
  up`` for the fused SwiGLU, or RMS-normalised for the fused norm);
* without split K the tile adds the bias and stores (:func:`_store_out`); with it, each split stores a float32
  partial and the partials are summed in split order, then the bias: either by the tile's last split in the kernel
  (``fused_split``: :func:`_finish_splits`, one atomic counter a tile from :func:`split_locks` only decides which
  program finishes) or by a second launch (:func:`_w12_split_sum_kernel`, :func:`_sum_splits`). Both give the same
  bits: everything is in a fixed order and no atomics touch the arithmetic.

Host side: :func:`_outputs` (a launch's buffers), :func:`split_locks` / :func:`reserve_split_locks` (the counters,
one buffer per device and stream; reserve one before capturing a CUDA graph) and :func:`_sum_splits`.
"""

from __future__ import annotations

import torch

from specpilot.w12.escapes import ESC_SLOTS

try:
    import triton
    import triton.language as tl

    from specpilot.kernels.fused import rms_rstd, rmsnorm_values, silu_mul_values
except ImportError:  # CPU installs without triton: the references still work
    triton = None


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


if triton is not None:
    _SLOTS = tl.constexpr(ESC_SLOTS)

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
        the overflow list's start ``lo [BN]`` and length ``cnt [BN]`` (:func:`~specpilot.w12.escapes.escape_table`).
        ``ok [BN]``: the channels to load (pass ``n_ok & (pid_k == 0)``: other splits load nothing)."""
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


__all__ = ["split_locks", "reserve_split_locks", "CAPTURE_LOCKS"]
