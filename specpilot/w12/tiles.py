"""Triton helpers shared by the W12 kernels (§4.1): record words to decoded weights.

The records (:mod:`specpilot.w12.format`) are read as words: per row and group of 8 columns, one 64-bit
word of views (byte i = column i) and one 32-bit word of nibbles (nibble i = column i), both contiguous in
the record. :func:`_decode8` turns them into 8 float32 tensors ``w' = w · 2^(112 − B_n)`` in three integer
instructions a weight (see :func:`specpilot.w12.gemv.w12_gemv` for the bit layout); the kernel
multiplies each output row by ``2^(B_n − 112)`` once. :func:`_decode_words` interleaves them into a
``[BN, 8G]`` tile in column order for ``tl.dot``. A float32 ``w'`` has zero low 16 bits, so its bfloat16
cast is exact: the tensor-core kernel feeds bf16 with no rounding.

Used by :mod:`specpilot.w12.gemv` (FMAs, 1–8 rows) and :mod:`specpilot.w12.mma` (tensor
cores); tested through both against :func:`~specpilot.w12.gemm.w12_gemm_reference`.
"""

from __future__ import annotations

try:
    import triton
except ImportError:  # CPU installs without triton
    triton = None

#: runtime arguments of the word-reading kernels (``_w12_gemv_kernel``, ``_w12_mma_kernel``) and their Triton
#: types with bf16 activations, for offline compiles (:mod:`specpilot.kernels.resources`)
WORD_KERNEL_SIGNATURE = {"X": "*bf16", "RecV": "*i64", "RecQ": "*i32", "Base": "*u8", "Bias": "*bf16", "Out": "*bf16",
                         "Part": "*fp32", "Lock": "*i32", "RowPtr": "*i32", "EscK": "*i32", "EscD": "*fp32", "M": "i32", "N": "i32",
                         "K": "i32", "K_PAD": "i32", "K_PER_SPLIT": "i32", "stride_xm": "i32"}

if triton is not None:
    import triton.language as tl

    #: PTX of :func:`_decode8` (``ASM``): per column a prmt, an arithmetic shift and a lop3 (tested instruction by
    #: instruction on the CPU by ``tests/test_w12_ptx.py``)
    DECODE8_F32_PTX = tl.constexpr("""{
                .reg .b32 rlo, rhi, rq4, rt, rm, rc;
                mov.b64 {rlo, rhi}, $8;
                shl.b32 rq4, $9, 4;
                mov.b32 rm, 0x87FF0000;
                mov.b32 rc, 0x38000000;
                prmt.b32 rt, rlo, rq4, 0x0400; shr.s32 rt, rt, 4; lop3.b32 $0, rt, rm, rc, 0xEA;
                prmt.b32 rt, rlo, $9, 0x1400; shr.s32 rt, rt, 4; lop3.b32 $1, rt, rm, rc, 0xEA;
                prmt.b32 rt, rlo, rq4, 0x2500; shr.s32 rt, rt, 4; lop3.b32 $2, rt, rm, rc, 0xEA;
                prmt.b32 rt, rlo, $9, 0x3500; shr.s32 rt, rt, 4; lop3.b32 $3, rt, rm, rc, 0xEA;
                prmt.b32 rt, rhi, rq4, 0x0600; shr.s32 rt, rt, 4; lop3.b32 $4, rt, rm, rc, 0xEA;
                prmt.b32 rt, rhi, $9, 0x1600; shr.s32 rt, rt, 4; lop3.b32 $5, rt, rm, rc, 0xEA;
                prmt.b32 rt, rhi, rq4, 0x2700; shr.s32 rt, rt, 4; lop3.b32 $6, rt, rm, rc, 0xEA;
                prmt.b32 rt, rhi, $9, 0x3700; shr.s32 rt, rt, 4; lop3.b32 $7, rt, rm, rc, 0xEA;
                }""")

    @triton.jit
    def _w1(t):
        """Plain-Triton tail of the decode (:func:`~specpilot.w12.gemv.w12_gemv`): ``t`` int32 with the view byte in bits 31–24 and
        the nibble in bits 23–20 -> float32 ``w'`` (exponent bits 30–27 set to ``0111``)."""
        t = t >> 4  # arithmetic: the sign stays in bit 31
        return ((t & -2013331456) | 0x38000000).to(tl.float32, bitcast=True)  # -2013331456 == 0x87FF0000 as int32

    @triton.jit
    def _decode8(vw, qw, ASM: tl.constexpr):
        """One group of 8 columns: views ``vw`` (int64, byte i = column i) and nibbles ``qw`` (int32, nibble i =
        column i) -> 8 float32 tensors ``w' = w · 2^(112 − B_n)`` of vw's shape (bit layout:
        :func:`~specpilot.w12.gemv.w12_gemv`)."""
        if ASM:
            w = tl.inline_asm_elementwise(
                asm=DECODE8_F32_PTX,
                constraints="=r,=r,=r,=r,=r,=r,=r,=r,l,r", args=[vw, qw], dtype=(tl.int32,) * 8, is_pure=True,
                pack=1)
            return (w[0].to(tl.float32, bitcast=True), w[1].to(tl.float32, bitcast=True),
                    w[2].to(tl.float32, bitcast=True), w[3].to(tl.float32, bitcast=True),
                    w[4].to(tl.float32, bitcast=True), w[5].to(tl.float32, bitcast=True),
                    w[6].to(tl.float32, bitcast=True), w[7].to(tl.float32, bitcast=True))
        lo = vw.to(tl.int32)  # columns 0-3 (byte i = column i)
        hi = (vw >> 32).to(tl.int32)  # columns 4-7
        top = -16777216  # 0xFF000000: the view byte's place; nibble i goes to bits 23-20
        return (_w1((lo << 24) | ((qw << 20) & 0x00F00000)),
                _w1(((lo << 16) & top) | ((qw << 16) & 0x00F00000)),
                _w1(((lo << 8) & top) | ((qw << 12) & 0x00F00000)),
                _w1((lo & top) | ((qw << 8) & 0x00F00000)),
                _w1((hi << 24) | ((qw << 4) & 0x00F00000)),
                _w1(((hi << 16) & top) | (qw & 0x00F00000)),
                _w1(((hi << 8) & top) | ((qw >> 4) & 0x00F00000)),
                _w1((hi & top) | ((qw >> 8) & 0x00F00000)))

    #: PTX of :func:`_decode8_bf16` (tested instruction by instruction by ``tests/test_w12_ptx.py``)
    DECODE8_BF16_PTX = tl.constexpr("""{
                .reg .b32 rlo, rhi, rq4, na, nb, t, s;
                mov.b64 {rlo, rhi}, $8;
                shl.b32 rq4, $9, 4;
                prmt.b32 na, rq4, $9, 0x5140;
                prmt.b32 nb, rq4, $9, 0x7362;
                prmt.b32 t, rlo, na, 0x1504; shr.u32 s, t, 4; lop3.b32 s, s, 0x07FF07FF, 0x38003800, 0xEA;
                lop3.b32 t, t, 0x80008000, s, 0xEA; mov.b32 {$0, $1}, t;
                prmt.b32 t, rlo, na, 0x3726; shr.u32 s, t, 4; lop3.b32 s, s, 0x07FF07FF, 0x38003800, 0xEA;
                lop3.b32 t, t, 0x80008000, s, 0xEA; mov.b32 {$2, $3}, t;
                prmt.b32 t, rhi, nb, 0x1504; shr.u32 s, t, 4; lop3.b32 s, s, 0x07FF07FF, 0x38003800, 0xEA;
                lop3.b32 t, t, 0x80008000, s, 0xEA; mov.b32 {$4, $5}, t;
                prmt.b32 t, rhi, nb, 0x3726; shr.u32 s, t, 4; lop3.b32 s, s, 0x07FF07FF, 0x38003800, 0xEA;
                lop3.b32 t, t, 0x80008000, s, 0xEA; mov.b32 {$6, $7}, t;
                }""")

    @triton.jit
    def _decode8_bf16(vw, qw):
        """:func:`_decode8` straight to bfloat16 (CUDA only: inline PTX): the same 8 values ``w'`` (exact in
        bf16), two columns a 32-bit register, about 2.4 instructions a weight instead of 3 + a conversion."""
        w = tl.inline_asm_elementwise(asm=DECODE8_BF16_PTX, constraints="=h,=h,=h,=h,=h,=h,=h,=h,l,r",
                                      args=[vw, qw], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
        return w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]

    @triton.jit
    def _decode_words_bf16(vw, qw):
        """:func:`_decode_words` from :func:`_decode8_bf16`: bfloat16 ``w' [BN, 8G]`` in column order."""
        w0, w1, w2, w3, w4, w5, w6, w7 = _decode8_bf16(vw, qw)
        return tl.interleave(tl.interleave(tl.interleave(w0, w4), tl.interleave(w2, w6)),
                             tl.interleave(tl.interleave(w1, w5), tl.interleave(w3, w7)))

    @triton.jit
    def _k_order(t, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
        """Permute the K positions of a ``[ROWS, BLOCK_K]`` tile in column order (``BLOCK_K`` a multiple of 32):
        column ``32 g1 + 8 g0 + 4 q + 2 r + e`` goes to position ``32 g1 + 16 q + 8 r + 2 g0 + e``.

        The tensor-core kernel applies it to both operands of ``tl.dot``, which leaves the product unchanged
        (a sum over K in another order, as the rounding bound of :mod:`specpilot.w12.gemm` allows).
        Why: Hopper's register operand of ``wgmma`` (m64nNk16) gives thread ``t`` the positions
        ``2 (t mod 4) + {0, 1, 8, 9}`` of every 16; after this permutation those are exactly the 8 columns of
        4 whole record words, which is what a thread decodes, so the decoded tile feeds the tensor cores
        from registers without a round trip through shared memory (offline SASS, 16 rows, BLOCK_K 128: 257
        instructions a step, 434 before the bf16 decode and this permutation;
        ``results/sass_w12_mma_sm90a_2026-12-01_*.json``, ``probes/sass_w12_mma.py``)."""
        t = tl.reshape(t, [ROWS, BLOCK_K // 32, 4, 2, 2, 2])
        return tl.reshape(tl.permute(t, (0, 1, 3, 4, 2, 5)), [ROWS, BLOCK_K])

    @triton.jit
    def _k_columns(BLOCK_K: tl.constexpr):
        """The columns that :func:`_k_order` puts at positions ``0 .. BLOCK_K − 1`` (int32 ``[BLOCK_K]``): position
        ``32 g1 + 16 q + 8 r + 2 g0 + e`` holds column ``32 g1 + 8 g0 + 4 q + 2 r + e``. Loading a tile's columns in
        this order gives ``_k_order(tile)`` straight from memory (pairs of columns stay contiguous: 4-byte pieces
        of bf16), so the tensor-core kernel's activation tile can go from its ``cp.async`` buffer to ``wgmma``
        without the register permutation and the shared-memory store that ``_k_order`` costs on a loaded tile."""
        p = tl.arange(0, BLOCK_K)
        col = (p // 32) * 32 + ((p // 2) % 4) * 8 + ((p // 16) % 2) * 4 + ((p // 8) % 2) * 2 + p % 2
        return tl.max_contiguous(tl.multiple_of(col, 2), 2)

    @triton.jit
    def _tile_words(n0, K_PAD):
        """Row ``n0``'s first view word (int64 index) and first nibble word (int32 index) in record 0 of its band
        (128-row bands of ``K_PAD / 64`` records of 12288 bytes: 8192 of views, 64 a row, then 4096 of nibbles, 32 a
        row). Rows ``n0 + i`` of the same band follow at ``+ 8 i`` words in both."""
        band = (n0 // 128) * (K_PAD // 64) * 12288
        return (band + (n0 % 128) * 64) // 8, (band + 8192 + (n0 % 128) * 32) // 4

    @triton.jit
    def _word_offsets(n0, BLOCK_N: tl.constexpr, K_PAD, BLOCK_K: tl.constexpr):
        """Word addresses of rows ``n0 .. n0 + BLOCK_N − 1`` in the records (128-row bands of 64-column records of
        12288 bytes: 8192 bytes of views, then 4096 of nibbles): ``row_v`` / ``row_q`` ``[BLOCK_N]`` the int64 / int32
        word of each row's first view / nibble group in record 0 of its band, ``rg`` the step's groups ``0 ..
        BLOCK_K/8 − 1`` and ``col_v`` / ``col_q`` their word offsets (group ``g`` is in record ``g // 8`` of the step).

        ``n0`` is a multiple of BLOCK_N and BLOCK_N divides 128, so the tile lies in one band: the band and the
        first row are scalars and a row's offset is ``scalar + 8 · i``. The compiler then addresses a thread's rows
        from one base register with immediate offsets (per-row 64-bit addresses took 64 registers a thread in the
        one-row GEMV's offline SASS)."""
        v0, q0 = _tile_words(n0, K_PAD)
        rows = tl.arange(0, BLOCK_N)
        row_v = v0 + rows * 8
        row_q = q0 + rows * 8
        rg = tl.arange(0, BLOCK_K // 8)
        return row_v, row_q, rg, (rg // 8) * 1536 + rg % 8, (rg // 8) * 3072 + rg % 8

    @triton.jit
    def _load_groups(RecV, RecQ, kb, k_end, row_v, row_q, rg, col_v, col_q, EVEN: tl.constexpr,
                     VIEW: tl.constexpr = False):
        """View words ``[BN, G]`` int64 and nibble words ``[BN, G]`` int32 of the step at column ``kb``; groups at
        or past ``k_end`` read as 0 (unless EVEN: every group in range). ``VIEW`` (the 8-bit view, §4.3 Q pass):
        the nibble plane is not read; every nibble word is :func:`_view_nibbles`."""
        r0 = kb // 64
        if EVEN:
            vw = tl.load(RecV + r0 * 1536 + row_v[:, None] + col_v[None, :])
        else:
            ok = (kb + 8 * rg < k_end)[None, :]
            vw = tl.load(RecV + r0 * 1536 + row_v[:, None] + col_v[None, :], mask=ok, other=0)
        if VIEW:
            qw = _view_nibbles(vw)
        elif EVEN:
            qw = tl.load(RecQ + r0 * 3072 + row_q[:, None] + col_q[None, :])
        else:
            qw = tl.load(RecQ + r0 * 3072 + row_q[:, None] + col_q[None, :], mask=ok, other=0)
        return vw, qw

    @triton.jit
    def _view_nibbles(vw):
        """The nibble words of the 8-bit view (§4.3 Q pass) for view words ``vw``: int32 of vw's shape with every
        nibble ``1000b``, the midpoint of the 4 mantissa bits the view drops (``0x88888888``), so that
        :func:`_decode8` gives the weights of :func:`~specpilot.w12.format.approx_view` without a load."""
        return tl.full(vw.shape, -2004318072, tl.int32)  # 0x88888888 as int32

    @triton.jit
    def _decode_words(vw, qw, ASM: tl.constexpr):
        """Words ``vw [BN, G]`` int64 / ``qw [BN, G]`` int32 -> float32 ``w' [BN, 8G]`` in column order
        (column ``8g + i`` from byte / nibble ``i`` of group ``g``): :func:`_decode8` then three levels of
        ``tl.interleave`` (pairs ``i, i+4``, then ``+2``, then ``+1``)."""
        w0, w1, w2, w3, w4, w5, w6, w7 = _decode8(vw, qw, ASM)
        return tl.interleave(tl.interleave(tl.interleave(w0, w4), tl.interleave(w2, w6)),
                             tl.interleave(tl.interleave(w1, w5), tl.interleave(w3, w7)))
