"""CUDA graphs per row bucket on a GPU (issue 4): every bucket a system can use is captured when it is built, so a
timed request never captures (a first-met bucket used to be captured mid-request, inside the controller's
timer); graphs captured at build on dummy inputs replay the same tokens as graphs captured mid-request on
the real ones. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.engine.runner import BUCKETS
from specpilot.zoo import bundled_drafter_dir, bundled_target_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("cfg", [SystemConfig.stock("ngram"),
                                 SystemConfig(drafter="draft_model", tree="best_first", nodes=16, depth=5, top_k=3),
                                 SystemConfig(drafter="ngram", tree="best_first", nodes=16, depth=5, top_k=3, w12=True)],
                         ids=["ngram", "draft_model_tree", "w12_ngram_tree"])  # w12: GEMV, word kernel, dense path in graphs
def test_all_buckets_captured_at_build_and_none_later(cfg):
    dep = Deployment(bundled_target_dir(), bundled_drafter_dir(), dtype="float32", device="cuda")
    eng = dep.system(cfg)
    runners = [eng.runner] + ([eng.drafter.runner] if cfg.drafter == "draft_model" else [])
    assert all(sorted(r._graphs) == list(BUCKETS) for r in runners)  # verify / catch-up / prefill chunks
    graphs = [dict(r._graphs) for r in runners]
    lazy = dep.system(cfg)
    for r in [lazy.runner] + ([lazy.drafter.runner] if cfg.drafter == "draft_model" else []):
        r.drop_graphs()  # as before: each bucket captured when a request first meets it
    for prompt in ([5, 17, 300, 42, 9] * 8, [7] * 3, [11, 400, 23] * 100):  # the last: two prefill chunks
        assert eng.generate(prompt, 40).tokens == lazy.generate(prompt, 40).tokens
    assert [dict(r._graphs) for r in runners] == graphs  # the same graph objects: nothing captured since


def _kernel_names(fn) -> set[str]:
    """Names of the CUDA kernels ``fn()`` launches (PyTorch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("gemv,lines", [(False, False), (True, True), (True, False)],
                         ids=["tensor_core_8_rows", "gemv_1_row", "gemv_1_row_groups"])
def test_w12_split_k_sum_stays_in_the_kernel_inside_graphs(gemv, lines):
    """``reserve_split_locks`` before a capture gives the capture stream its split-K counters, so a captured W12
    launch with split K sums in the kernel (no ``_w12_split_sum_kernel``) and equals the eager call bitwise; a
    capture on a stream without counters falls back to the two-kernel sum (same bits). The engine's bucket
    graphs reserve them: the bundled target's down projection (K 768) runs split K 2 at 8 rows. Replayed twice: the
    counters reset themselves (one row of Qwen3-8B qkv / o runs the GEMV with split K by default)."""
    from specpilot.w12 import epilogue as wg
    from specpilot.w12.gemm import escape_table, reserve_split_locks, w12_gemm
    from specpilot.w12.format import encode

    torch.manual_seed(0)
    t = encode((torch.randn(256, 768, device="cuda") * 0.05).to(torch.bfloat16), device="cuda")
    x = torch.randn(1 if gemv else 8, 768, device="cuda", dtype=torch.bfloat16)
    esc = escape_table(t)  # computed outside the capture (it reads the escape list on the host)
    kernel = ("_w12_gemv_lines_kernel" if lines else "_w12_gemv_kernel") if gemv else "_w12_mma_kernel"
    over = dict(split_k=2, gemv=gemv) | (dict(lines=lines) if gemv else {})
    eager = w12_gemm(x, t, escapes=esc, **over)
    held = {}
    for reserve in (True, False):
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        wg._LOCKS.pop((x.device, stream.cuda_stream), None)  # PyTorch recycles pool streams: forget earlier counters
        capture = torch.cuda.graph(g, stream=stream)
        if reserve:
            reserve_split_locks(x.device, capture.capture_stream)
        with capture:
            held[reserve] = w12_gemm(x, t, escapes=esc, **over)
        names = _kernel_names(g.replay)
        assert any(kernel in n for n in names), names
        assert any("_w12_split_sum_kernel" in n for n in names) == (not reserve), names
        assert torch.equal(held[reserve], eager)
        held[reserve].zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(held[reserve], eager)
    if gemv:
        return

    dep = Deployment(bundled_target_dir(), None, dtype="bfloat16", device="cuda")
    eng = dep.system(SystemConfig(drafter="ngram", tree="best_first", nodes=8, depth=8, top_k=2, dtype="bfloat16",
                                  w12=True))
    names = _kernel_names(eng.runner._graphs[8].replay)
    assert any("_w12_mma_kernel" in n for n in names) and not any("_w12_split_sum_kernel" in n for n in names), names


@pytest.mark.parametrize("drafter_dir", ["block", "block_markov"])
def test_block_drafter_graphed_equals_eager_and_ar(drafter_dir):
    """The bundled block drafters with their step as a CUDA graph and the target features captured in the exact
    pass's graph (float32): the same tokens as the eager drafter and as AR, prompts past one prefill chunk too."""
    from specpilot.zoo import bundled_block_dir, bundled_block_markov_dir

    path = bundled_block_dir() if drafter_dir == "block" else bundled_block_markov_dir()
    dep = Deployment(bundled_target_dir(), path, dtype="float32", device="cuda")
    cfg = SystemConfig(drafter="block", tree="best_first", nodes=16, depth=6, top_k=4)
    graphed, eager, ar = dep.system(cfg), dep.system(cfg, buckets=False), dep.system(SystemConfig.ar())
    assert graphed.drafter._step is not None and graphed.drafter._step.graphs
    assert eager.drafter._step is None
    accepted = []
    for prompt in ([5, 17, 300, 42, 9] * 8, [7] * 3, [11, 400, 23] * 100):
        g, e = graphed.generate(prompt, 40), eager.generate(prompt, 40)
        assert g.tokens == e.tokens == ar.generate(prompt, 40).tokens
        accepted += g.accepted
    assert max(accepted) > 1


@pytest.mark.parametrize("drafter,weights", [("draft_model", "view8"), ("block", "view8"), ("draft_model", "int8")])
def test_tlv_graphed_equals_eager_and_ar(drafter, weights):
    """TLV with both passes through the row-bucket graphs (the Q pass's rows in scratch slots) on the bundled pair in
    float32: the eager cycle's tokens, chains and acceptance, and AR's tokens. view8 on a float32 target encodes its
    bf16 rounding and runs the 8-bit-view kernel (the W12 mechanism needs bf16 activations here only for speed)."""
    from specpilot.zoo import bundled_block_dir

    dep = Deployment(bundled_target_dir(), bundled_block_dir() if drafter == "block" else bundled_drafter_dir(),
                     dtype="float32", device="cuda")
    cfg = SystemConfig(drafter=drafter, tree="best_first", nodes=16, depth=6, top_k=4, tlv=True, q_weights=weights)
    graphed, eager, ar = dep.system(cfg), dep.system(cfg, buckets=False), dep.system(SystemConfig.ar())
    assert graphed.tlv.runner is not None and graphed.tlv.runner.graphs and eager.tlv.runner is None
    for prompt in ([5, 17, 300, 42, 9] * 8, [11, 400, 23] * 100):
        g, e = graphed.generate(prompt, 40), eager.generate(prompt, 40)
        assert g.tokens == e.tokens == ar.generate(prompt, 40).tokens
        assert sum(g.chains) > 0
