"""Warp-specialised, stream-K W12 GEMM for 8–32 rows on Hopper, in Gluon (§4.1, issue 5): a probe kernel that
**lost** to the default (session 19); kept here, tested, with its figures, for whoever tries this structure next.

Why it was tried: the Triton tensor-core kernel (:mod:`specpilot.w12.mma`) streams its records as fast as
cuBLAS per K step but pays 5–8 µs of fixed cost against cuBLAS's 2.6 at 8–32 rows (session 16's fit): its programs
are short (split K, ~16 steps), each one's stream is bounded by its own step latency, and split K leaves a tail.
This kernel removes both structurally:

* **stream-K**: ``P`` persistent programs (one an SM) split the ``U = bands × K/64`` records of the weight into
  ``P`` contiguous runs of equal length, so every program streams ``U / P`` whole 12 KB records, crossing band
  boundaries where its run does. A band's records are consecutive in memory, so a run is one contiguous range.
* **warp specialisation**: one producer warp issues one TMA copy each for a record's views (8 KB) and nibbles
  (4 KB) and one for the activation tile ``x[:, 64 u : 64 u + 64]`` into an ``S``-stage ring (mbarriers ``ready``
  / ``empty``); the consumer warps (one partition of 8, or two of 4 with ``split_rows``) read each row's 16 views
  and 16 nibbles as one 16-byte and one 8-byte shared load (:func:`ws_records` permutes each record row's columns
  so that a thread's ``wgmma`` operand columns sit side by side), decode column pairs to bf16
  ``w' = w · 2^(112 − B_n)`` in seven PTX instructions (:data:`DECODE2_BF16_PTX`) straight into the register
  operand (no layout conversion: offline PTX has no shared-memory round trip in the loop), and run ``wgmma`` with
  the activation tile from shared memory (``acc [128, MP] += W' xᵀ``), the next record decoding while it runs.
* a band's partial sums (one per program whose run touches it, at most ``MAXC``) are written to ``part`` and
  summed in program order by a small Triton kernel, which adds the escapes (:func:`~specpilot.w12.gemm.
  _add_escapes`) and stores the output: a fixed order, no atomics, deterministic.

**Result** (H200, ``probes/w12_ws_probe.py``, one CUDA graph per variant, side by side with cuBLAS and the default
``w12_gemm``; ``results/w12_ws_probe_h200_2026-12-02_session19_run7.json``): slower than the default on every
Qwen3-8B projection at 8 / 16 / 32 rows, e.g. qkv at 8 rows 19.04 µs against 14.97 (cuBLAS 15.09), gate_up at 16
rows 52.34 against 41.72. Where the time goes:

* the ring alone (``dry``: consumers only wait and release, plus the sum kernel) already takes about the default's
  full time: qkv 8 rows 15.86 µs, gate_up 8 rows 42.80 (default 14.97 / 41.23). One producer warp with a 6-stage
  ring of 14 KB stages streams no faster than the default's split-K cp.async programs;
* the second launch (the sum kernel) costs 5.6 µs in isolation (ncu), about 4 µs in a graph: the kernel itself
  (ncu, isolated) takes 15.90 µs on qkv at 8 rows, the default 15.97, both at 51.5% of DRAM bandwidth
  (``results/ncu_profile_ws_h200_2026-12-02_session19.json``); on gate_up at 16 rows 48.6 against 42.6 µs
  (66% against 76% of DRAM bandwidth);
* decode and ``wgmma`` add 2.6–8.5 µs over the dry ring; two consumer partitions (alternate records, or rows 0–63 /
  64–127) were slower than one (ptxas serialises ``wgmma`` there: "insufficient register resources"), and so were
  two programs an SM;
* a launch register cap (``maxnreg`` 80 / 56 for two / three programs an SM) made Triton 3.6's warp-specialised code
  raise partitions' registers above the cap (``setmaxnreg`` to more than the launch gave) and the output wrong and
  run-to-run different (runs 5 and 6), so this kernel takes no cap.

What would be left to try: fuse the band sums into the kernel (last-arriving program sums in fixed order), a
producer with more bytes in flight, and a consumer that keeps up with the ring; the dry ring says the first two
together could at best reach about the default's time on qkv / o, so none of this is expected to reach 1.25x
cuBLAS at 8–32 rows.

Rounding: the bound of :mod:`specpilot.w12.gemm` (a sum over K in another order). CUDA sm_90 only (TMA,
``wgmma``, ``setmaxnreg``); Gluon has no CPU interpreter, so this kernel is tested on the GPU only
(``tests/test_w12_ws_probe.py``: 27 passed on the H200) against :func:`~specpilot.w12.gemm.
w12_gemm_reference`; its decode PTX and record permutation are tested on the CPU (``tests/test_w12_ptx.py``,
``tests/test_w12_ws_probe.py``).
"""

from __future__ import annotations

import torch

from specpilot.w12.gemm import W12GemmError, triton
from specpilot.w12.format import RECORD_COLS, RECORD_ROWS, W12Tensor

try:  # Gluon ships with Triton >= 3.5; without it (or on the CPU) this module only refuses
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the Triton build
    gluon = None

#: rows of the activation tile the kernel supports (``wgmma``'s N): 8, 16 or 32
WS_ROWS = (8, 16, 32)


def ws_plan(u: int, r: int, p: int) -> tuple[int, int]:
    """Stream-K bookkeeping for ``u`` records in bands of ``r`` split over ``p`` programs (program ``c`` runs
    records ``[c·u // p, (c+1)·u // p)``). Returns ``(MAXB, MAXC)``: the most bands one program's run touches
    and the most programs whose runs touch one band."""
    runs = [(c * u // p, (c + 1) * u // p) for c in range(p)]
    maxb = max((u1 - 1) // r - u0 // r + 1 for u0, u1 in runs)
    per_band = [0] * (u // r)
    for u0, u1 in runs:
        for b in range(u0 // r, (u1 - 1) // r + 1):
            per_band[b] += 1
    return maxb, max(per_band)


#: ``WS_COLUMNS[p]``: the record column stored at position ``p`` of a row in the kernel's layout
#: (:func:`ws_records`): ``p = 16 g + 2 j + e`` holds column ``2 g + 8 j + e``, the 16 columns that thread ``g``
#: of a lane quad holds in ``wgmma``'s register operand (k = 2 (lane mod 4) + 8 j + e), side by side
WS_COLUMNS = torch.tensor([2 * (p // 16) + 8 * ((p % 16) // 2) + p % 2 for p in range(RECORD_COLS)])


def ws_records(w12: W12Tensor) -> torch.Tensor:
    """The records of ``w12`` with each row's 64 views and 64 nibbles in :data:`WS_COLUMNS` order (uint8
    ``[bands, K/64, 12288]``, same size; a permutation, exact and reversible): a consumer thread then reads a
    row's 16 views as one 16-byte load and its 16 nibbles as one 8-byte load, conflict-free."""
    rec = w12.records
    nt, kt, _ = rec.shape
    cols = WS_COLUMNS.to(rec.device)
    v = rec[..., :RECORD_ROWS * RECORD_COLS].reshape(nt, kt, RECORD_ROWS, RECORD_COLS)[..., cols]
    q = rec[..., RECORD_ROWS * RECORD_COLS:].reshape(nt, kt, RECORD_ROWS, RECORD_COLS // 2)
    nib = torch.stack((q & 15, q >> 4), dim=-1).reshape(nt, kt, RECORD_ROWS, RECORD_COLS)[..., cols]
    q = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return torch.cat((v.reshape(nt, kt, -1), q.reshape(nt, kt, -1)), dim=-1).contiguous()


_WS_RECORDS: dict = {}  # id(records) -> (records, ws_records): a probe's cache, never freed (holds both)


def ws_prepare(w12: W12Tensor) -> torch.Tensor:
    """:func:`ws_records` of ``w12``, made once per records tensor and kept (call it before capturing a CUDA graph
    that runs :func:`w12_ws` on this weight: the permutation is a torch op). Keyed on the records tensor itself
    (held by the cache), not its address, so a freed weight's address reused by another never hits."""
    hit = _WS_RECORDS.get(id(w12.records))
    if hit is None or hit[0] is not w12.records:
        hit = _WS_RECORDS[id(w12.records)] = (w12.records, ws_records(w12))
    return hit[1]


def w12_ws(x: torch.Tensor, w12: W12Tensor, escapes, programs: int | None = None, stages: int = 6,
           split_rows: bool = False, consumer_regs: int = 232, overlap: bool = True, dry: bool = False) -> torch.Tensor:
    """``x [M, K] bf16 @ W12ᵀ`` for ``M ≤ 32`` on an sm_90 GPU (no bias). ``escapes``: the weight's
    :func:`~specpilot.w12.gemm.escape_table`. ``programs``: persistent programs (default: the SM count);
    ``stages``: the ring's depth (each stage holds one record and one activation tile: 12 KB + MP·128 bytes);
    ``split_rows``: two consumer partitions of 4 warps (rows 0–63 and 64–127 of each record, synchronised only
    through the ring's barriers) instead of one of 8, the second one with ``consumer_regs`` registers a thread;
    ``overlap``: each record's ``wgmma`` runs on while the next one decodes (waits for one outstanding group)
    instead of being waited for; ``dry`` (a probe: wrong output): the consumers only wait for each record and
    release it, no decode and no ``wgmma``, which times the TMA ring alone.
    No register cap: with a launch cap (``maxnreg`` 80 / 56, two / three programs an SM) Triton 3.6's
    warp-specialised code raised its partitions' registers above the cap and gave wrong, run-to-run different
    output on the H200 (session 19, ``results/w12_ws_probe_h200_2026-12-02_session19_*.json``).
    Returns ``[M, N]`` bf16.
    Raises: W12GemmError without Gluon / CUDA, for M > 32, a non-bf16 or non-contiguous x, K not a multiple of 8
    (TMA's 16-byte strides), or fewer records than programs."""
    if gluon is None or not x.is_cuda:
        raise W12GemmError("w12_ws needs Triton's Gluon and a CUDA (sm_90) device")
    m, k = x.shape
    n = w12.shape[0]
    if m > WS_ROWS[-1] or x.dtype != torch.bfloat16 or not x.is_contiguous() or k % 8:
        raise W12GemmError("w12_ws takes a contiguous bf16 x of at most 32 rows with K a multiple of 8")
    mp = next(r for r in WS_ROWS if r >= m)
    rec = ws_prepare(w12)
    bands, r = rec.shape[0], rec.shape[1]
    u = bands * r
    p = programs or torch.cuda.get_device_properties(x.device).multi_processor_count
    if u < p:
        raise W12GemmError(f"w12_ws needs at least as many records ({u}) as programs ({p})")
    maxb, maxc = ws_plan(u, r, p)
    words = rec.view(torch.int32).view(u * 96, 32)  # a record: 64 rows of 32 view words, then 32 of nibble words
    rec_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    v_desc = TensorDescriptor(words, [u * 96, 32], [32, 1], [64, 32], rec_layout)
    q_desc = TensorDescriptor(words[64:], [u * 96 - 64, 32], [32, 1], [32, 32], rec_layout)
    x_layout = gl.NVMMASharedLayout.get_default_for([mp, RECORD_COLS], gl.bfloat16)
    x_desc = TensorDescriptor(x, [m, k], [k, 1], [mp, RECORD_COLS], x_layout)
    part = torch.empty(p, maxb, RECORD_ROWS, mp, dtype=torch.float32, device=x.device)
    _w12_ws_kernel[(p,)](v_desc, q_desc, x_desc, w12.base, part, n, u, r, p, MP=mp, MAXB=maxb, S=stages,
                         RP=64 if split_rows else 128, CREGS=consumer_regs, OVERLAP=overlap, DRY=dry, num_warps=4 if split_rows else 8)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    row_ptr, esc_k, esc_d = escapes
    _w12_ws_sum_kernel[(bands,)](part, out, x, row_ptr, esc_k, esc_d, m, n, u, r, p, k, MP=mp, MAXB=maxb,
                                 MAXC=maxc, num_warps=4)
    return out


if gluon is not None and triton is not None:
    import triton.language as tl

    from specpilot.w12.gemm import _add_escapes, _escapes_load

    #: PTX: a pair of columns (views v0 | v1 << 8 as one 16-bit word, their nibble byte n0 | n1 << 4) -> the two
    #: bf16 ``w'`` (bit layout of :func:`specpilot.w12.tiles._decode8`): bytes to v1 << 24 | v0 << 8, so
    #: each sign is at its half's top; offset and top mantissa bits shifted into bits 10-4; exponent 0111 0000
    #: OR'd in; the nibbles into bits 3-0 of each half. Seven instructions a pair.
    DECODE2_BF16_PTX = gl.constexpr("""{
                .reg .b32 x, t, n;
                cvt.u32.u16 x, $2;
                prmt.b32 x, x, 0, 0x1404;
                shr.u32 t, x, 4;
                lop3.b32 t, t, 0x07F007F0, 0x38003800, 0xEA;
                lop3.b32 t, x, 0x80008000, t, 0xEA;
                lop3.b32 t, t, $3, 0x0000000F, 0xF8;
                shl.b32 n, $3, 12;
                lop3.b32 t, t, n, 0x000F0000, 0xF8;
                mov.b32 {$0, $1}, t;
                }""")

    @gluon.jit
    def _ws_producer(v_desc, q_desc, x_desc, v_ring, q_ring, x_ring, ready, empty, u0, u1, R, S: gl.constexpr):
        """The producer warp: for each record ``u`` of the run, wait for its ring slot to be free, then one TMA
        copy each of its views, its nibbles and the activation tile at column ``64 (u mod R)``."""
        nbytes: gl.constexpr = v_desc.block_type.nbytes + q_desc.block_type.nbytes + x_desc.block_type.nbytes
        for i in range(u1 - u0):
            u = u0 + i
            s = i % S
            mbarrier.wait(empty.index(s), ((i // S) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(v_desc, [u * 96, 0], bar, v_ring.index(s))
            tma.async_copy_global_to_shared(q_desc, [u * 96, 0], bar, q_ring.index(s))
            tma.async_copy_global_to_shared(x_desc, [0, (u % R) * 64], bar, x_ring.index(s))

    @gluon.constexpr_function
    def _pair_layout(rp):
        """Column pairs ``[rp, 32]`` in the kernel's layout (:func:`ws_records`: pair ``i = 8 g + j`` holds columns
        ``2 g + 8 j + {0, 1}``): a thread holds 8 consecutive pairs of a row (one 16-byte view load, one 8-byte
        nibble load), lanes hold ``g`` and rows 0–7, registers row bit 3, warps rows 16 and up: the threads that hold
        those columns in the ``wgmma`` register operand, so the decoded pairs reach it by register renaming only."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]], lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16 << i, 0] for i in range((rp // 16).bit_length() - 1)], block_bases=[], shape=[rp, 32])

    @gluon.jit
    def _ws_consumer(v_ring, q_ring, x_ring, ready, empty, Base, Part, N, u0, u1, R, ROW0: gl.constexpr,
                     RP: gl.constexpr, MP: gl.constexpr, MAXB: gl.constexpr, S: gl.constexpr,
                     OVERLAP: gl.constexpr, DRY: gl.constexpr):
        """A consumer partition of ``RP / 16`` warps for rows ``ROW0 .. ROW0 + RP − 1`` of every record of the run:
        per band the run touches, ``acc [RP, MP] = Σ W' xᵀ`` over the run's records of that band, scaled by
        ``2^(B_n − 112)`` and written to ``Part[program, band − first band]``."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[RP // 16, 1],
                                                     instr_shape=[16, MP, 16])
        a_dot: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        ql: gl.constexpr = _pair_layout(RP)
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        rows = ROW0 + gl.arange(0, RP, gl.SliceLayout(1, mma))
        cols = gl.arange(0, MP, gl.SliceLayout(0, mma))
        b_first = u0 // R
        i = 0
        a_prev = gl.zeros([RP, 64], gl.bfloat16, a_dot)  # the operand of the wgmma in flight (kept live until done)
        for b in range(b_first, (u1 - 1) // R + 1):
            lo = gl.maximum(u0, b * R)
            acc = gl.zeros([RP, MP], gl.float32, mma)
            prev = 0
            for u in range(lo, gl.minimum(u1, b * R + R)):
                s = i % S
                mbarrier.wait(ready.index(s), (i // S) & 1)
                if DRY:  # the ring alone
                    mbarrier.arrive(empty.index(s), count=1)
                else:
                    v = v_ring.index(s)._reinterpret(gl.int16, [128, 32], flat).slice(ROW0, RP).load(ql)
                    q = q_ring.index(s)._reinterpret(gl.uint8, [128, 32], flat).slice(ROW0, RP).load(ql)
                    lo2, hi2 = gl.inline_asm_elementwise(DECODE2_BF16_PTX, "=h,=h,h,r", [v, q.to(gl.int32)],
                                                         dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
                    w = gl.reshape(gl.join(lo2, hi2), [RP, 4, 8, 2])  # [row, g, j, e] -> column 8 j + 2 g + e
                    a = gl.convert_layout(gl.reshape(gl.permute(w, (0, 2, 1, 3)), [RP, 64]), a_dot)
                    acc = warpgroup_mma(a, x_ring.index(s).permute((1, 0)), acc, is_async=True)
                    if OVERLAP:  # this wgmma runs on while the next record decodes
                        acc, a_prev = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_prev))
                        a_prev = a
                        mbarrier.arrive(empty.index(prev), count=1, pred=u > lo)  # the previous wgmma is done
                        prev = s
                    else:
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                        mbarrier.arrive(empty.index(s), count=1)
                i += 1
            if OVERLAP:
                if not DRY:  # the band's last wgmma, then its slot
                    acc, a_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_prev))
                    mbarrier.arrive(empty.index(prev), count=1, pred=gl.minimum(u1, b * R + R) > lo)
            n = b * 128 + rows
            base = gl.load(Base + n, mask=n < N, other=112).to(gl.int32)
            acc = acc * ((base + 15) << 23).to(gl.float32, bitcast=True)[:, None]  # 2^(B_n − 112), exact
            slot = gl.program_id(0) * MAXB + b - b_first
            gl.store(Part + (slot * 128 + rows[:, None]) * MP + cols[None, :], acc)

    @gluon.jit
    def _w12_ws_kernel(v_desc, q_desc, x_desc, Base, Part, N, U, R, P, MP: gl.constexpr, MAXB: gl.constexpr,
                       S: gl.constexpr, RP: gl.constexpr, CREGS: gl.constexpr, OVERLAP: gl.constexpr,
                       DRY: gl.constexpr):
        """Grid ``(P,)``: program ``c`` streams records ``[c·U // P, (c+1)·U // P)`` (see the module docstring) with
        ``128 / RP`` consumer partitions (RP = 128: one of 8 warps; 64: two of 4 warps, the second a worker of
        ``CREGS`` registers a thread) and one producer warp."""
        c = gl.program_id(0)
        u0 = c * U // P
        u1 = (c + 1) * U // P
        v_ring = gl.allocate_shared_memory(gl.int32, [S, 64, 32], v_desc.layout)
        q_ring = gl.allocate_shared_memory(gl.int32, [S, 32, 32], q_desc.layout)
        x_ring = gl.allocate_shared_memory(gl.bfloat16, [S, MP, 64], x_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(S):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=128 // RP)  # every consumer partition releases the slot
        if RP == 128:
            gl.warp_specialize(
                [(_ws_consumer, (v_ring, q_ring, x_ring, ready, empty, Base, Part, N, u0, u1, R, 0, RP, MP, MAXB, S, OVERLAP, DRY)),
                 (_ws_producer, (v_desc, q_desc, x_desc, v_ring, q_ring, x_ring, ready, empty, u0, u1, R, S))],
                [1], [40])
        else:
            gl.warp_specialize(
                [(_ws_consumer, (v_ring, q_ring, x_ring, ready, empty, Base, Part, N, u0, u1, R, 0, RP, MP, MAXB, S, OVERLAP, DRY)),
                 (_ws_consumer, (v_ring, q_ring, x_ring, ready, empty, Base, Part, N, u0, u1, R, 64, RP, MP, MAXB, S, OVERLAP, DRY)),
                 (_ws_producer, (v_desc, q_desc, x_desc, v_ring, q_ring, x_ring, ready, empty, u0, u1, R, S))],
                [4, 1], [CREGS, 40])

    @triton.jit
    def _w12_ws_sum_kernel(Part, Out, X, RowPtr, EscK, EscD, M, N, U, R, P, stride_xm, MP: tl.constexpr,
                           MAXB: tl.constexpr, MAXC: tl.constexpr):
        """Grid ``(bands,)``: band ``b``'s partial sums in program order, then its escapes; ``Out [M, N]`` bf16."""
        b = tl.program_id(0)
        rows = tl.arange(0, 128)
        offs_n = b * 128 + rows
        offs_m = tl.arange(0, MP)
        n_ok = offs_n < N
        m_ok = offs_m < M
        acc = tl.zeros([128, MP], dtype=tl.float32)
        c_lo = (b * R * P) // U
        for j in range(MAXC + 1):
            c = c_lo + j
            u0 = c * U // P
            u1 = (c + 1) * U // P
            touches = (c < P) & (u0 < b * R + R) & (u1 > b * R)
            slot = c * MAXB + b - u0 // R
            acc += tl.load(Part + (slot * 128 + rows[:, None]) * MP + offs_m[None, :], mask=touches, other=0.0)
        sk, sd, lo, cnt = _escapes_load(RowPtr, EscK, EscD, offs_n, n_ok)
        acc = _add_escapes(acc, X, stride_xm, EscK, EscD, sk, sd, lo, cnt, offs_m, m_ok, True)
        tl.store(Out + offs_m[None, :] * N + offs_n[:, None], acc.to(Out.dtype.element_ty),
                 mask=n_ok[:, None] & m_ok[None, :])


__all__ = ["WS_COLUMNS", "WS_ROWS", "w12_ws", "ws_plan", "ws_prepare", "ws_records"]
