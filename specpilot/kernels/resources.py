"""Registers, spills and shared memory of a Triton kernel compiled for a GPU that need not be present.

Triton compiles to PTX without a device; the ``ptxas`` bundled with its NVIDIA backend assembles that PTX
for ``sm_90a`` (the H100 / H200) and reports, per kernel, the registers a thread uses and the bytes it
spills to local memory. Those two figures bound occupancy (65 536 registers an SM: a thread using ``r``
registers allows at most ``65536 // (32 r)`` warps an SM) and flag launch configs that will be slow before
any GPU time is spent (e.g. the W12 GEMV's rows and groups per thread). A compile-time figure, not a
timing: it says nothing about speed by itself.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path


class ResourcesUnavailable(RuntimeError):
    """Triton or its bundled ``ptxas`` is not installed here."""


@dataclass(frozen=True)
class KernelResources:
    """One compiled kernel: ``registers`` per thread, ``spill_bytes`` (spill stores, bytes per thread),
    ``shared_bytes`` (static + Triton's dynamic shared memory, bytes per program), ``num_warps``,
    ``ptx``: static counts of memory and MMA instructions in the PTX (``ld.global.b8``, ``ld.global.v4.b32``,
    ``st.shared...``, ``wgmma.mma_async``, ``cp.async...``, ``atom...``: each distinct opcode with its suffixes; a
    loop body counts once), ``ptx_order``: the same opcodes in the order they appear in the PTX, and ``max_warps_per_sm``: the register-file limit
    (at most 64)."""

    registers: int
    spill_bytes: int
    shared_bytes: int
    num_warps: int
    ptx: dict = field(default_factory=dict)
    ptx_order: tuple = ()

    @property
    def max_warps_per_sm(self) -> int:
        """Warps an SM can hold by registers alone, in whole programs (64 at most on sm_90; registers
        are allocated per warp in units of 256)."""
        per_warp = -(-32 * max(self.registers, 1) // 256) * 256
        return min(64, 65536 // per_warp // self.num_warps * self.num_warps)


def ptxas_path() -> Path:
    """The ``ptxas`` of Triton's NVIDIA backend. Raises ResourcesUnavailable when absent."""
    try:
        import triton
    except ImportError:
        raise ResourcesUnavailable("triton is not installed") from None
    p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not p.is_file() or not os.access(p, os.X_OK):
        raise ResourcesUnavailable(f"no ptxas at {p}")
    return p


def ptxas_available() -> bool:
    """Whether :func:`ptxas_path` finds Triton's bundled ``ptxas`` (offline sm_90a compiles in tests and tools)."""
    try:
        ptxas_path()
        return True
    except ResourcesUnavailable:
        return False


def kernel_resources(kernel, signature: dict[str, str], constants: dict, num_warps: int, num_stages: int,
                     arch: int = 90, maxnreg: int | None = None, divisible_by_16: tuple = ()) -> KernelResources:
    """Compile ``kernel`` (a ``@triton.jit`` function) for ``sm_{arch}a`` and read ptxas's report.

    Args:
        kernel: the jitted function. signature: every runtime argument's Triton type (``"*bf16"``, ``"i32"``).
        constants: every ``tl.constexpr`` argument's value. num_warps / num_stages: launch options.
        arch: compute capability times ten (90: Hopper). maxnreg: the launch option capping registers a thread.
        divisible_by_16: runtime arguments to compile as a launch specialises them when their value (an integer, or a
            pointer's address) is a multiple of 16, as real launches' tensors and shapes usually are.
    Returns: :class:`KernelResources`.
    Raises: ResourcesUnavailable without Triton / ptxas; RuntimeError when ptxas fails or says nothing.
    """
    ptxas = ptxas_path()
    out = _compile(kernel, signature, constants, num_warps, num_stages, arch, maxnreg, divisible_by_16)
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(out.asm["ptx"])
        proc = subprocess.run([str(ptxas), "--gpu-name", f"sm_{arch}a", "-v", str(src), "-o", str(Path(d) / "k.cubin")],
                              capture_output=True, text=True, timeout=300)
    report = proc.stdout + proc.stderr
    regs = re.search(r"Used (\d+) registers", report)
    spill = re.search(r"(\d+) bytes spill stores", report)
    if proc.returncode != 0 or regs is None or spill is None:
        raise RuntimeError(f"ptxas failed (exit {proc.returncode}): {report.strip()[-300:]}")
    smem = re.search(r"(\d+) bytes smem", report)
    order = re.findall(r"^\s*(?:@!?%\w+\s+)?((?:ld|st|cp|atom|red|wgmma|mma|ldmatrix|stmatrix)\.[\w.]+)",
                       out.asm["ptx"], re.MULTILINE)
    return KernelResources(int(regs.group(1)), int(spill.group(1)),
                           int(out.metadata.shared) + (int(smem.group(1)) if smem else 0), num_warps,
                           dict(sorted(Counter(order).items())), tuple(order))


def _compile(kernel, signature: dict[str, str], constants: dict, num_warps: int, num_stages: int, arch: int,
             maxnreg: int | None, divisible_by_16: tuple):
    """``triton.compile`` of ``kernel`` for ``sm_{arch}a`` (arguments: :func:`kernel_resources`); no GPU needed."""
    try:
        import triton
    except ImportError:
        raise ResourcesUnavailable("triton is not installed") from None
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature) | {name: "constexpr" for name in constants}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible_by_16}
    return triton.compile(ASTSource(kernel, sig, constants, attrs), target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages)
                          | ({"maxnreg": maxnreg} if maxnreg else {}))


def kernel_ptx(kernel, signature: dict[str, str], constants: dict, num_warps: int, num_stages: int,
               arch: int = 90) -> str:
    """The PTX text of ``kernel`` compiled for ``sm_{arch}a`` without a GPU (arguments as :func:`kernel_resources`), e.g.
    to check which arguments the compiled kernel reads at all (``<kernel name>_param_<i>``, ``i`` the argument's
    index). Raises ResourcesUnavailable without Triton."""
    return _compile(kernel, signature, constants, num_warps, num_stages, arch, None, ()).asm["ptx"]


__all__ = ["KernelResources", "ResourcesUnavailable", "kernel_resources", "kernel_ptx", "ptxas_available",
           "ptxas_path"]
