"""Programmatic dependent launch (``specpilot.kernels.pdl``): off on the CPU and by default; the decode path's kernels
compile with it for sm_90a (offline, Triton's bundled ptxas: the griddepcontrol instructions are in the PTX and
assemble); on a GPU with it on, outputs and engine tokens equal the plain launches' (skipped without CUDA)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from specpilot.kernels import pdl
from specpilot.kernels.resources import ptxas_available

triton = pytest.importorskip("triton")


def test_off_on_the_cpu_and_by_default(monkeypatch):
    assert pdl.launch_kw(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert not pdl.on(torch.device("cpu"))  # never on the CPU, even when asked for
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.launch_kw(torch.device("cuda", 0)) == {"PDL": False}  # nor in the interpreter


COMPILE = r"""
import importlib, json, sys
from specpilot.kernels import fused
from specpilot.w12 import gemm as w12_gemm, gemv as w12_gemv, mma as w12_mma
from specpilot.kernels.resources import kernel_resources
from specpilot.w12.tiles import WORD_KERNEL_SIGNATURE
tree_attention = importlib.import_module("specpilot.kernels.tree_attention")  # the package exports a function too
bf, i32 = "*bf16", "i32"
KERNELS = {
    "w12_mma": (w12_mma._w12_mma_kernel, dict(WORD_KERNEL_SIGNATURE), dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SPLIT_K=1,
                FUSED=False, EVEN=True, X_EVEN=True, HAS_BIAS=False, FP32=False, ASM=True)),
    "w12_gemv": (w12_gemv._w12_gemv_kernel, dict(WORD_KERNEL_SIGNATURE), dict(BLOCK_N=16, BLOCK_K=256, ROWS=1,
                 SPLIT_K=1, FUSED=False, EVEN=True, X_EVEN=True, HAS_BIAS=False, ASM=True)),
    "w12_split_sum": (w12_gemm._w12_split_sum_kernel, {"Part": "*fp32", "Bias": bf, "Out": bf, "M": i32, "N": i32},
                      dict(SPLIT_K=2, BLOCK_M=16, BLOCK_N=64, HAS_BIAS=False)),
    "add_rmsnorm": (fused._add_rmsnorm_kernel, {"X": bf, "Delta": bf, "W": bf, "Normed": bf, "NewX": bf, "D": i32,
                    "eps": "fp32"}, dict(HAS_DELTA=True, BLOCK=256)),
    "silu_mul": (fused._silu_mul_kernel, {"GU": bf, "Out": bf, "I": i32}, dict(BLOCK=1024)),
    "tree_attn_fwd": (tree_attention._tree_attn_fwd, {"Q": bf, "K": bf, "V": bf, "PrefixLen": "*i64",
                      "TreeMask": "*i32", "Out": bf, "PartAcc": "*fp32", "PartML": "*fp32", "qk_scale": "fp32",
                      "R": i32, "S": i32, "KVH": i32, **{n: i32 for n in ("stride_qr", "stride_qh", "stride_ks",
                      "stride_kh", "stride_vs", "stride_vh", "stride_or", "stride_oh", "stride_tm")}},
                      dict(G=2, HEAD_DIM=64, BLOCK_M=16, BLOCK_N=32, NUM_SPLITS=1, FP32=False)),
}
kern, sig, const = KERNELS[sys.argv[1]]
# kernel_resources compiles for sm_90a and assembles with ptxas (RuntimeError if ptxas fails)
variants = {"False": {"PDL": False}, "True": {"PDL": True}}
if sys.argv[1].startswith("w12_") and sys.argv[1] != "w12_split_sum":
    variants["prefetch"] = {"PDL": True, "PREFETCH": True}
res = {name: kernel_resources(kern, sig, {**const, **v}, 4, 2) for name, v in variants.items()}
print(json.dumps({"counts": {name: r.ptx for name, r in res.items()},
                  "order": {name: list(r.ptx_order) for name, r in res.items()}}))
"""


@pytest.mark.skipif(not ptxas_available(), reason="Triton's bundled ptxas is not installed here")
@pytest.mark.parametrize("name", ["w12_mma", "w12_gemv", "w12_split_sum", "add_rmsnorm", "silu_mul", "tree_attn_fwd"])
def test_kernels_compile_with_pdl_for_sm90(name):
    import json
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile the real kernels, not the interpreter's
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, "-c", COMPILE, name], capture_output=True, text=True, timeout=600, env=env,
                       cwd=root)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])  # PTX opcode counts and order with PDL off / on
    res, order = out["counts"], out["order"]
    for on in [v for v in res if v != "False"]:
        assert res[on].get("griddepcontrol.wait", 0) >= 1 and res[on].get("griddepcontrol.launch_dependents", 0) >= 1, res
    assert not any(op.startswith("griddepcontrol") for op in res["False"]), res
    assert ("prefetch" in res) == (name in ("w12_mma", "w12_gemv"))
    if "prefetch" in order:  # before the wait: global loads (the first K step's weight words), no global store or
        ops = order["prefetch"]  # atomic (shared-memory traffic is the program's own); the signal after the wait
        wait = ops.index("griddepcontrol.wait")
        assert any(op.startswith("ld.global") for op in ops[:wait]), ops
        assert not any(op.startswith(("st.global", "atom", "red")) for op in ops[:wait]), ops
        assert ops.index("griddepcontrol.launch_dependents") > wait, ops


@pytest.mark.parametrize("m,over", [(1, dict(gemv=True, lines=False)), (3, dict(gemv=True, split_k=2, block_k=64)),
                                    (1, dict(gemv=True, lines=False, split_k=3, block_k=128)),
                                    (5, dict(gemv=False, block_n=32, block_k=64, split_k=3)),
                                    (17, dict(gemv=False, block_n=16, block_k=64, split_k=2, fused_split=False)),
                                    (40, dict(gemv=False, block_n=16, block_k=128))])
def test_w12_prefetch_path_is_bitwise_the_plain_path(monkeypatch, m, over):
    """The W12 kernels' PREFETCH path (first K step's weight words loaded before the PDL wait, the rest in the loop)
    performs the same operations in the same order as the plain loop: bitwise equal outputs, with split K (ragged
    last split included) and several row counts. Run with PDL itself off (the interpreter has no griddepcontrol);
    the GPU test below runs it with PDL on."""
    from specpilot.w12.gemm import w12_gemm, w12_gemm_reference
    from specpilot.w12.format import encode

    from .tritonutil import DEV

    g = torch.Generator().manual_seed(m * 7 + len(over))
    n, k = 200, 700
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    w[3, 5] = 0.0  # an escape
    t = encode(w, device=DEV)
    x = torch.randn(m, k, generator=g).to(DEV, torch.bfloat16 if DEV == "cuda" else torch.float32)
    plain = w12_gemm(x, t, **over)
    monkeypatch.setattr(pdl, "w12_launch_kw", lambda device: {"PDL": False, "PREFETCH": True})
    pre = w12_gemm(x, t, **over)
    assert torch.equal(plain, pre)
    tol = 2e-2 if x.dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(pre.float(), w12_gemm_reference(x, t).float(), rtol=tol, atol=tol)  # and both are the product


def test_w12_style_is_checked(monkeypatch):
    monkeypatch.setattr(pdl, "W12_STYLE", "early")
    with pytest.raises(ValueError, match="SPECPILOT_PDL_W12"):
        pdl.w12_launch_kw(torch.device("cpu"))
    monkeypatch.setattr(pdl, "W12_STYLE", "prefetch")
    assert pdl.w12_launch_kw(torch.device("cpu")) == {"PDL": False, "PREFETCH": False}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pdl_launches_give_the_same_outputs_and_tokens(monkeypatch):
    from specpilot.config import SystemConfig
    from specpilot.engine.deployment import Deployment
    from specpilot.w12.gemm import w12_gemm
    from specpilot.w12.format import encode
    from specpilot.zoo import bundled_target_dir

    torch.manual_seed(0)
    w = (torch.randn(4096, 12288, device="cuda") * 0.02).to(torch.bfloat16)
    t = encode(w, device="cuda")
    xs = [torch.randn(m, 12288, device="cuda", dtype=torch.bfloat16) for m in (1, 8, 32)]
    outs = {}
    for flag, style in ((False, "prefetch"), (True, "prefetch"), (True, "start")):
        monkeypatch.setattr(pdl, "ENABLED", flag)
        monkeypatch.setattr(pdl, "W12_STYLE", style)
        outs[flag, style] = [w12_gemm(x, t) for x in xs for _ in range(3)]
        dep = Deployment(bundled_target_dir(), None, dtype="bfloat16", device="cuda")
        eng = dep.system(SystemConfig.ar(dtype="bfloat16"))  # bucket graphs captured with or without PDL
        outs[flag, style].append(torch.tensor(eng.generate(list(range(300, 340)), 48).tokens))
        w12 = dep.system(SystemConfig.ar(dtype="bfloat16", w12=True))  # the W12 kernels inside the bucket graphs
        outs[flag, style].append(torch.tensor(w12.generate(list(range(300, 340)), 48).tokens))
        spec = dep.system(SystemConfig(drafter="ngram", tree="best_first", nodes=8, depth=8, top_k=2, dtype="bfloat16"))
        outs[flag, style].append(torch.tensor(spec.generate(list(range(300, 340)) * 2, 48).tokens))
    assert pdl.on(torch.device("cuda")) == (torch.cuda.get_device_capability() >= (9, 0))
    for a, b, c in zip(outs[False, "prefetch"], outs[True, "prefetch"], outs[True, "start"]):
        assert torch.equal(a.cpu(), b.cpu()) and torch.equal(a.cpu(), c.cpu())
