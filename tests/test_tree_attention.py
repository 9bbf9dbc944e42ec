"""Tree attention: the Triton kernel against the PyTorch reference, the reference against SDPA.

Without CUDA the kernel runs in Triton's interpreter on the CPU: TRITON_INTERPRET=1 must be set before
triton is first imported (triton.language's own helpers are decorated then), so tests/conftest.py sets it
when there is no CUDA. With CUDA the same tests run compiled on the GPU. bf16 is GPU-only (numpy, under the interpreter, has none).
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from .tritonutil import CUDA, DEV, triton  # noqa: F401  (sets up the interpreter on the CPU)

from specpilot.spec.trees import ancestor_mask_of  # noqa: E402

ta = importlib.import_module("specpilot.kernels.tree_attention")


def tree_mask_from_parents(parents: list[int], n_pad: int = 0) -> torch.Tensor:
    """``[R + n_pad, R + n_pad]`` bool ancestor-or-self mask; padded rows see only themselves."""
    return ancestor_mask_of(list(parents) + [-1] * n_pad)


def random_case(gen, r, h, kvh, d, s, prefix, dtype, n_pad=0):
    """Random q and cache (slots >= prefix + R filled with NaN: never read) and a random tree mask."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, r - n_pad)]
    mask = tree_mask_from_parents(parents, n_pad)
    q = torch.randn(r, h, d, generator=gen).to(dtype)
    k = torch.randn(s, kvh, d, generator=gen).to(dtype)
    v = torch.randn(s, kvh, d, generator=gen).to(dtype)
    k[prefix + r:] = float("nan")
    v[prefix + r:] = float("nan")
    return q.to(DEV), k.to(DEV), v.to(DEV), mask.to(DEV)


# (R, H, KVH, D, S, prefix, dtype, kernel overrides); BLOCK_N 16 makes short prefixes span several blocks
CASES = [
    (1, 4, 1, 16, 64, 0, torch.float32, {}),
    (1, 8, 2, 16, 128, 77, torch.float32, dict(block_n=16)),
    (1, 8, 2, 16, 128, 77, torch.float32, dict(block_n=16, num_splits=3)),
    (3, 4, 4, 16, 64, 33, torch.float32, dict(block_n=16)),
    (3, 8, 4, 64, 64, 16, torch.float32, dict(block_n=16, num_splits=2)),
    (8, 4, 2, 16, 128, 50, torch.float32, dict(block_n=16, block_m=16)),
    (8, 8, 1, 16, 128, 120, torch.float32, dict(block_n=32, num_splits=4)),
    (8, 8, 2, 64, 96, 0, torch.float32, dict(block_n=16, num_splits=2)),
    (3, 8, 2, 64, 128, 45, torch.float16, dict(block_n=16)),
    (8, 4, 1, 64, 128, 61, torch.float16, dict(block_n=16, num_splits=3)),
    (40, 4, 2, 16, 128, 29, torch.float32, dict(block_n=16, num_splits=2)),  # tree spans two mask words
]


@pytest.mark.parametrize("r,h,kvh,d,s,prefix,dtype,kw", CASES)
def test_kernel_matches_reference(r, h, kvh, d, s, prefix, dtype, kw):
    gen = torch.Generator().manual_seed(1000 * r + 10 * h + prefix)
    q, k, v, mask = random_case(gen, r, h, kvh, d, s, prefix, dtype)
    scale = d ** -0.5
    ref = ta.tree_attention_reference(q, k, v, prefix, mask, scale)
    plen = torch.tensor(prefix, dtype=torch.int32 if prefix % 2 else torch.int64, device=DEV)
    out = ta.tree_attention(q, k, v, plen, mask, scale, **kw)
    assert out.dtype == dtype and out.shape == q.shape
    assert not out.isnan().any()
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    again = ta.tree_attention(q, k, v, plen, mask, scale, **kw)
    assert torch.equal(out, again)  # deterministic: fixed-order reduction, no atomics


def test_random_sweep():
    """Random shapes, prefixes, block sizes and splits (trees spanning several KV blocks included)."""
    gen = torch.Generator().manual_seed(2024)
    pick = lambda xs: xs[int(torch.randint(0, len(xs), (1,), generator=gen))]  # noqa: E731
    for _ in range(16):
        r, h, d, dtype = pick([1, 3, 8, 40]), pick([4, 8]), pick([16, 64]), pick([torch.float32, torch.float16])
        kvh = pick([k for k in (1, 2, 4) if h % k == 0])
        s = 128
        prefix = int(torch.randint(0, s - r + 1, (1,), generator=gen))
        kw = dict(block_m=pick([16, 32, 64]), block_n=pick([16, 32, 64]), num_splits=pick([1, 2, 3, 5]))
        q, k, v, mask = random_case(gen, r, h, kvh, d, s, prefix, dtype)
        plen = torch.tensor(prefix, device=DEV)
        out = ta.tree_attention(q, k, v, plen, mask, d ** -0.5, **kw)
        ref = ta.tree_attention_reference(q, k, v, prefix, mask, d ** -0.5)
        tol = 2e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol,
                                   msg=lambda m: f"{(r, h, kvh, d, prefix, dtype, kw)}: {m}")
        assert torch.equal(out, ta.tree_attention(q, k, v, plen, mask, d ** -0.5, **kw))


def test_split_and_prefix_change_without_new_shapes():
    """Same tensors and launch, only the device-side prefix length changes (as under CUDA graph replay)."""
    gen = torch.Generator().manual_seed(7)
    r, h, kvh, d, s = 3, 8, 2, 16, 128
    q, k, v, mask = random_case(gen, r, h, kvh, d, s, 125 - r, torch.float32)
    plen = torch.zeros((), dtype=torch.int64, device=DEV)
    for prefix in (0, 5, 64, 100):
        plen.fill_(prefix)
        out = ta.tree_attention(q, k[: s], v[: s], plen, mask, 0.25, block_n=16, num_splits=4)
        # the rows' K/V sit at [prefix, prefix + R): build the reference from the same cache
        ref = ta.tree_attention_reference(q, k, v, prefix, mask, 0.25)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_pack_tree_mask():
    gen = torch.Generator().manual_seed(5)
    for r in (1, 31, 32, 33, 70, 256):
        mask = torch.rand(r, r, generator=gen) < 0.5
        words = ta.pack_tree_mask(mask)
        assert words.dtype == torch.int32 and words.shape == (r, (r + 31) // 32)
        bits = (words[:, :, None].long() >> torch.arange(32)) & 1  # bit 31 included (negative words)
        assert torch.equal(bits.view(r, -1)[:, :r].bool(), mask)
    q, k, v, mask = random_case(gen, 40, 4, 2, 16, 128, 9, torch.float32)
    plen = torch.tensor(9, device=DEV)
    a = ta.tree_attention(q, k, v, plen, mask, 0.25, block_n=16)
    assert torch.equal(a, ta.tree_attention(q, k, v, plen, ta.pack_tree_mask(mask), 0.25, block_n=16))


def test_padded_rows_no_nan():
    """Padding rows (mask: only themselves, or nothing at all) give finite output; at L = 0 with no
    allowed slot the row is zeros in both implementations."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, mask = random_case(gen, 8, 4, 2, 16, 64, 0, torch.float32, n_pad=3)
    mask[-1, -1] = False  # a row that may attend nothing
    plen = torch.zeros((), dtype=torch.int32, device=DEV)
    out = ta.tree_attention(q, k, v, plen, mask, 0.25, block_n=16)
    ref = ta.tree_attention_reference(q, k, v, 0, mask, 0.25)
    assert torch.isfinite(out).all() and torch.isfinite(ref).all()
    assert (out[-1] == 0).all() and (ref[-1] == 0).all()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("r,h,kvh,prefix", [(1, 4, 2, 0), (3, 8, 2, 17), (8, 8, 8, 40), (8, 4, 1, 9)])
def test_reference_equals_sdpa(r, h, kvh, prefix):
    gen = torch.Generator().manual_seed(r + prefix)
    q, k, v, mask = random_case(gen, r, h, kvh, 16, 64, prefix, torch.float32)
    q, k, v, mask = q.cpu(), k.cpu(), v.cpu(), mask.cpu()
    n = prefix + r
    full = torch.cat([torch.ones(r, prefix, dtype=torch.bool), mask], dim=1)  # [R, L + R]
    g = h // kvh
    keys = k[:n].transpose(0, 1).repeat_interleave(g, dim=0)[None]
    vals = v[:n].transpose(0, 1).repeat_interleave(g, dim=0)[None]
    sdpa = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, vals, attn_mask=full, scale=0.3)
    ref = ta.tree_attention_reference(q, k, v, torch.tensor(prefix), mask, 0.3)
    torch.testing.assert_close(ref, sdpa[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_errors_and_dispatch():
    q = torch.randn(2, 6, 16)
    k = torch.randn(32, 4, 16)
    m = torch.ones(2, 2, dtype=torch.bool).tril()
    with pytest.raises(ValueError):
        ta.tree_attention_reference(q, k, k, 3, m, 0.25)  # 6 % 4 != 0
    q, k = torch.randn(2, 4, 80), torch.randn(32, 2, 80)
    with pytest.raises(ValueError):
        ta.tree_attention(q, k, k, torch.tensor(3), m, 0.1)  # head_dim 80
    with pytest.raises(ValueError):
        ta.tree_attention_reference(q, k, k, 3, m[:1], 0.1)  # mask shape
    with pytest.raises(ValueError):
        ta.tree_attention_reference(q, k, k, 31, m, 0.1)  # L + R > S
    # dispatch on the CPU is the reference (an unsupported head_dim on CUDA also falls back)
    assert torch.equal(ta.attention(q, k, k, 3, m, 0.1), ta.tree_attention_reference(q, k, k, 3, m, 0.1))


def test_default_config():
    # Qwen3-8B shapes (H=32, KVH=8, D=128), a 4096-slot cache
    small = ta.default_config(1, 4, 8, 4096, 128)
    assert small["num_splits"] > 1 and small["block_m"] == 16
    big = ta.default_config(256, 4, 8, 4096, 128)
    assert big["num_splits"] == 1 and big["block_m"] == 64
    assert ta.default_config(1, 4, 8, 64, 128)["num_splits"] == 1  # tiny cache: nothing to split


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("r", [1, 8, 33, 256])
@pytest.mark.parametrize("prefix", [0, 511, 2048])
def test_bf16_cuda_qwen_shapes(r, prefix):
    gen = torch.Generator().manual_seed(r)
    q, k, v, mask = random_case(gen, r, 32, 8, 128, 4096, prefix, torch.bfloat16)
    out = ta.tree_attention(q, k, v, torch.tensor(prefix, device=DEV), mask, 128 ** -0.5)
    ref = ta.tree_attention_reference(q, k, v, prefix, mask, 128 ** -0.5)
    assert (out.float() - ref.float()).abs().max().item() < 2e-2
    assert torch.equal(out, ta.tree_attention(q, k, v, torch.tensor(prefix, device=DEV), mask, 128 ** -0.5))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_graph_replay_any_prefix():
    gen = torch.Generator().manual_seed(0)
    r, s = 16, 2048
    q, k, v, mask = random_case(gen, r, 32, 8, 128, s, s - r, torch.bfloat16)
    plen = torch.tensor(100, device=DEV)
    ta.tree_attention(q, k, v, plen, mask, 0.1)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ta.tree_attention(q, k, v, plen, mask, 0.1)
    for prefix in (0, 100, 700, s - r):
        plen.fill_(prefix)
        graph.replay()
        ref = ta.tree_attention(q, k, v, torch.tensor(prefix, device=DEV), mask, 0.1)
        assert torch.equal(out, ref)


@pytest.mark.parametrize("r,h,kvh,d,splits", [(1, 8, 2, 16, 5), (2, 8, 2, 64, 3), (5, 4, 1, 16, 4)])
def test_combine_unrolled_and_rolled_are_bitwise_equal(monkeypatch, r, h, kvh, d, splits):
    """The split-KV combine's loop over the splits, unrolled (few partials a thread) or not (the host's choice,
    :func:`combine_config`): the same sums in the same order, so bitwise equal outputs."""
    gen = torch.Generator().manual_seed(r * 31 + d)
    q, k, v, mask = random_case(gen, r, h, kvh, d, 128, 70, torch.float32)
    plen = torch.tensor(70, device=DEV)
    monkeypatch.setattr(ta, "COMBINE_UNROLL_PER_THREAD", 1 << 20)
    assert ta.combine_config(r * (h // kvh), 16, d, splits, 4)["unroll"]
    unrolled = ta.tree_attention(q, k, v, plen, mask, 0.3, block_n=16, num_splits=splits)
    monkeypatch.setattr(ta, "COMBINE_UNROLL_PER_THREAD", 0)
    assert not ta.combine_config(r * (h // kvh), 16, d, splits, 4)["unroll"]
    rolled = ta.tree_attention(q, k, v, plen, mask, 0.3, block_n=16, num_splits=splits)
    assert torch.equal(unrolled, rolled)
    torch.testing.assert_close(rolled, ta.tree_attention_reference(q, k, v, 70, mask, 0.3), atol=2e-5, rtol=2e-5)


COMBINE_COMPILE = r"""
import importlib, json
from specpilot.kernels.resources import kernel_resources
ta = importlib.import_module("specpilot.kernels.tree_attention")
sig = {"PartAcc": "*fp32", "PartML": "*fp32", "Out": "*bf16", "R": "i32", "KVH": "i32", "stride_or": "i32",
       "stride_oh": "i32"}
res = []
for r in (1, 2, 4, 8, 16, 33):  # Qwen3-8B: 32 heads, 8 KV heads, head_dim 128, a 4352-slot cache
    cfg = ta.default_config(r, 4, 8, 4352, 128)
    c = ta.combine_config(r * 4, cfg["block_m"], 128, cfg["num_splits"], cfg["num_warps"])
    k = kernel_resources(ta._combine, sig, dict(G=4, HEAD_DIM=128, BLOCK_M=c["block_m"], NUM_SPLITS=cfg["num_splits"],
                                                UNROLL=c["unroll"]), c["num_warps"], 1)
    res.append({"rows": r, **c, "registers": k.registers, "spill_bytes": k.spill_bytes})
print(json.dumps(res))
"""


@pytest.mark.skipif(not __import__("specpilot.kernels.resources", fromlist=["x"]).ptxas_available(),
                    reason="Triton's bundled ptxas is not installed here")
def test_combine_launch_does_not_spill_on_sm90():
    """Compiled for sm_90a (offline ptxas), the combine as :func:`combine_config` launches it for Qwen3-8B at 1–33
    rows spills nothing (unrolled at every row count it spilled 4–45 KB a thread from 2 rows on; rolled with 4 warps,
    40 bytes at 64 x 128); one row is unrolled."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", COMBINE_COMPILE], capture_output=True, text=True, timeout=600, env=env,
                       cwd=Path(__file__).resolve().parents[1])
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert [x["spill_bytes"] for x in res] == [0] * len(res), res
    assert res[0]["unroll"] and res[0]["rows"] == 1, res
