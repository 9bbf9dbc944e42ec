"""The batched pass's CPU attention (query heads grouped per KV head, no per-head copy of K/V) against the plain
repeat-the-keys SDPA and against the batched tree attention's reference, on random trees and real K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specpilot.kernels.batch_attention import batch_tree_attention_reference
from specpilot.model.layers import grouped_sdpa
from specpilot.spec.trees import ancestor_mask_of


def repeat_sdpa(q, keys, vals, mask):
    """The plain form: every KV head copied to its query heads, ``q [B, R, H, D]`` -> ``[B, R, H, D]``."""
    g = q.shape[2] // keys.shape[2]
    k = keys.transpose(1, 2).repeat_interleave(g, dim=1)
    v = vals.transpose(1, 2).repeat_interleave(g, dim=1)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None]).transpose(1, 2)


@pytest.mark.parametrize("kvh,g", [(1, 1), (3, 3), (2, 4)])
@pytest.mark.parametrize("seed", range(3))
def test_grouped_equals_repeated_keys(kvh, g, seed):
    gen = torch.Generator().manual_seed(seed)
    b, r, s, d = 3, 5, 23, 16
    q = torch.randn(b, r, kvh * g, d, generator=gen)
    keys, vals = torch.randn(b, s, kvh, d, generator=gen), torch.randn(b, s, kvh, d, generator=gen)
    mask = torch.rand(b, r, s, generator=gen) > 0.4
    mask[:, :, 0] = True  # every row sees a key (as the batched pass's padding rows do)
    torch.testing.assert_close(grouped_sdpa(q, keys, vals, mask), repeat_sdpa(q, keys, vals, mask), atol=1e-6,
                               rtol=1e-6)


def test_models_batched_attention_equals_the_reference(tiny_models):
    """Attention.forward_batch (grouped) on a real layer: its output equals the batched tree attention reference
    through o_proj, for two requests with trees over prefixes in their own pool slots."""
    from specpilot.model.batch import BatchRows
    from specpilot.model.cache import KVPool

    m = tiny_models[0]
    a = m.args
    pool = KVPool(a, 3, 40, m.dtype, "cpu")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 64, (n,), generator=gen) for n in (7, 4)]
    m.forward_batch(torch.cat(prompts), torch.cat([torch.arange(7), torch.arange(4)]), pool,
                    BatchRows([2, 0], [0, 0], [7, 4], [None, None]))
    masks = [ancestor_mask_of([-1, 0, 0, 1]), None]
    rows = BatchRows([2, 0], [7, 4], [4, 2], masks)
    p = rows.prepared("cpu")
    layer = m.model.layers[0].self_attn
    x = torch.randn(6, a.hidden_size, generator=gen)
    pos = torch.tensor([7, 8, 8, 9, 4, 5])
    _, cos, sin = m._embed(torch.zeros(6, dtype=torch.long), pos, None)
    with torch.no_grad():
        out = layer.forward_batch(x, cos, sin, pool, 0, p)
        q, _, _ = layer._qkv(x, cos, sin, None)
    own = torch.zeros(2, 4, 4, dtype=torch.bool)
    own[0] = masks[0]
    own[1, :2, :2] = torch.ones(2, 2, dtype=torch.bool).tril()
    own[1, 2:, 2:] = torch.eye(2, dtype=torch.bool)
    ref = batch_tree_attention_reference(q, pool.k[:, 0], pool.v[:, 0], [2, 0], [7, 4], [4, 2], [0, 4], own,
                                         a.head_dim ** -0.5)
    with torch.no_grad():
        want = layer.o_proj(ref.reshape(6, a.n_heads * a.head_dim))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("counts", [(1, 1, 1, 1), (3, 3), (1, 4, 2), (5,)])
@pytest.mark.parametrize("layout", ["ascending", "reversed", "holes", "spread"])
def test_batch_sdpa_equals_grouped_on_padded_rows(counts, layout):
    """batch_sdpa (rows placed by one index_copy_, the grouped mask built once per pass) returns exactly what
    grouped_sdpa returns on the rows padded by advanced indexing over keys gathered per request, for dense (an AR step
    over consecutive slots) and ragged batches, for q a row-strided view (as the fused projection's RoPE hands it
    over), and for every slot layout: consecutive slots ascending or reversed and slots with holes between them read
    the pool's slice (``p.window``: a view, the holes padding), slots spread wider than twice the requests are
    gathered."""
    from specpilot.model.batch import BatchRows
    from specpilot.model.layers import batch_sdpa

    gen = torch.Generator().manual_seed(sum(counts))
    kvh, g, d, b = 3, 3, 16, len(counts)
    slots = {"ascending": [2 + i for i in range(b)], "reversed": [2 + i for i in range(b)][::-1],
             "holes": [1 + 2 * i for i in range(b)], "spread": [3 * i for i in range(b)]}[layout]
    starts = [6 + 2 * i for i in range(b)]
    masks = [ancestor_mask_of([-1] + list(range(c - 1))) if c % 2 else None for c in counts]
    p = BatchRows(slots, starts, list(counts), masks).prepared("cpu")
    windowed = max(slots) + 1 - min(slots) <= 2 * b
    assert (p.window is not None) == windowed
    assert p.dense == (len(set(counts)) == 1 and (layout == "ascending" or b == 1 or not windowed))
    r = sum(counts)
    wide = torch.randn(r, kvh * g + 5, d, generator=gen)
    q = wide[:, 2:2 + kvh * g]  # a view: rows strided
    pool_k = torch.randn(3 * b + 2, p.span + 3, kvh, d, generator=gen)[:, : p.span]
    pool_v = torch.randn(3 * b + 2, p.span + 3, kvh, d, generator=gen)[:, : p.span]
    lo, w = p.window if windowed else (0, b)
    place = torch.tensor(slots) - lo if windowed else torch.arange(b)
    keys, vals = (pool_k[lo:lo + w], pool_v[lo:lo + w]) if windowed else (pool_k[slots], pool_v[slots])
    qp = q.new_zeros(w, p.r_max, kvh * g, d)
    qp[place[p.req], p.j] = q
    want = grouped_sdpa(qp, keys, vals, p.sdpa_mask())[place[p.req], p.j]  # the same layout: equal bit for bit
    assert torch.equal(batch_sdpa(q, keys, vals, p), want)
    assert torch.equal(batch_sdpa(q.contiguous(), keys, vals, p), want)
    # request order, keys gathered: the same math (the CPU's SDPA rounds per batch element by what the others' masks
    # hold, so bits may differ, ~6e-8)
    qr = q.new_zeros(b, p.r_max, kvh * g, d)
    qr[p.req, p.j] = q
    torch.testing.assert_close(want, grouped_sdpa(qr, pool_k[slots], pool_v[slots], p.mask)[p.req, p.j],
                               atol=1e-6, rtol=1e-6)


def test_fused_rope_equals_rotating_q_and_k_apart(tiny_models):
    """With the fused projection and no q/k norm (a Llama's attention), RoPE over q's and k's heads at once equals
    rotating q and k apart, bit for bit."""
    import dataclasses

    from specpilot.model.layers import Attention, apply_rope

    m = tiny_models[0]
    a = dataclasses.replace(m.args, qk_norm=False)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        layer = Attention(a)
    layer.fuse()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, a.hidden_size, generator=gen)
    _, cos, sin = m._embed(torch.zeros(5, dtype=torch.long), torch.arange(3, 8), None)
    with torch.no_grad():
        q, k, v = layer._qkv(x, cos, sin, None)
        qr, kr, vr = layer.qkv_proj(x).split(layer.qkv_split, dim=-1)
    assert torch.equal(q, apply_rope(qr.reshape(5, a.n_heads, a.head_dim), cos, sin))
    assert torch.equal(k, apply_rope(kr.reshape(5, a.n_kv_heads, a.head_dim), cos, sin))
    assert torch.equal(v, vr.reshape(5, a.n_kv_heads, a.head_dim))
