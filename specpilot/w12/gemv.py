"""W12 GEMV: ``x [M, K] @ W[N, K]ᵀ`` for 1–8 rows straight from W12 records, FMAs instead of tensor cores
(§4.1).

At one row a projection is a read of its weight: the kernel must decode 12-bit codes faster than HBM
delivers them (~12 weights per clock per SM on an H200). The decode takes three integer instructions a
weight (inline PTX ``prmt``, ``shr.s32``, ``lop3``; details in :func:`w12_gemv`): the view byte and its
nibble become a float32 whose exponent is ``112 + offset`` instead of ``B_n + offset``, and each row's sum
is multiplied once by the exact power of two ``2^(B_n − 112)``. Weights are read as 64-bit words of views
and 32-bit words of nibbles, one of each per group of 8 columns.

Two kernels. One row runs :func:`_w12_gemv_lines_kernel`: the step's words as ``[records, rows · 8]`` tiles, so each
warp load covers whole 128-byte lines (the layout measured fastest at one row on the H200,
``results/w12_launch_sweep_lines_h200_2026-12-01_bfb1047.json``). 2–8 rows (and one row with ``lines=False``) run
:func:`_w12_gemv_kernel`: ``[BLOCK_N, groups]`` tiles, 16 groups a thread at one row, x loaded once per group
and shared by the thread's rows.

H200, ``specpilot bench --suite w12`` (``results/w12_bench_h200_2026-12-01_7b87fb5.json``), one row:
Qwen3-8B qkv / o / gate_up / down 1.06 / 1.23 / 1.22 / 1.31x cuBLAS bf16, Qwen3-32B gate_up 1.34x; the exact pass of
Qwen3-8B 1.14x the bf16 pass. A plain streaming read of the same bytes is still 1.4x (qkv) to 1.2x (gate_up)
faster than these kernels (``probes/read_floor.py``). 2–8 rows: 0.12–0.61x cuBLAS on the H200
(``results/w12_double_probe_h200_2026-12-01_7b87fb5.json``), so only ``gemv=True`` sends them here.

Shapes, escapes, bias and the split-K sum follow :mod:`specpilot.w12.gemm`, whose
:func:`~specpilot.w12.gemm.w12_gemm` routes here; the reference is
:func:`~specpilot.w12.gemm.w12_gemm_reference`. The launch rule: :func:`~specpilot.w12.launch.gemv_config`.
"""

from __future__ import annotations

import torch

from specpilot.kernels.gemm import _num_sms
from specpilot.w12.epilogue import _outputs, _sum_splits, split_locks
from specpilot.w12.escapes import W12GemmError
from specpilot.w12.format import RECORD_COLS, RECORD_ROWS, W12Tensor
from specpilot.w12.launch import GEMV_MAX_ROWS, gemv_config, gemv_resources  # re-exported

try:
    import triton
    import triton.language as tl

    from specpilot.kernels.fused import rmsnorm_values, silu_mul_values
    from specpilot.w12.epilogue import _add_escapes, _escapes_load, _norm_rstd, _split_end, _x_load
    from specpilot.w12.tiles import _decode8, _load_groups, _tile_words, _view_nibbles, _word_offsets
except ImportError:  # CPU installs without triton
    triton = None

def w12_gemv(x: torch.Tensor, w12: W12Tensor, bias: torch.Tensor | None, escapes, overrides: dict,
             glu: bool = False, norm: tuple | None = None, add: tuple | None = None, view: bool = False) -> torch.Tensor:
    """A few activation rows: ``x [M, K] @ W12ᵀ (+ bias)``, 1 ≤ M ≤ :data:`GEMV_MAX_ROWS`, with the weights
    decoded to float32 in registers once and summed with M FMAs each (no tensor cores, so no layout change
    between the decode and the dot). Measured on the H200 at one row only; rows are padded to a power of
    two in registers (``ROWS``) and masked. Called by :func:`~specpilot.w12.gemm.w12_gemm` (which
    checks shapes, dtypes and devices) with ``escapes`` its :func:`~specpilot.w12.escapes.escape_table`
    and ``overrides`` its launch overrides (block_n, block_k, split_k, num_warps, num_stages, asm, fused_split,
    load_stages, lines, esc_early).

    Decode in three integer instructions a weight. A program reads, per row and group of 8 columns, one
    64-bit word of views and one 32-bit word of nibbles (8 bytes and 4 bytes, contiguous in the record).
    For weight ``i``: ``t = prmt(view_i, nibble byte) `` puts the view byte in bits 31–24 and the byte holding
    its nibble in bits 23–16 (the even columns' nibbles are taken from the nibble word shifted left by 4,
    once per 8 weights); ``t >>= 4`` (arithmetic) moves the offset to the low exponent bits 26–23, the top
    mantissa bits to 22–20 and the nibble to 19–16 while the sign stays in bit 31; ``lop3`` keeps bits 31 and
    26–16 and sets exponent bits 30–27 to ``0111``. The result is the float32 ``w' = w · 2^(112 − B_n)``
    (exponent field ``112 + offset`` instead of ``B_n + offset``), so no per-weight exponent add: the row's
    sum is multiplied by ``2^(B_n − 112)`` once (``B_n`` in 1..239, so the scale is a normal float32). Scaling
    by a power of two commutes with every float32 rounding of the sum, so the result is bitwise that of
    summing ``x_k w_nk`` in the same order, unless a partial sum or product falls into the float32
    subnormal range in one scaling and not the other (an absolute error of at most ``2^-149`` an operation).

    ``load_stages`` (override, default 1): K steps whose record words are in flight at once. Triton's pipeliner
    moves loads that feed no ``tl.dot`` only in a loop given its own ``num_stages`` (``tl.range``), so with 1 each
    step's load latency is exposed (ncu, one row of Qwen3-8B qkv: 41–49% of DRAM bandwidth); with ``s`` > 1 the
    words of the next ``s − 1`` steps are copied to shared memory (cp.async, ``s · BLOCK_N · BLOCK_K · 1.5``
    bytes a program) while a step is summed. The same operations in the same order, so bitwise the same output.
    (A register double buffer was 0.48–1.07x cuBLAS on the H200 where the plain loop is 1.0–1.16x:
    ``results/w12_gemv_probe_h200_2026-12-01_2fa2632.json``; removed.)

    ``lines`` (override; the one-row default, see :func:`~specpilot.w12.launch.gemv_config`): one row runs
    :func:`_w12_gemv_lines_kernel`, whose loads cover whole 128-byte lines; another summation order within the same
    bound, deterministic. Ignored for 2–8 rows.

    ``asm`` (default on CUDA): the three instructions as inline PTX (``prmt.b32``, ``shr.s32``, ``lop3.b32``);
    otherwise the same bit operations in plain Triton (the interpreter, and a GPU comparison). Split K
    (``split_k`` > 1): partial sums, scaled, in ``[split, 1, N]`` float32 (split 0's with the escapes), summed in
    split order, then the bias; by default (``fused_split``) the tile's last split does that sum in this kernel
    (one atomic counter a tile only decides which program finishes, :func:`~specpilot.w12.epilogue.split_locks`;
    no second launch), with ``fused_split=False`` the second kernel ``_w12_split_sum_kernel`` does: the same
    fixed order and the same bits either way. The GEMV's fused default has no A/B timing of its own yet (the sweep
    that chose the fused sum, ``results/w12_mma_sweep_h200_2026-12-01_36ffc3b.json``, timed the tensor-core kernel).

    ``glu`` (:func:`~specpilot.w12.swiglu.w12_swiglu_down`, which checks the call): ``x`` is one contiguous
    row of ``gate_up [1, 2K]`` and the kernel multiplies ``silu(gate) · up`` instead of x, in the lines kernel only.
    ``norm = (weight [K], sq_in [P] float32, eps)`` and ``add = (residual [1, N], sq_out [cdiv(N, BLOCK_N)] float32)``
    (:mod:`specpilot.w12.norm`, which checks the call; lines kernel only): the kernel multiplies the RMSNorm of
    x whose scale it forms from the tile sums of squares ``sq_in``, and / or stores ``residual + y`` and the tile
    sums of squares of that into ``sq_out``.

    ``view`` (:func:`~specpilot.w12.view.w12_view_gemm`, which checks the call; ``escapes`` then
    ``escape_table(w12, view=True)``): the 8-bit view (§4.3 Q pass), ``x @ approx_view(w12)ᵀ``: both kernels load the
    view words only and decode them with every nibble at its midpoint ``1000b``
    (:func:`~specpilot.w12.tiles._view_nibbles`); the nibble plane is never read. The decode is then the plain-Triton
    one (``asm`` ignored): its constant nibble bits fold away, where ptxas keeps the PTX's constant operand live
    (offline sm_90a compile of the one-row lines kernel, BLOCK_N 16, BLOCK_K 256, one warp: 95 registers plain,
    254–255 with the PTX, 128 for the exact kernel; ``results/ptxas_w12_view_sm90a_2026-12-04_eed28a4.json``,
    ``probes/w12_view_ptxas.py``).

    Returns: ``[M, N]`` in x's dtype, within the rounding bound of :mod:`specpilot.w12.gemm` (plus
    the subnormal caveat above). Raises: W12GemmError on bad launch overrides, M outside 1..8, or ``glu`` where
    the lines kernel would not run."""
    row_ptr, esc_k, esc_d = escapes
    n, k = w12.shape
    m = x.shape[0]
    if not 1 <= m <= GEMV_MAX_ROWS:
        raise W12GemmError(f"gemv takes 1..{GEMV_MAX_ROWS} rows, got {m}")
    cfg = gemv_config(n, k, _num_sms(x.device.index if x.is_cuda else None), m)
    cfg.update({key: v for key, v in overrides.items() if v is not None and key in cfg})
    bn, bk, split = cfg["block_n"], cfg["block_k"], cfg["split_k"]
    if RECORD_ROWS % bn or bk % RECORD_COLS or split < 1:
        raise W12GemmError(f"gemv: block_n must divide {RECORD_ROWS}, block_k be a multiple of {RECORD_COLS}, "
                           f"split_k >= 1")
    rows = triton.next_power_of_2(m)
    rec = w12.records
    k_pad = rec.shape[1] * RECORD_COLS
    k_per_split = triton.cdiv(triton.cdiv(k_pad, split), bk) * bk
    out, part, b = _outputs(x, n, split, bias)
    lock = split_locks(x.device, triton.cdiv(n, bn)) if split > 1 and cfg["fused_split"] else None
    fused = lock is not None  # None: not asked, no split, or capturing without counters (the two-kernel sum)
    lock = row_ptr if lock is None else lock
    common = dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, FUSED=fused, EVEN=k_per_split * split == k_pad,
                  X_EVEN=k_per_split * split == k, HAS_BIAS=bias is not None,
                  ASM=bool(cfg["asm"]) and x.is_cuda and not view,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    lines = bool(cfg["lines"]) and m == 1
    if (glu or norm is not None or add is not None) and not lines:
        raise W12GemmError("the fused SwiGLU / norm / residual add run in the one-row lines kernel only (lines on)")
    if lines:
        fuse = {}
        if norm is not None:
            fuse |= dict(NORM=True, NormW=norm[0], SqIn=norm[1], n_sq=norm[1].numel(), eps=norm[2],
                         SQ_BLOCK=triton.next_power_of_2(norm[1].numel()))
        if add is not None:
            fuse |= dict(ADD=True, Res=add[0], SqOut=add[1])
        _w12_gemv_lines_kernel[(triton.cdiv(n, bn), split)](
            x, rec.view(torch.int64), rec.view(torch.int32), w12.base, b, out, part, lock, row_ptr, esc_k, esc_d,
            m, n, k, k_pad, k_per_split, x.stride(0), GLU=glu, ESC_EARLY=bool(cfg["esc_early"]), VIEW=view, **fuse,
            **common)
    else:
        _w12_gemv_kernel[(triton.cdiv(n, bn), split)](
            x, rec.view(torch.int64), rec.view(torch.int32), w12.base, b, out, part, lock, row_ptr, esc_k, esc_d,
            m, n, k, k_pad, k_per_split, x.stride(0), ROWS=rows, LOAD_STAGES=int(cfg["load_stages"]), VIEW=view,
            **common)
    return _sum_splits(part, out, b, split, bias is not None, fused, add, bn)


if triton is not None:

    @triton.jit
    def _x_times(acc, w, X, col, M, stride_xm, K, X_EVEN: tl.constexpr, ROWS: tl.constexpr):
        """``acc += w · x[:, col]``: ``w [BN, G]`` decoded weights of column ``col [G]`` of the step; ``acc``
        ``[BN, G]`` (one row) or ``[ROWS, BN, G]`` (rows ``0..M-1`` of ``X``, the rest masked to 0)."""
        if ROWS == 1:
            if X_EVEN:
                xv = tl.load(X + col)
            else:
                xv = tl.load(X + col, mask=col < K, other=0.0)
            acc += w * xv.to(tl.float32)[None, :]
        else:
            rm = tl.arange(0, ROWS)
            xv = tl.load(X + rm[:, None] * stride_xm + col[None, :], mask=(rm < M)[:, None] & (col < K)[None, :],
                         other=0.0)
            acc += w[None, :, :] * xv.to(tl.float32)[:, None, :]
        return acc

    @triton.jit
    def _gemv_step(acc, vw, qw, X, kb, rg, M, stride_xm, K, X_EVEN: tl.constexpr, ROWS: tl.constexpr,
                   ASM: tl.constexpr):
        """One K step of :func:`_w12_gemv_kernel`: decode the words ``vw`` / ``qw [BN, G]`` of columns ``kb ..
        kb + 8G`` and add their products with X's columns to ``acc``."""
        w0, w1, w2, w3, w4, w5, w6, w7 = _decode8(vw, qw, ASM)
        col = kb + 8 * rg
        acc = _x_times(acc, w0, X, col, M, stride_xm, K, X_EVEN, ROWS)
        acc = _x_times(acc, w1, X, col + 1, M, stride_xm, K, X_EVEN, ROWS)
        acc = _x_times(acc, w2, X, col + 2, M, stride_xm, K, X_EVEN, ROWS)
        acc = _x_times(acc, w3, X, col + 3, M, stride_xm, K, X_EVEN, ROWS)
        acc = _x_times(acc, w4, X, col + 4, M, stride_xm, K, X_EVEN, ROWS)
        acc = _x_times(acc, w5, X, col + 5, M, stride_xm, K, X_EVEN, ROWS)
        acc = _x_times(acc, w6, X, col + 6, M, stride_xm, K, X_EVEN, ROWS)
        acc = _x_times(acc, w7, X, col + 7, M, stride_xm, K, X_EVEN, ROWS)
        return acc

    @triton.jit
    def _w12_gemv_kernel(X, RecV, RecQ, Base, Bias, Out, Part, Lock, RowPtr, EscK, EscD, M, N, K, K_PAD,
                         K_PER_SPLIT, stride_xm, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                         SPLIT_K: tl.constexpr, FUSED: tl.constexpr, EVEN: tl.constexpr, X_EVEN: tl.constexpr, HAS_BIAS: tl.constexpr,
                         ASM: tl.constexpr, LOAD_STAGES: tl.constexpr = 1, VIEW: tl.constexpr = False):
        """Grid ``(cdiv(N, BLOCK_N), SPLIT_K)``: ``Out[m, n] = Σ_k x_mk w_nk (+ escapes, bias)`` for the ``M ≤
        ROWS`` rows of ``X``, BLOCK_N rows of one record band and one K chunk (see :func:`w12_gemv`). ``RecV`` /
        ``RecQ``: the records as int64 / int32 words. Float32 accumulators ``[BLOCK_N, BLOCK_K / 8]`` (one
        row) or ``[ROWS, BLOCK_N, BLOCK_K / 8]``, one per group of 8 columns; each weight is decoded once.
        ``LOAD_STAGES``: steps whose words are in flight at once (cp.async into shared memory; 1: plain loads). The
        same operations in the same order in every variant. ``VIEW``: the 8-bit view, no nibble loads
        (:func:`~specpilot.w12.tiles._load_groups`)."""
        pid_k = tl.program_id(1)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        row_v, row_q, rg, col_v, col_q = _word_offsets(tl.program_id(0) * BLOCK_N, BLOCK_N, K_PAD, BLOCK_K)
        esc = _escapes_load(RowPtr, EscK, EscD, offs_n, n_ok & (pid_k == 0))
        if ROWS == 1:
            acc = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
        else:
            acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
        k0 = pid_k * K_PER_SPLIT
        k1 = tl.minimum(k0 + K_PER_SPLIT, K_PAD)  # this split's end (a multiple of 64)
        # LOAD_STAGES > 1: Triton's pipeliner copies the words of the next LOAD_STAGES - 1 steps to shared memory
        # (cp.async) while this step is summed; it does so for loads feeding no tl.dot only in a loop with its
        # own num_stages. 1: plain loads, each step's latency exposed.
        for kk in tl.range(0, K_PER_SPLIT, BLOCK_K, num_stages=LOAD_STAGES):
            kb = k0 + kk
            vw, qw = _load_groups(RecV, RecQ, kb, k1, row_v, row_q, rg, col_v, col_q, EVEN, VIEW)
            acc = _gemv_step(acc, vw, qw, X, kb, rg, M, stride_xm, K, X_EVEN, ROWS, ASM)
        base = tl.load(Base + offs_n, mask=n_ok, other=112).to(tl.int32)
        scale = ((base + 15) << 23).to(tl.float32, bitcast=True)  # 2^(B_n − 112), exact
        offs_m = tl.arange(0, ROWS)
        m_ok = offs_m < M
        if ROWS == 1:
            y = (tl.sum(acc, axis=1) * scale)[None, :]  # [1, BN]
        else:
            y = tl.sum(acc, axis=2) * scale[None, :]  # [ROWS, BN]
        _gemv_store(y, X, Bias, Out, Part, Lock, EscK, EscD, esc, M, N, stride_xm, offs_m, offs_n, m_ok, n_ok, pid_k,
                    SPLIT_K, FUSED, HAS_BIAS)

    @triton.jit
    def _gemv_store(y, X, Bias, Out, Part, Lock, EscK, EscD, esc, M, N, stride_xm, offs_m, offs_n, m_ok, n_ok, pid_k,
                    SPLIT_K: tl.constexpr, FUSED: tl.constexpr, HAS_BIAS: tl.constexpr, GLU: tl.constexpr = False,
                    NORM: tl.constexpr = False, NormW=None, rstd=None, ADD: tl.constexpr = False, Res=None, SqOut=None):
        """The GEMV kernels' end: ``y [ROWS, BLOCK_N]`` (the scaled K sum of this split), plus the escapes in split 0
        (``esc``: :func:`~specpilot.w12.epilogue._escapes_load`'s tuple), then
        :func:`~specpilot.w12.epilogue._split_end` (bias and store, or this split's partial and, with ``FUSED``,
        the tile's last split sums the partials here). ``GLU`` / ``NORM``: how the escapes read x
        (:func:`~specpilot.w12.epilogue._add_escapes`). ``ADD``: the residual add
        (:func:`~specpilot.w12.epilogue._store_out`)."""
        dst = offs_m[:, None] * N + offs_n[None, :]
        ok = m_ok[:, None] & n_ok[None, :]
        if pid_k == 0:
            y = _add_escapes(y, X, stride_xm, EscK, EscD, esc[0], esc[1], esc[2], esc[3], offs_m, m_ok, False, GLU,
                             NORM, NormW, rstd)
        _split_end(y, Part, Lock + tl.program_id(0), Bias, Out, M, N, offs_n, n_ok, dst, ok, pid_k, SPLIT_K, FUSED,
                   HAS_BIAS, False, ADD, Res, SqOut)

    @triton.jit
    def _w12_gemv_lines_kernel(X, RecV, RecQ, Base, Bias, Out, Part, Lock, RowPtr, EscK, EscD, M, N, K, K_PAD,
                               K_PER_SPLIT, stride_xm, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               SPLIT_K: tl.constexpr, FUSED: tl.constexpr, EVEN: tl.constexpr, X_EVEN: tl.constexpr,
                               HAS_BIAS: tl.constexpr, ASM: tl.constexpr, GLU: tl.constexpr = False,
                               NORM: tl.constexpr = False, ADD: tl.constexpr = False, SQ_BLOCK: tl.constexpr = 1,
                               NormW=None, SqIn=None, n_sq=0, eps=0.0, Res=None, SqOut=None,
                               ESC_EARLY: tl.constexpr = True, VIEW: tl.constexpr = False):
        """One row (``lines``): the grid, split and epilogue of :func:`_w12_gemv_kernel`, with the step's words
        taken as ``[R, BLOCK_N · 8]`` tiles (R = BLOCK_K / 64 records; column ``j`` = row ``j // 8``, group
        ``j % 8``). Within a record the views of the tile's rows are one contiguous ``BLOCK_N · 64``-byte run and
        its nibbles one ``BLOCK_N · 32``-byte run, so a warp's load covers whole 128-byte lines (16-byte vectors
        of views), where the ``[BLOCK_N, groups]`` tiles of :func:`_w12_gemv_kernel` load 64 / 32 bytes of each
        line they touch (``probes/w12_access_probe.py``: those loads alone ran 1.3-1.5x slower than a plain read of
        the same bytes on the H200). x: :func:`_x_groups`. The K sum's order differs from
        :func:`_w12_gemv_kernel` (each element sums its group's 8 products over the steps; rows are reduced over
        records and groups at the end): within the same rounding bound, deterministic. ``GLU``
        (:mod:`specpilot.w12.swiglu`): X is the one row of ``gate_up [1, 2K]`` and the kernel multiplies
        ``silu(gate) · up`` (computed as :func:`~specpilot.kernels.fused.silu_mul` computes it: the same bits).
        ``NORM`` / ``ADD`` (:mod:`specpilot.w12.norm`): x is RMS-normalised in the load, the scale formed from
        the ``n_sq`` tile sums of squares at ``SqIn`` (:func:`~specpilot.w12.epilogue._norm_rstd`) and the weights
        ``NormW``; the stored output is ``Res + y`` with its tile's sum of squares at ``SqOut[program_id(0)]``.
        ``VIEW``: the 8-bit view, no nibble loads (:func:`_lines_load`)."""
        R: tl.constexpr = BLOCK_K // 64
        J: tl.constexpr = BLOCK_N * 8
        pid_k = tl.program_id(1)
        n0 = tl.program_id(0) * BLOCK_N
        v0, q0 = _tile_words(n0, K_PAD)
        rr = tl.arange(0, R)
        jj = tl.arange(0, J)
        v_off = v0 + rr[:, None] * 1536 + jj[None, :]  # int64 words (1536 a record)
        q_off = q0 + rr[:, None] * 3072 + jj[None, :]  # int32 words (3072 a record)
        # 8-byte vectors of nibble words, as the views' 16-byte vectors hold 2 words: both tiles get one layout
        q_off = tl.max_contiguous(tl.multiple_of(q_off, [1, 2]), [1, 2])
        acc = tl.zeros([R, J], dtype=tl.float32)
        k0 = pid_k * K_PER_SPLIT
        k1 = tl.minimum(k0 + K_PER_SPLIT, K_PAD)
        rstd = _norm_rstd(SqIn, n_sq, K, eps, SQ_BLOCK) if NORM else 1.0
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if ESC_EARLY:
            esc = _escapes_load(RowPtr, EscK, EscD, offs_n, (offs_n < N) & (pid_k == 0))
        for kk in range(0, K_PER_SPLIT, BLOCK_K):
            vw, qw, xt = _lines_load(X, RecV, RecQ, k0 + kk, k1, K, v_off, q_off, rr, EVEN, X_EVEN, R, GLU, NORM, NormW,
                                     rstd, VIEW)
            acc = _lines_sum(acc, vw, qw, xt, R, BLOCK_N, ASM)
        if not ESC_EARLY:
            esc = _escapes_load(RowPtr, EscK, EscD, offs_n, (offs_n < N) & (pid_k == 0))
        _lines_end(acc, X, Base, Bias, Out, Part, Lock, EscK, EscD, esc, M, N, stride_xm, n0, pid_k, R, BLOCK_N,
                   SPLIT_K, FUSED, HAS_BIAS, GLU, NORM, NormW, rstd, ADD, Res, SqOut)

    @triton.jit
    def _lines_end(acc, X, Base, Bias, Out, Part, Lock, EscK, EscD, esc, M, N, stride_xm, n0, pid_k,
                   R: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, FUSED: tl.constexpr,
                   HAS_BIAS: tl.constexpr, GLU: tl.constexpr = False, NORM: tl.constexpr = False, NormW=None,
                   rstd=None, ADD: tl.constexpr = False, Res=None, SqOut=None):
        """The lines kernel's end: ``acc [R, BLOCK_N · 8]`` reduced over records and groups, scaled by each row's
        ``2^(B_n − 112)``, then :func:`_gemv_store` (escapes ``esc``, bias, split K) for rows ``n0 .. n0 + BLOCK_N − 1``."""
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        base = tl.load(Base + offs_n, mask=n_ok, other=112).to(tl.int32)
        scale = ((base + 15) << 23).to(tl.float32, bitcast=True)  # 2^(B_n − 112), exact
        y = (tl.sum(tl.sum(tl.reshape(acc, [R, BLOCK_N, 8]), axis=2), axis=0) * scale)[None, :]  # [1, BN]
        offs_m = tl.arange(0, 1)
        m_ok = offs_m < M
        _gemv_store(y, X, Bias, Out, Part, Lock, EscK, EscD, esc, M, N, stride_xm, offs_m, offs_n, m_ok, n_ok, pid_k,
                    SPLIT_K, FUSED, HAS_BIAS, GLU, NORM, NormW, rstd, ADD, Res, SqOut)

    @triton.jit
    def _lines_load(X, RecV, RecQ, kb, k1, K, v_off, q_off, rr, EVEN: tl.constexpr, X_EVEN: tl.constexpr,
                    R: tl.constexpr, GLU: tl.constexpr, NORM: tl.constexpr, NormW, rstd, VIEW: tl.constexpr = False):
        """The lines kernel's loads of the step at column ``kb``: view words ``[R, J]`` int64, nibble words ``[R, J]``
        int32 (records at or past ``k1`` read as 0 unless EVEN) and x ``[R, 64]`` float32 (columns at or past K read as
        0 unless X_EVEN; with ``GLU`` ``silu(gate) · up``, the up values K elements after the gate; with ``NORM``
        ``NormW · (x · rstd)``, :func:`~specpilot.kernels.fused.rmsnorm_values`). ``VIEW``: the nibble words are
        :func:`~specpilot.w12.tiles._view_nibbles` (the 8-bit view, §4.3), not loaded."""
        cols = kb + rr[:, None] * 64 + tl.arange(0, 64)[None, :]
        if EVEN:
            vw = tl.load(RecV + (kb // 64) * 1536 + v_off)
        else:
            ok = (kb + rr * 64 < k1)[:, None]
            vw = tl.load(RecV + (kb // 64) * 1536 + v_off, mask=ok, other=0)
        if VIEW:
            qw = _view_nibbles(vw)
        elif EVEN:
            qw = tl.load(RecQ + (kb // 64) * 3072 + q_off)
        else:
            qw = tl.load(RecQ + (kb // 64) * 3072 + q_off, mask=ok, other=0)
        if GLU and X_EVEN:
            xt = silu_mul_values(tl.load(X + cols), tl.load(X + K + cols)).to(tl.float32)
        elif GLU:
            xt = _x_load(X + cols, cols < K, K, GLU).to(tl.float32)
        elif NORM and X_EVEN:
            xt = rmsnorm_values(tl.load(X + cols), tl.load(NormW + cols), rstd).to(tl.float32)
        elif NORM:
            xt = _x_load(X + cols, cols < K, 0, False, True, NormW + cols, rstd).to(tl.float32)
        elif X_EVEN:
            xt = tl.load(X + cols).to(tl.float32)
        else:
            xt = tl.load(X + cols, mask=cols < K, other=0.0).to(tl.float32)
        return vw, qw, xt

    @triton.jit
    def _lines_sum(acc, vw, qw, xt, R: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr):
        """``acc [R, BLOCK_N · 8] +=`` the step's 8 products a group: the words decoded (:func:`_decode8`) times x
        (:func:`_x_groups`)."""
        w0, w1, w2, w3, w4, w5, w6, w7 = _decode8(vw, qw, ASM)
        x0, x1, x2, x3, x4, x5, x6, x7 = _x_groups(xt, R, BLOCK_N)
        acc += w0 * x0
        acc += w1 * x1
        acc += w2 * x2
        acc += w3 * x3
        acc += w4 * x4
        acc += w5 * x5
        acc += w6 * x6
        acc += w7 * x7
        return acc

    @triton.jit
    def _x_groups(xt, R: tl.constexpr, BLOCK_N: tl.constexpr):
        """x of the step's columns ``xt [R, 64]`` float32 as 8 tensors ``[R, BLOCK_N · 8]``: tensor ``i`` holds, at
        (record r, column j), ``xt[r, 8 (j % 8) + i]`` (column i of group j % 8), split and broadcast over the tile's
        rows (so the weights keep their load layout)."""
        t = tl.reshape(xt, [R, 8, 2, 2, 2])  # (record, group, i = 4a + 2b + c)
        c0, c1 = tl.split(t)
        b00, b01 = tl.split(c0)
        b10, b11 = tl.split(c1)
        x0, x4 = tl.split(b00)
        x2, x6 = tl.split(b01)
        x1, x5 = tl.split(b10)
        x3, x7 = tl.split(b11)
        J: tl.constexpr = BLOCK_N * 8
        return (_rows(x0, R, BLOCK_N, J), _rows(x1, R, BLOCK_N, J), _rows(x2, R, BLOCK_N, J), _rows(x3, R, BLOCK_N, J),
                _rows(x4, R, BLOCK_N, J), _rows(x5, R, BLOCK_N, J), _rows(x6, R, BLOCK_N, J), _rows(x7, R, BLOCK_N, J))

    @triton.jit
    def _rows(xg, R: tl.constexpr, BLOCK_N: tl.constexpr, J: tl.constexpr):
        """``[R, 8]`` (record, group) -> ``[R, BLOCK_N · 8]``, the same value for every row of a group."""
        return tl.reshape(tl.broadcast_to(xg[:, None, :], [R, BLOCK_N, 8]), [R, J])

__all__ = ["w12_gemv", "gemv_config", "gemv_resources", "GEMV_MAX_ROWS"]
