"""Batched tree attention (one launch for every request's rows over its own pool slot) against its reference, and the
reference against the model's batched pass; the Triton interpreter on the CPU, compiled on CUDA."""

from __future__ import annotations

import pytest
import torch

from .tritonutil import CUDA, DEV, triton  # noqa: F401  (sets up the interpreter on the CPU)

from specpilot.kernels.batch_attention import (batch_tree_attention, batch_tree_attention_reference,  # noqa: E402
                                               pack_batch_masks)
from specpilot.spec.trees import ancestor_mask_of  # noqa: E402


def random_batch(gen, b, n_slots, s, kvh, g, d, dtype, r_max=None):
    """Requests in random distinct slots, random prefixes, rows and trees (some causal); pools full of noise
    beyond each request's span (never to be read)."""
    slots = torch.randperm(n_slots, generator=gen)[:b]
    counts = torch.randint(1, 12, (b,), generator=gen)
    r_max = r_max or int(counts.max())
    starts = torch.stack([torch.randint(0, s - int(c), (1,), generator=gen)[0] for c in counts])
    masks = torch.zeros(b, r_max, r_max, dtype=torch.bool)
    for i, c in enumerate(counts.tolist()):
        if i % 3 == 0:
            masks[i, :c, :c] = torch.ones(c, c, dtype=torch.bool).tril()
        else:
            parents = [-1] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, c)]
            masks[i, :c, :c] = ancestor_mask_of(parents)
        masks[i, range(c, r_max), range(c, r_max)] = True
    row_off = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)[:-1]])
    r = int(counts.sum())
    q = torch.randn(r, kvh * g, d, generator=gen).to(dtype)
    k = torch.randn(n_slots, s, kvh, d, generator=gen).to(dtype)
    v = torch.randn(n_slots, s, kvh, d, generator=gen).to(dtype)
    return q, k, v, slots, starts, counts, row_off, masks, r_max


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("g,d", [(1, 16), (4, 32)])
def test_kernel_matches_reference(seed, g, d):
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if CUDA else torch.float32
    q, k, v, slots, starts, counts, row_off, masks, r_max = random_batch(gen, 1 + seed * 2, 9, 80, 2, g, d, dtype)
    scale = d ** -0.5
    ref = batch_tree_attention_reference(q, k, v, slots, starts, counts, row_off, masks, scale)
    i32 = lambda t: t.to(torch.int32).to(DEV)  # noqa: E731
    out = batch_tree_attention(q.to(DEV), k.to(DEV), v.to(DEV), i32(slots), i32(starts), i32(counts), i32(row_off),
                               pack_batch_masks(masks).to(DEV), r_max, scale, block_n=32)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=tol, rtol=tol)
    again = batch_tree_attention(q.to(DEV), k.to(DEV), v.to(DEV), i32(slots), i32(starts), i32(counts), i32(row_off),
                                 pack_batch_masks(masks).to(DEV), r_max, scale, block_n=32)
    assert torch.equal(out, again)  # deterministic


def test_a_grid_wider_than_the_rows_gives_the_same_bits():
    """An engine sized for a plan's largest tree (33 rows a request) running an AR step (one row each): the programs
    past each request's rows walk no keys, and the rows get the same bits as from a grid of one row a request."""
    gen = torch.Generator().manual_seed(11)
    dtype = torch.bfloat16 if CUDA else torch.float32
    b, kvh, g, d, s = 5, 2, 4, 32, 90
    slots = torch.randperm(8, generator=gen)[:b]
    starts = torch.randint(10, s - 1, (b,), generator=gen)
    counts = torch.ones(b, dtype=torch.long)
    row_off = torch.arange(b)
    q = torch.randn(b, kvh * g, d, generator=gen).to(dtype)
    k, v = (torch.randn(8, s, kvh, d, generator=gen).to(dtype) for _ in range(2))
    i32 = lambda t: t.to(torch.int32).to(DEV)  # noqa: E731
    outs = []
    for r_max in (1, 33):
        masks = torch.eye(r_max, dtype=torch.bool).expand(b, r_max, r_max).clone()
        outs.append(batch_tree_attention(q.to(DEV), k.to(DEV), v.to(DEV), i32(slots), i32(starts), i32(counts),
                                         i32(row_off), pack_batch_masks(masks).to(DEV), r_max, d ** -0.5))
        ref = batch_tree_attention_reference(q, k, v, slots, starts, counts, row_off, masks, d ** -0.5)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(outs[-1].cpu().float(), ref.float(), atol=tol, rtol=tol)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("block_n", [32, 64])
def test_chain_and_prompt_rows_carry_ar_bits(block_n):
    """Keys walked in blocks aligned to absolute positions: each row of a chain (or of a prompt continued after a
    reused prefix) gives bit for bit what a one-row AR pass at its position gives, over the same pool; a tree row
    whose slots are its positions too. Interpreter in float32 here; bf16 on CUDA, where the claim matters."""
    gen = torch.Generator().manual_seed(11)
    dtype = torch.bfloat16 if CUDA else torch.float32
    kvh, g, d, s = 2, 4, 32, 200
    k = torch.randn(3, s, kvh, d, generator=gen).to(dtype).to(DEV)
    v = torch.randn(3, s, kvh, d, generator=gen).to(dtype).to(DEV)
    scale = d ** -0.5
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731

    def attend(q, start, count, mask):
        return batch_tree_attention(q, k, v, i32(1), i32(start), i32(count), i32(0),
                                    pack_batch_masks(mask[None]).to(DEV), count, scale, block_n=block_n)

    for start, count in [(0, 9), (57, 12), (60, 40), (128, 1), (1, 70)]:  # across block edges, a whole prompt
        q = torch.randn(count, kvh * g, d, generator=gen).to(dtype).to(DEV)
        rows = attend(q, start, count, torch.ones(count, count, dtype=torch.bool).tril())
        for i in range(count):
            ar = attend(q[i:i + 1], start + i, 1, torch.ones(1, 1, dtype=torch.bool))
            assert torch.equal(rows[i], ar[0]), (start, count, i)
    # a tree whose first-child path sits at its positions: that path's rows carry AR's bits too
    parents = [-1, 0, 1, 0, 2, 3]
    mask = ancestor_mask_of(parents)
    q = torch.randn(6, kvh * g, d, generator=gen).to(dtype).to(DEV)
    rows = attend(q, 61, 6, mask)
    for i in (0, 1, 2):  # root, child, grandchild at slots 61, 62, 63 = their positions
        assert torch.equal(rows[i], attend(q[i:i + 1], 61 + i, 1, torch.ones(1, 1, dtype=torch.bool))[0])


def test_reference_is_the_models_batched_attention(tiny_models):
    """The kernel's reference equals the attention inside ``Transformer.forward_batch`` (masked SDPA over padded rows)
    on a real layer's K/V."""
    from specpilot.model.batch import BatchRows
    from specpilot.model.cache import KVPool

    m = tiny_models[0]
    pool = KVPool(m.args, 3, 40, m.dtype, "cpu")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 64, (n,), generator=g) for n in (7, 4)]
    rows = BatchRows([2, 0], [0, 0], [7, 4], [None, None])
    m.forward_batch(torch.cat(prompts), torch.cat([torch.arange(7), torch.arange(4)]), pool, rows)
    a = m.args
    q = torch.randn(3 + 2, a.n_heads, a.head_dim, generator=g)
    masks = torch.zeros(2, 3, 3, dtype=torch.bool)
    masks[0] = ancestor_mask_of([-1, 0, 0])
    masks[1, :2, :2] = torch.ones(2, 2, dtype=torch.bool).tril()
    masks[1, 2, 2] = True
    k_new = torch.randn(5, a.n_kv_heads, a.head_dim, generator=g)
    k, v = pool.k[:, 0].clone(), pool.v[:, 0].clone()
    k[2, 7:10], k[0, 4:6] = k_new[:3], k_new[3:]
    v[2, 7:10], v[0, 4:6] = k_new[:3] * 2, k_new[3:] * 2
    ref = batch_tree_attention_reference(q, k, v, [2, 0], [7, 4], [3, 2], [0, 3], masks, a.head_dim ** -0.5)
    # the same attention through the model's padded masked-SDPA path
    import torch.nn.functional as F

    keys = torch.stack([k[2, :10], torch.cat([k[0, :6], k[0, :4]])]).transpose(1, 2).repeat_interleave(
        a.n_heads // a.n_kv_heads, 1)
    vals = torch.stack([v[2, :10], torch.cat([v[0, :6], v[0, :4]])]).transpose(1, 2).repeat_interleave(
        a.n_heads // a.n_kv_heads, 1)
    mask = torch.zeros(2, 3, 10, dtype=torch.bool)
    mask[0, :, :7], mask[0, :, 7:10] = True, masks[0]
    mask[1, :2, :4], mask[1, :2, 4:6], mask[1, 2, 0] = True, masks[1, :2, :2], True
    qp = torch.zeros(2, 3, a.n_heads, a.head_dim)
    qp[0], qp[1, :2] = q[:3], q[3:]
    o = F.scaled_dot_product_attention(qp.transpose(1, 2), keys, vals, attn_mask=mask[:, None]).transpose(1, 2)
    torch.testing.assert_close(torch.cat([o[0], o[1, :2]]), ref, atol=1e-5, rtol=1e-5)


def test_pack_batch_masks_is_pack_tree_mask_per_request():
    from specpilot.kernels.tree_attention import pack_tree_mask

    gen = torch.Generator().manual_seed(0)
    masks = torch.rand(3, 40, 40, generator=gen) > 0.5
    words = pack_batch_masks(masks)
    assert words.shape == (3, 40, 2) and all(torch.equal(words[i], pack_tree_mask(masks[i])) for i in range(3))


@pytest.mark.parametrize("fused,padded", [(False, False), (True, True)], ids=["kernel", "fused_padded"])
def test_batched_engine_through_the_kernel_equals_ar(tiny_dirs, fused, padded, monkeypatch):
    """``KernelConfig(batch_kernel=True)``: the batched engine's passes attend through the Triton kernel (the
    interpreter here) and every request's output is still AR greedy's. ``fused_padded``: decode steps padded to
    buckets (the CUDA-graph path) with each layer in the fused kernels, K/V stored at each row's pool slot by the
    fused q/k kernel (the GPU's default path)."""
    import dataclasses

    from specpilot.model import fused as fused_path

    calls = []
    real = fused_path.forward_batch_fused
    monkeypatch.setattr(fused_path, "forward_batch_fused", lambda *a: calls.append(1) or real(*a))

    from specpilot.config import SystemConfig
    from specpilot.engine.batch import BatchEngine
    from specpilot.engine.engine import Engine
    from specpilot.model.checkpoint import load_model
    from specpilot.spec.ngram import NgramDrafter

    target = load_model(tiny_dirs[0]).to(DEV)
    target.kernels = dataclasses.replace(target.kernels, batch_kernel=True, fused=fused or None)
    cfg = SystemConfig(drafter="ngram", tree="best_first", nodes=5, depth=4, top_k=2)
    prompts = [[3, 4, 5, 3, 4, 5, 3], [9, 8, 7, 9, 8], [1, 2, 3, 4, 5, 6, 1, 2, 3]]
    eng = BatchEngine(target, cfg, NgramDrafter(4, 1, 2, max_slots=3), eos_ids=[], max_num_seqs=3,
                      padded=padded or None)
    gens = eng.generate_all(prompts, [6, 9, 7])
    if fused:
        assert calls and eng.runner.passes == eng.exact_passes > 0
    plain = load_model(tiny_dirs[0]).to(DEV)
    for g, p, n in zip(gens, prompts, [6, 9, 7]):
        assert g.tokens == Engine(plain, SystemConfig.ar(), None, eos_ids=[]).generate(p, n).tokens


def test_a_requests_rows_do_not_depend_on_its_batch(tiny_dirs):
    """The fused batched pass with ``batch_invariant`` (the GPU's default): a request's hidden states, argmax and
    stored K/V are bitwise the same alone and beside other requests of other lengths (a prompt, then a tree step),
    which is why a batched bf16 output equals its batch-1 output. Interpreter, float32 here; bf16 on CUDA."""
    import dataclasses

    from specpilot.model.batch import BatchRows
    from specpilot.model.cache import KVPool
    from specpilot.model.checkpoint import load_model
    from specpilot.spec.trees import ancestor_mask_of

    dtype = torch.bfloat16 if CUDA else torch.float32
    m = load_model(tiny_dirs[0]).to(DEV, dtype)
    m.kernels = dataclasses.replace(m.kernels, fused=True, batch_kernel=True, batch_invariant=True)
    g = torch.Generator().manual_seed(5)
    a, b, c = (torch.randint(0, 64, (n,), generator=g).tolist() for n in (9, 5, 13))
    tree = torch.randint(0, 64, (4,), generator=g).tolist()
    tree_mask = ancestor_mask_of([-1, 0, 0, 1])

    def run(batch):  # batch: (slot, prompt) pairs; returns per slot (prefill hidden, tree hidden, argmax, K)
        pool = KVPool(m.args, 4, 40, dtype, DEV)
        outs = {}
        for step in ("prompt", "tree"):
            toks, pos, rows = [], [], BatchRows([], [], [], [])
            for slot, p in batch:
                t = p if step == "prompt" else tree
                start = 0 if step == "prompt" else len(p)
                toks += t
                pos += list(range(start, start + len(t))) if step == "prompt" else [start + d for d in (0, 1, 1, 2)]
                rows.slots.append(slot), rows.starts.append(start), rows.counts.append(len(t))
                rows.masks.append(None if step == "prompt" else tree_mask)
            h = m.forward_batch(torch.tensor(toks, device=DEV), torch.tensor(pos, device=DEV), pool, rows,
                                kernel=True)
            ids = m.batch_greedy(h, True)
            off = 0
            for slot, p in batch:
                n = len(p) if step == "prompt" else len(tree)
                outs[(slot, step)] = (h[off:off + n], ids[off:off + n])
                off += n
        return outs, pool

    alone, pool_alone = run([(1, a)])
    together, pool_together = run([(0, b), (1, a), (3, c)])
    for step in ("prompt", "tree"):
        assert torch.equal(alone[(1, step)][0], together[(1, step)][0]), step
        assert torch.equal(alone[(1, step)][1], together[(1, step)][1]), step
    span = len(a) + len(tree)
    assert torch.equal(pool_alone.k[1, :, :span], pool_together.k[1, :, :span])
    assert torch.equal(pool_alone.v[1, :, :span], pool_together.v[1, :, :span])
