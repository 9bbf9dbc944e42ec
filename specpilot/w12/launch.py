"""Launch rules of the W12 kernels (§4.1): which kernel runs a call and with which launch shape, from static shapes
only (so a captured CUDA graph and an eager call make the same choice and give the same bits).

- :func:`routes_to_gemv` / :func:`one_row_gemv`: one activation row of most projections goes to the FMA GEMV
  (:mod:`specpilot.w12.gemv`), everything else to the tensor-core kernel over record words
  (:mod:`specpilot.w12.mma`).
- :func:`default_config`: the tensor-core kernel's launch (blocks, split K, in-kernel split sum, register cap).
- :func:`gemv_config`: the GEMV's launch (line-coalesced kernel at one row, split K to fill the GPU).
- :data:`OVERRIDES` / :func:`check_overrides`: the launch overrides :func:`~specpilot.w12.gemm.w12_gemm` accepts.

Every constant here was measured on an H200 (132 SMs); the figures and their result files are quoted where the
constant is defined. Plain Python: no torch, no Triton.
"""

from __future__ import annotations

from specpilot.w12.escapes import W12GemmError
from specpilot.w12.format import RECORD_COLS

MAX_ROWS = 256  # rows per kernel launch; more rows are run in chunks of this many
GEMV_MAX_ROWS = 8  # rows per call of the FMA kernel

#: programs a launch aims for, per SM (SPLIT_K grows until reached): on the H200 the best split in
#: ``results/w12_mma_sweep_h200_2026-12-01_4881152.json`` gave 384–512 programs (qkv 96 x 4, o and down
#: 64 x 8, gate_up 384 x 1) on 132 SMs
PROGRAMS_PER_SM = 2.9


#: rows up to which split K is summed in the kernel (``fused_split``): on the H200 the tensor-core kernel's fused sum
#: saved 6.5–7.7% on Qwen3-8B qkv / o and 3.9–5.2% on down at 1–16 rows; from 32 rows it lost 20–60% on o and
#: down (the last split adds every partial tile alone) and was mixed on qkv
#: (``results/w12_mma_sweep_h200_2026-12-01_36ffc3b.json``)
FUSED_SPLIT_MAX_ROWS = 16


#: registers a thread of the tensor-core kernel at BLOCK_M 16 is capped at when its launch needs more than one wave.
#: Uncapped it takes 86 (offline ptxas, sm_90a, M not a multiple of 16; fewer when M is), so an SM holds
#: :data:`WAVE_PROGRAMS` = 5 four-warp programs (registers are allocated per warp in units of 256); at 80 (no spills,
#: offline) it holds 6. H200 (``probes/w12_waves_probe.py``,
#: ``results/w12_waves_probe_h200_2026-12-02_735344e.json``): Qwen3-32B gate_up launches 800 programs at
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
    shapes (``results/w12_escape_slots_probe_h200_2026-12-02_26e1c53.json``, with the slot
    steps unrolled), but holds ~28 more registers through the loop (offline ptxas, 16 rows: 78 → 106; with the
    unrolled steps the kernel went 80 → 126 and Qwen3-32B's 640-program launches then no longer fit in one wave:
    32B down at 8 rows 1.39 → 1.07x in ``results/w12_bench_h200_2026-12-02_26e1c53_unrolled.json``).
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
    side by side in one run (``results/w12_double_probe_h200_2026-12-01_7b87fb5.json``, the line-coalesced
    GEMV): the GEMV wins on Qwen3-8B qkv / o / gate_up (14.29 / 11.01 / 40.76 µs vs 15.08 / 11.90 / 41.18), 8B down
    (23.24 vs 24.07) and Qwen3-32B gate_up (100.3 vs 109.8); the tensor cores win on 32B qkv / o / down (24.9 /
    21.5 / 52.4 vs 27.0 / 22.9 / 56.6), where K is long for the tile count. The third clause is fitted to these
    eight shapes (it takes 8B down and leaves the 32B ones); 8B down went to the tensor cores before the
    line-coalesced GEMV made the GEMV the faster kernel there."""
    return k <= 4096 or n > 4 * k or (n <= 4096 and k <= 3 * n)


def routes_to_gemv(m: int, n: int, k: int) -> bool:
    """Whether :func:`~specpilot.w12.gemm.w12_gemm` without a ``gemv`` override runs ``m`` rows of a ``[n, k]``
    weight on the GEMV (one row and :func:`one_row_gemv`) rather than the tensor-core kernel."""
    return m == 1 and one_row_gemv(n, k)


#: launch overrides :func:`~specpilot.w12.gemm.w12_gemm` takes (any other name is refused: a misspelt tuning knob
#: must not pass silently)
OVERRIDES = frozenset({"block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages", "w_left", "gemv", "words",
                       "fused_split", "asm", "load_stages", "lines", "x_gather", "esc_early", "maxnreg"})


def check_overrides(overrides: dict) -> None:
    """Check launch overrides by name (:data:`OVERRIDES`) and type: block / split / warp / stage counts positive
    integers, ``maxnreg`` 0 or 24..255, switches True / False (None: not overridden). Raises W12GemmError."""
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


#: warps an SM the grid should hold, by padded rows: one row from the H200 sweeps
#: (``results/w12_gemv_probe_h200_2026-11-30_*_run{1,2,3}.json``); 2–8 rows: what the registers allow
#: (``results/ptxas_w12_gemv_2026-11-30.json``), timed on the H200 at 0.12–0.61x cuBLAS
#: (``results/w12_double_probe_h200_2026-12-01_7b87fb5.json``), so left unrouted.
GEMV_WARPS_PER_SM = {1: 11, 2: 16, 4: 10, 8: 8}


def gemv_config(n: int, k: int, num_sms: int = 132, m: int = 1) -> dict:
    """Launch parameters of :func:`~specpilot.w12.gemv.w12_gemv` for ``m`` rows from static shapes only.

    One row (H200, ``results/w12_launch_sweep_lines_h200_2026-12-01_bfb1047.json``): the line-coalesced kernel
    (``lines``, :func:`~specpilot.w12.gemv._w12_gemv_lines_kernel`), BLOCK_N 16, BLOCK_K 256, one warp a
    program, K split in 2, 4, 8 or 16 until the grid holds :data:`GEMV_WARPS_PER_SM` warps an SM (and the splits
    divide the padded K into whole steps). This rule gives the best of 31 launch shapes on each Qwen3-8B
    projection: qkv split 4 (14.11 µs vs 14.94 for the previous default in the same run), o split 8 (10.92 vs
    11.27), gate_up split 1 (40.23 vs 40.74), down split 8 (22.98 vs 23.57). The alternatives were timed side by
    side against this pick (``results/w12_{stream,double,intra_split,narrow}_probe_h200_2026-12-01_
    7b87fb5.json``): TMA copies into a 2–5-stage shared-memory ring (also persistent), a register double buffer,
    K split inside a program (2–16 warps), BLOCK_N 4 / 8 and one-warp BLOCK_K 512 / 1024. Only one config beat it on
    one shape (o, BLOCK_N 8 / BLOCK_K 1024 / 4 warps: 10.87 vs 11.02 µs); the rest were slower on every shape.

    2–8 rows (:func:`~specpilot.w12.gemv._w12_gemv_kernel`, ``[BLOCK_N, groups]`` tiles; 0.12–0.61x cuBLAS on the
    H200, so not a default): 8 groups of 8 weights a thread, since ptxas reported 254–255 registers with 16 groups
    from 2 rows on (before the affine row offsets of :func:`~specpilot.w12.tiles._word_offsets`) and 8 groups 128 /
    ~175 / ~250 registers at 2 / 4 / 8 rows.
    BLOCK_N 16; BLOCK_K the smallest of 256 .. 2048 whose grid reaches :data:`GEMV_WARPS_PER_SM` warps an SM,
    ``num_warps = 16 · BLOCK_K / (256 · groups)``; if the grid is still short, split K in two or four, then BLOCK_K
    grows again. BLOCK_K grows only to sizes that divide the padded K, and the splits divide it too (a ragged last
    block masks every load of the kernel: Qwen3-32B's down projection, K = 25600, ran at 0.46x cuBLAS with BLOCK_K
    2048 and 1.03x with 1024, ``results/w12_one_row_check_h200_2026-12-01_99fd15e.json``). ``num_stages`` 3
    (the launch option; it pipelines nothing here, see ``load_stages``); split K summed in the kernel
    (``fused_split``, see :func:`default_config`); ``load_stages`` 1 (plain loads; see
    :func:`~specpilot.w12.gemv.w12_gemv`); ``esc_early`` off: the lines kernel loads its escape slots after the K
    loop (H200, ``results/w12_escape_slots_probe_h200_2026-12-02_26e1c53.json``, the slot steps then unrolled:
    before the loop, with the registers held through it, o / down ran 13.69 / 29.43 µs, after it 10.21 / 22.13;
    qkv / gate_up 14.75 / 40.62 vs 13.64 / 39.86). The 2–8-row kernel always loads them before its loop.

    Raises: W12GemmError for ``m`` outside 1..8."""
    rows = 1 << max(0, int(m) - 1).bit_length()
    if rows not in GEMV_WARPS_PER_SM:
        raise W12GemmError(f"gemv takes 1..{GEMV_MAX_ROWS} rows, got {m}")
    bn, bk, groups = 16, 256, 16 if rows == 1 else 8
    warps = lambda b: max(1, bn * b // (8 * 32 * groups))  # noqa: E731
    k_pad = -(-k // RECORD_COLS) * RECORD_COLS
    want = GEMV_WARPS_PER_SM[rows] * num_sms
    programs = -(-n // bn)
    if rows == 1:  # the line-coalesced kernel: one-warp programs of 256 columns a step, split K to fill the grid
        split = 1
        while split < 16 and programs * split < want and k_pad % (2 * split * bk) == 0:
            split *= 2
        return dict(block_n=bn, block_k=bk, split_k=split, num_warps=1, num_stages=3, asm=True, fused_split=True,
                    load_stages=1, lines=True, esc_early=False)
    while bk < 2048 and k_pad % (2 * bk) == 0 and warps(2 * bk) <= 16 and programs * warps(bk) < want:
        bk *= 2
    split = 1
    while split < 4 and programs * split * warps(bk) < want and k_pad % (2 * split * bk) == 0:
        split *= 2
    while (bk < 2048 and k_pad % (2 * bk * split) == 0 and warps(2 * bk) <= 16
           and programs * split * warps(bk) < want):
        bk *= 2
    return dict(block_n=bn, block_k=bk, split_k=split, num_warps=warps(bk), num_stages=3, asm=True, fused_split=True,
                load_stages=1, lines=False, esc_early=False)



def gemv_resources(rows: int, block_n: int, block_k: int, num_warps: int, num_stages: int = 3, split_k: int = 1,
                   load_stages: int = 1, lines: bool = False):
    """Registers and spills of the GEMV kernel for ``rows`` (1..8) compiled for sm_90a without a GPU
    (:func:`specpilot.kernels.resources.kernel_resources`; bf16 activations, inline-PTX decode, even K);
    ``lines`` (one row only): the line-coalesced kernel :func:`~specpilot.w12.gemv._w12_gemv_lines_kernel`.
    Raises: ResourcesUnavailable without Triton's ptxas; W12GemmError for rows outside 1..8."""
    import triton

    from specpilot.kernels.resources import kernel_resources
    from specpilot.w12.gemv import _w12_gemv_kernel, _w12_gemv_lines_kernel
    from specpilot.w12.tiles import WORD_KERNEL_SIGNATURE

    if not 1 <= rows <= GEMV_MAX_ROWS:
        raise W12GemmError(f"gemv takes 1..{GEMV_MAX_ROWS} rows, got {rows}")
    consts = dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, FUSED=False, EVEN=True, X_EVEN=True,
                  HAS_BIAS=False, ASM=True)
    if lines and rows == 1:
        return kernel_resources(_w12_gemv_lines_kernel, WORD_KERNEL_SIGNATURE, consts, num_warps, num_stages)
    consts |= dict(ROWS=triton.next_power_of_2(rows), LOAD_STAGES=load_stages)
    return kernel_resources(_w12_gemv_kernel, WORD_KERNEL_SIGNATURE, consts, num_warps, num_stages)


__all__ = ["MAX_ROWS", "GEMV_MAX_ROWS", "PROGRAMS_PER_SM", "FUSED_SPLIT_MAX_ROWS", "WAVE_MAXNREG", "WAVE_PROGRAMS",
           "GEMV_WARPS_PER_SM", "OVERRIDES", "default_config", "gemv_config", "one_row_gemv", "routes_to_gemv",
           "check_overrides", "gemv_resources"]
