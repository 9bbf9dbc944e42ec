"""Programmatic dependent launch (PDL, sm_90+) for the decode path's Triton kernels (issue 5: the fixed cost a kernel
pays between two others).

A kernel launched with ``launch_pdl=True`` may start while the kernel before it on the stream still runs, as soon
as every program of that one has executed ``griddepcontrol.launch_dependents``; it must then execute
``griddepcontrol.wait`` (which returns once the previous kernel has finished and its writes are visible) before it
reads anything the previous kernels wrote and before it writes anything at all (a buffer it writes may be memory a
previous kernel still reads). :func:`pdl_start` does both at a kernel's first instruction, so what overlaps is the
launch, the programs' dispatch and nothing else: a kernel's own work always starts after its predecessor ended.
Kernels that are not launched this way (cuBLAS, PyTorch's own) serialise as usual, and ``wait`` returns at once
after them. CUDA graphs captured from such launches keep the programmatic edges (stream capture, CUDA ≥ 12.3).

The W12 kernels (:data:`W12_STYLE`) do better than wait-at-the-start: their weights do not depend on any earlier
kernel, so with ``"prefetch"`` a program loads its first K step's weight words *before* ``wait`` (only the
activations and every store come after it) and signals ``launch_dependents`` only after its K loop, so the next
kernel's programs do not take SM slots while this one still streams.

Measured on the H200 (``probes/pdl_check.py``, ``results/pdl_check_h200_2026-12-01_session10_run{1,2}.json``;
one graph of back-to-back calls) it does not pay: against PDL off the W12 GEMMs were 5–42% slower with ``start``
and 2–36% slower with ``prefetch`` (1–7% faster in three one-row cases), and the Qwen3-8B exact pass at one row
moved by −4% / 0% (bf16, two runs) and +1% (W12, prefetch). Hence off by default: ``SPECPILOT_PDL=1`` (or
:data:`ENABLED` set to True) turns it on. Never on the CPU, in the Triton interpreter, or on GPUs older than sm_90.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton
    triton = None
try:  # Triton >= 3.4 has the griddepcontrol intrinsics; without them PDL stays off
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAVE_GDC = True
except ImportError:
    HAVE_GDC = False

#: the process-wide switch (``SPECPILOT_PDL=1`` at import; benchmarks flip it to time both ways)
ENABLED = os.environ.get("SPECPILOT_PDL", "0") == "1"
#: how the W12 kernels use PDL when it is on: "start" (wait and signal at the first instruction, like the other
#: kernels) or "prefetch" (first step's weights loaded before the wait, signal after the K loop)
W12_STYLE = os.environ.get("SPECPILOT_PDL_W12", "prefetch")


def on(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: :data:`ENABLED`, a CUDA device of compute capability ≥ 9.0,
    and not the Triton interpreter."""
    if not ENABLED or not HAVE_GDC or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def launch_kw(device: torch.device) -> dict:
    """Keyword arguments of a Triton launch on ``device``: ``{"PDL": bool}`` for the kernel's constexpr and, when on,
    ``launch_pdl=True`` for the launcher (the programmatic-serialisation launch attribute)."""
    return {"PDL": True, "launch_pdl": True} if on(device) else {"PDL": False}


def w12_launch_kw(device: torch.device) -> dict:
    """:func:`launch_kw` for the W12 kernels, plus their ``PREFETCH`` constexpr (:data:`W12_STYLE` is
    ``"prefetch"`` and PDL is on). Raises ValueError for an unknown :data:`W12_STYLE`."""
    if W12_STYLE not in ("start", "prefetch"):
        raise ValueError(f"SPECPILOT_PDL_W12 must be 'start' or 'prefetch', got {W12_STYLE!r}")
    kw = launch_kw(device)
    return {**kw, "PREFETCH": kw["PDL"] and W12_STYLE == "prefetch"}


if triton is not None:

    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """A PDL kernel's first statement: let the next kernel launch, then wait for the previous one (module
        docstring); nothing when ``PDL`` is False."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """``griddepcontrol.wait`` when ``PDL``: the previous kernel has finished and its writes are visible."""
        if PDL:
            gdc_wait()

    @triton.jit
    def pdl_signal(PDL: tl.constexpr):
        """``griddepcontrol.launch_dependents`` when ``PDL``: the next kernel may launch."""
        if PDL:
            gdc_launch_dependents()
