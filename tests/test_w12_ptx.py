"""The W12 decode's inline PTX, run instruction by instruction on the CPU.

The Triton interpreter cannot run inline assembly, so the GPU-only decode paths (``_decode8`` with ``ASM`` and
``_decode8_bf16``) would otherwise be tested only on a GPU. This file executes the very PTX strings the kernels
embed with a small numpy model of the few instructions they use (``mov``, ``shl``, ``shr``, ``prmt``, ``lop3``;
anything else fails the test) on every view byte and nibble at every column of a word, and compares the
result with the W12 bit layout (§4.1): ``w' = sign · 2^(o − 15) · 1.m`` with ``o`` the exponent offset.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

triton = pytest.importorskip("triton")

from specpilot.w12 import tiles as w12_tiles  # noqa: E402

M32 = np.uint64(0xFFFFFFFF)


def _imm(tok: str) -> np.uint64:
    return np.uint64(int(tok, 16) if tok.lower().startswith("0x") else int(tok))


def run_ptx(asm: str, inputs: dict[str, np.ndarray], outputs: int) -> list[np.ndarray]:
    """Execute ``asm`` (one ``{ ... }`` block) on numpy uint64 arrays holding 32- or 64-bit values.

    ``inputs`` maps ``$k`` operands to arrays; returns the ``outputs`` first operands ``$0 ..`` (32-bit values,
    or 16-bit ones when written by ``mov.b32 {$a, $b}``). Raises AssertionError on an instruction it does not
    model, so a new instruction in a kernel's PTX cannot pass unchecked."""
    regs: dict[str, np.ndarray] = dict(inputs)

    def val(tok):
        tok = tok.strip()
        return regs[tok] if tok in regs else np.full_like(next(iter(inputs.values())), _imm(tok))

    body = asm.strip().strip("{}")
    for ins in (s.strip() for s in body.split(";")):
        if not ins or ins.startswith(".reg"):
            continue
        op, rest = ins.split(None, 1)
        vec = re.match(r"\{\s*([^,}]+)\s*,\s*([^}]+)\}\s*,\s*(\S+)$", rest)
        args = [a.strip() for a in rest.split(",")]
        if op == "mov.b64" and vec:  # {lo, hi} = a 64-bit value
            v = val(vec.group(3))
            regs[vec.group(1).strip()], regs[vec.group(2).strip()] = v & M32, (v >> np.uint64(32)) & M32
        elif op == "mov.b32" and vec:  # {lo16, hi16} = a 32-bit value
            v = val(vec.group(3))
            regs[vec.group(1).strip()] = v & np.uint64(0xFFFF)
            regs[vec.group(2).strip()] = (v >> np.uint64(16)) & np.uint64(0xFFFF)
        elif op == "mov.b32":
            regs[args[0]] = val(args[1]) & M32
        elif op == "cvt.u32.u16":  # zero-extend a 16-bit register
            regs[args[0]] = val(args[1]) & np.uint64(0xFFFF)
        elif op == "shl.b32":
            regs[args[0]] = (val(args[1]) << val(args[2])) & M32
        elif op == "shr.u32":
            regs[args[0]] = (val(args[1]) & M32) >> val(args[2])
        elif op == "shr.s32":
            s = val(args[1]).astype(np.uint32).view(np.int32) >> val(args[2]).astype(np.int32)
            regs[args[0]] = s.view(np.uint32).astype(np.uint64)
        elif op == "prmt.b32":  # default mode: byte n of d = byte sel_n of {b, a}; sel bit 3 replicates the sign
            a, b, c = val(args[1]), val(args[2]), int(_imm(args[3]))
            src, d = (b << np.uint64(32)) | a, np.zeros_like(a)
            for n in range(4):
                sel = (c >> 4 * n) & 15
                byte = (src >> np.uint64(8 * (sel & 7))) & np.uint64(0xFF)
                if sel & 8:
                    byte = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
                d |= byte << np.uint64(8 * n)
            regs[args[0]] = d
        elif op == "lop3.b32":  # bit = immLut[(a << 2) | (b << 1) | c]
            a, b, c, lut = val(args[1]), val(args[2]), val(args[3]), int(_imm(args[4]))
            d = np.zeros_like(a)
            for idx in range(8):
                if lut >> idx & 1:
                    sa = a if idx & 4 else ~a & M32
                    sb = b if idx & 2 else ~b & M32
                    sc = c if idx & 1 else ~c & M32
                    d |= sa & sb & sc
            regs[args[0]] = d & M32
        else:
            raise AssertionError(f"instruction not modelled: {ins}")
    return [regs[f"${k}"] for k in range(outputs)]


def _words(rng):
    """Every (view byte, nibble) pair at every column of a word: view words ``[8·4096]`` (byte i = column i),
    nibble words (nibble i = column i), the column index, and the pair's view / nibble; other columns random."""
    v, n = np.meshgrid(np.arange(256, dtype=np.uint64), np.arange(16, dtype=np.uint64), indexing="ij")
    v, n = np.tile(v.ravel(), 8), np.tile(n.ravel(), 8)
    col = np.repeat(np.arange(8, dtype=np.uint64), 4096)
    vw = rng.integers(0, 2**64, size=v.size, dtype=np.uint64)
    qw = rng.integers(0, 2**32, size=v.size, dtype=np.uint64)
    vw = (vw & ~(np.uint64(0xFF) << (8 * col))) | (v << (8 * col))
    qw = (qw & ~(np.uint64(0xF) << (4 * col))) | (n << (4 * col))
    return vw, qw, col, v, n


def _expected_bf16(v, n):
    """bf16 bits of ``w'`` from the W12 layout: view = sign | 4-bit offset | top 3 mantissa bits, nibble = low
    mantissa bits; ``w'``'s exponent field is ``112 + offset``."""
    return ((v >> np.uint64(7)) << np.uint64(15)) | ((np.uint64(112) + ((v >> np.uint64(3)) & np.uint64(15))) << np.uint64(7)) \
        | ((v & np.uint64(7)) << np.uint64(4)) | n


@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_decode_ptx_gives_every_code_at_every_column(kind):
    rng = np.random.default_rng(0)
    vw, qw, col, v, n = _words(rng)
    asm = (w12_tiles.DECODE8_F32_PTX if kind == "f32" else w12_tiles.DECODE8_BF16_PTX).value
    outs = run_ptx(asm, {"$8": vw, "$9": qw}, 8)
    got = np.choose(col.astype(np.int64), outs)
    want = _expected_bf16(v, n)
    if kind == "f32":  # float32 w' has zero low 16 bits: its top half is the bf16 value
        assert np.all(got & np.uint64(0xFFFF) == 0)
        got = got >> np.uint64(16)
    np.testing.assert_array_equal(got, want)
    # the decoded value itself: sign · 2^(offset − 15) · (1 + mantissa / 128)
    vals = np.array(got.astype(np.uint32) << 16, dtype=np.uint32).view(np.float32)
    o, m = (v >> np.uint64(3)) & np.uint64(15), ((v & np.uint64(7)) << np.uint64(4)) | n
    ref = np.where(v >> np.uint64(7), -1.0, 1.0) * np.exp2(o.astype(np.float64) - 15) * (1 + m.astype(np.float64) / 128)
    np.testing.assert_array_equal(vals.astype(np.float64), ref)


def test_emulator_rejects_an_unmodelled_instruction():
    with pytest.raises(AssertionError, match="not modelled"):
        run_ptx("{ add.u32 $0, $1, 1; }", {"$1": np.zeros(1, dtype=np.uint64)}, 1)


def test_emulator_prmt_and_lop3_follow_the_ptx_manual():
    one = np.ones(1, dtype=np.uint64)
    # prmt: bytes of {b, a} = 0x77665544_33221100; selector 0x7531 picks bytes 1, 3, 5, 7
    (d,) = run_ptx("{ prmt.b32 $0, $1, $2, 0x7531; }", {"$1": one * 0x33221100, "$2": one * 0x77665544}, 1)
    assert int(d[0]) == 0x77553311
    # sign replication (selector bit 3): byte 3 = 0x80 -> 0xFF, byte 0 = 0x00 -> 0x00
    (d,) = run_ptx("{ prmt.b32 $0, $1, $2, 0x8B; }", {"$1": one * 0x80000000, "$2": one * 0}, 1)
    assert int(d[0]) == 0x00FF
    # lop3 0xEA = (a & b) | c, 0x96 = a ^ b ^ c
    (d,) = run_ptx("{ lop3.b32 $0, $1, $2, $3, 0xEA; }", {"$1": one * 0xF0F0, "$2": one * 0xFF00, "$3": one * 0x000F}, 1)
    assert int(d[0]) == 0xF00F
    (d,) = run_ptx("{ lop3.b32 $0, $1, $2, $3, 0x96; }", {"$1": one * 0b1100, "$2": one * 0b1010, "$3": one * 0b0110}, 1)
    assert int(d[0]) == 0b0000
