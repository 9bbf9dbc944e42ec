"""bfloat16 launches of the kernels for tests/kernel_launches.py's compile check, recorded but not run.

The GPU runs the model in bfloat16; the interpreter cannot (numpy has no bfloat16), so the kernel tests launch float32
on the CPU and their bfloat16 cases run on CUDA only. Here the public wrappers are called as those bfloat16 cases
call them (the same shapes and launch overrides, each test module's own case lists) and at the Qwen3-8B attention
and projection shapes, under :func:`~specpilot.kernels.launches.launches_not_run`: each launch is recorded for the
offline compile and not run (outputs are left unwritten, nothing is asserted). Not a test module (its name does not
match ``test_*.py``); ``kernel_launches.check`` passes it to pytest explicitly, and without the recording plugin every
case skips."""

from __future__ import annotations

import pytest
import torch

from .tritonutil import triton  # noqa: F401  (the interpreter; its launches are recorded, not run)

from specpilot.kernels import fused, gemm  # noqa: E402
from specpilot.kernels import tree_attention as ta  # noqa: E402
from specpilot.kernels.batch_attention import batch_tree_attention, pack_batch_masks  # noqa: E402
from specpilot.kernels.hybrid_glue import gated_rmsnorm, zc_rmsnorm  # noqa: E402
from specpilot.kernels.launches import launches_not_run, recording  # noqa: E402
from specpilot.w12.format import encode  # noqa: E402
from specpilot.w12.gemm import w12_gemm  # noqa: E402
from specpilot.w12.norm import w12_add_residual, w12_norm_in  # noqa: E402
from specpilot.w12.swiglu import w12_swiglu_down  # noqa: E402
from specpilot.w12.view import w12_view_gemm  # noqa: E402

pytestmark = pytest.mark.skipif(not recording(), reason="bfloat16 launches are only recorded for the compile check")

BF16 = torch.bfloat16


def _bf16(*shape):
    return torch.randn(*shape).to(BF16)


def test_tree_attention_cases_and_qwen3_8b():
    from .test_tree_attention import CASES, random_case

    gen = torch.Generator().manual_seed(0)
    shapes = [(r, h, kvh, d, s, p, kw) for r, h, kvh, d, s, p, _, kw in CASES]
    shapes += [(r, 32, 8, 128, 4096, 1000, {}) for r in (1, 17, 33, 64)]  # Qwen3-8B heads, default config
    with launches_not_run():
        for r, h, kvh, d, s, prefix, kw in shapes:
            q, k, v, mask = random_case(gen, r, h, kvh, d, s, prefix, BF16)
            ta.tree_attention(q, k, v, torch.tensor(prefix), mask, d ** -0.5, **kw)


def test_batch_attention_cases_and_qwen3_8b():
    from .test_batch_attention import random_batch

    i32 = lambda t: t.to(torch.int32)  # noqa: E731
    with launches_not_run():
        for seed, (g, d, kvh, block_n) in enumerate([(1, 16, 2, 32), (4, 32, 2, 32), (4, 128, 8, 64), (4, 128, 8, 16)]):
            gen = torch.Generator().manual_seed(seed)
            q, k, v, slots, starts, counts, row_off, masks, r_max = random_batch(gen, 3, 4, 64, kvh, g, d, BF16)
            batch_tree_attention(q, k, v, i32(slots), i32(starts), i32(counts), i32(row_off), pack_batch_masks(masks),
                                 r_max, d ** -0.5, block_n=block_n)


def test_fused_cases_and_qwen3_8b():
    with launches_not_run():
        for rows, d, delta in [(1, 64, True), (3, 96, True), (5, 128, False), (1, 4096, True), (17, 4096, False)]:
            fused.add_rmsnorm(_bf16(rows, d), _bf16(rows, d) if delta else None, _bf16(d), 1e-6)
        for rows, h, kvh, d, norm in [(1, 4, 2, 16, True), (3, 8, 2, 32, True), (2, 4, 4, 16, False),
                                      (1, 32, 8, 128, True), (33, 32, 8, 128, True)]:
            qkv, w = _bf16(rows, (h + 2 * kvh) * d), (_bf16(d) if norm else None)
            cos, sin, kc, vc = _bf16(rows, d), _bf16(rows, d), _bf16(64, kvh, d), _bf16(64, kvh, d)
            fused.qk_norm_rope_store(qkv, w, w, cos, sin, kc, vc, torch.tensor(3), h, kvh, 1e-6)
            pool_k, pool_v = _bf16(4, 3, 64, kvh, d), _bf16(4, 3, 64, kvh, d)
            dest = (torch.zeros(rows, dtype=torch.long), torch.arange(rows))
            fused.qk_norm_rope_store(qkv, w, w, cos, sin, pool_k[:, 1], pool_v[:, 1], None, h, kvh, 1e-6, rows=dest)
        for rows, i in [(1, 48), (4, 1500), (1, 12288), (17, 12288)]:
            fused.silu_mul(_bf16(rows, 2 * i))


def test_gemm_cases_and_qwen3_8b():
    from .test_gemm import CASES

    with launches_not_run():
        for m, n, k, over in CASES + [(m, 4096, 4096, {}) for m in (1, 8, 17, 33, 64)]:
            for bias in (None, _bf16(n)):
                gemm.skinny_gemm(_bf16(m, k), _bf16(n, k), bias, **over)
        for m, n, k in [(5, 96, 300), (17, 64, 1024), (33, 4096, 4096)]:
            gemm.invariant_gemm(_bf16(m, k), _bf16(n, k), _bf16(n))


def test_hybrid_glue_cases():
    from .test_hybrid_glue import TREES, gdn_layer, premix_inputs, run_premix

    with launches_not_run():
        for heads in [(2, 4, 16, 32, 4), (2, 2, 32, 16, 2), (1, 4, 16, 16, 3)]:
            layer = gdn_layer(*heads, dtype=BF16)
            _, mixed, z, b, a, window, idx = premix_inputs(layer, TREES["tree"], torch.Generator().manual_seed(0))
            run_premix(layer, mixed, window, idx, b, a)
            gated_rmsnorm(torch.randn(8, layer.hv, layer.dv), z, layer.norm.weight, 1e-6)
        for d, add in [(64, False), (96, True), (5120, True)]:
            zc_rmsnorm(_bf16(5, d), _bf16(5, d) if add else None, _bf16(d), 1e-6)


def test_w12_cases_and_qwen3_8b():
    from .test_w12_gemm import CASES, planted_weight
    from .test_w12_view_gemm import CASES as VIEW_CASES

    weights = {}

    def w12(n, k):
        if (n, k) not in weights:
            weights[n, k] = encode(planted_weight(n, k, seed=n + k))
        return weights[n, k]

    with launches_not_run():
        for m, n, k, over in CASES + [(m, 1024, 4096, {}) for m in (1, 2, 4, 8, 16, 33, 64)]:
            w12_gemm(_bf16(m, k), w12(n, k), _bf16(n) if m % 2 else None, **over)
        for m, n, k, over in VIEW_CASES:
            w12_view_gemm(_bf16(m, k), w12(n, k), None, **over)


def test_w12_one_row_fusions(monkeypatch):
    """The fusions refuse bfloat16 off CUDA (the interpreter cannot run it): their input checks see a float32 copy
    of the row here, every other condition as it is."""
    from specpilot.w12 import norm, swiglu

    from .test_w12_norm import LAUNCHES
    from .test_w12_swiglu import w12_layer

    why_not = swiglu._why_not
    for mod in (norm, swiglu):
        monkeypatch.setattr(mod, "_why_not", lambda x, layer, glu=True: why_not(x.float(), layer, glu))
    with launches_not_run():
        for n, k, over in LAUNCHES + [(130, 640, dict(block_n=32, block_k=128, split_k=5))]:
            layer, _ = w12_layer(n, k, seed=n + k, bias=True)
            layer.bias = layer.bias.to(BF16)
            w12_swiglu_down(_bf16(1, 2 * k), layer, **over)
            if over.get("block_n", 16) != 16:  # the residual add and the norm run in 16-column tiles
                continue
            for glu in (False, True):
                w12_add_residual(_bf16(1, 2 * k if glu else k), layer, _bf16(1, n), glu, **over)
            tile = -(-k // 16)
            w12_norm_in(_bf16(1, k), torch.rand(tile), _bf16(k), 1e-6, layer, **over)
