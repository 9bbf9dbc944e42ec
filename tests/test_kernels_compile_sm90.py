"""Every Triton launch the kernel tests make in the interpreter compiles for sm_90a on the CPU
(tests/kernel_launches.py; Triton's bundled ptxas, no GPU), and the check fails on a kernel the interpreter runs but
the compiler refuses: a name bound in both branches of an ``if`` with two shapes, as the hybrid premix kernel once
had (key heads of d_k channels, value heads of d_v: it passed every interpreter test and failed to compile on the GPU
when d_k != d_v).

Each check runs two subprocesses (record under the interpreter, compile without it), so it works whatever this
process runs Triton as; skipped without ptxas and on CUDA machines, where the kernel tests compile for real."""

from __future__ import annotations

import os

import pytest
import torch

from specpilot.kernels.launches import failure_line
from specpilot.kernels.resources import ptxas_available

triton = pytest.importorskip("triton")
tl = triton.language

from . import kernel_launches  # noqa: E402

INTERPRETER = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")
needs_offline = pytest.mark.skipif(torch.cuda.is_available() or not ptxas_available(),
                                   reason="needs Triton's bundled ptxas and no CUDA device (there the tests compile)")


@triton.jit
def _planted_premix(X, Out, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr):
    """The bug, planted: ``ch`` is ``[DK]`` in one branch and ``[DV]`` in the other. The interpreter runs both;
    the compiler merges ``ch`` after the ``if`` and refuses two types when DK != DV."""
    head = tl.program_id(0)
    if head < HK:
        ch = head * DK + tl.arange(0, DK)
        tl.store(Out + ch, tl.load(X + ch) * 2.0)
    else:
        ch = HK * DK + (head - HK) * DV + tl.arange(0, DV)
        tl.store(Out + ch, tl.load(X + ch) + 1.0)


def _planted_launch(hk, hv, dk, dv):
    x = torch.randn(hk * dk + hv * dv)
    out = torch.zeros_like(x)
    _planted_premix[(hk + hv,)](x, out, HK=hk, DK=dk, DV=dv, num_warps=1)
    return x, out


@pytest.mark.skipif(not INTERPRETER, reason="the planted kernel does not compile when d_k != d_v: interpreter only")
@pytest.mark.parametrize("dk,dv", [(16, 32), (16, 16)])
def test_planted_kernel_runs_in_the_interpreter(dk, dv):
    """The interpreter gives the right values for both shapes, the one the compiler refuses included."""
    x, out = _planted_launch(2, 3, dk, dv)
    n = 2 * dk
    assert torch.equal(out[:n], x[:n] * 2) and torch.equal(out[n:], x[n:] + 1)


@needs_offline
def test_check_reports_the_planted_if_else_shape_bug():
    """Recorded from the interpreter test above, the d_k != d_v launch fails to compile, named with its file,
    specialization and the compiler's message; the d_k == d_v one compiles."""
    sel = {"tests": [f"{__file__}::test_planted_kernel_runs_in_the_interpreter"], "deselect": []}
    run = kernel_launches.check(sel, workers=1)
    res = sorted(run["results"], key=lambda r: r["specialization"])
    assert run["launches"] == 2 and len(res) == 2
    bad, good = res if "DV=32" in res[0]["specialization"] else res[::-1]
    assert good["ok"] and "DK=16, DV=16" in good["specialization"] and "num_warps': 1" in good["specialization"]
    assert not bad["ok"] and "DK=16, DV=32" in bad["specialization"]
    assert bad["kernel"] == f"{__name__}:_planted_premix" and bad["file"] == "tests/test_kernels_compile_sm90.py"
    want = "Mismatched type for ch between then block (<['16'], int32>) and else block (<['32'], int32>)"
    assert want in bad["error"]
    line = failure_line(bad)
    assert "_planted_premix" in line and "X:*fp32:D" in line and "Mismatched type for ch" in line


@needs_offline
def test_every_kernel_test_launch_compiles_for_sm90():
    """:data:`kernel_launches.CI`: every distinct launch (kernel, argument types and alignment, constexprs, warps,
    stages) of the kernel tests compiles for sm_90a; a failure lists each launch that does not."""
    run = kernel_launches.check(kernel_launches.CI, workers=2)
    res = run["results"]
    failed = [r for r in res if not r["ok"]]
    assert not failed, f"{len(failed)} of {len(res)} launches do not compile for sm_90a:\n" + "\n".join(
        failure_line(r) for r in failed)
    kernels = {r["kernel"].split(":")[0] for r in res}
    assert {"specpilot.kernels.tree_attention", "specpilot.kernels.hybrid_glue", "specpilot.w12.gemv",
            "specpilot.head.kernel"} <= kernels, kernels  # the recording saw the kernel modules
    assert any(not r.get("ran", True) and "bf16" in r["specialization"] for r in res)  # and the bfloat16 launches
