"""Tree attention benchmark: the engine's masked SDPA against the Triton kernel.

Qwen3-8B attention shapes (H=32, KVH=8, D=128), bf16, a static cache of S=4096 slots, prefix L in
{512, 2048}, rows R in {1, 8, 16, 33, 64, 128, 256}, random ancestor-closed tree masks. Timed by CUDA
events around CUDA-graph replays of one call per layer over LAYERS different layer caches (so K/V come from
HBM as in a real step, not from L2), giving ms per call; eager per-call times (launch included) too.

- ``sdpa``: today's path in ``Attention.forward``: repeat_interleave GQA, bool mask ``[R, L+R]``, SDPA over
  ``cache[:L+R]``.
- ``triton``: :func:`specpilot.kernels.tree_attention.tree_attention` with its default config; and
  ``triton_nosplit`` (num_splits=1) to show what the split-KV path buys.
Errors: max abs difference against ``tree_attention_reference`` (fp32 math) on one layer.

Usage: ``python probes/tree_attention_bench.py out.json`` (CUDA only). Writes one JSON object.
"""

import json
import sys

import torch
import torch.nn.functional as F

from specpilot.kernels.tree_attention import default_config, tree_attention, tree_attention_reference
from specpilot.spec.trees import ancestor_mask_of
from specpilot.provenance import git_commit, versions

H, KVH, D, S, LAYERS = 32, 8, 128, 4096, 16
PREFIXES = (512, 2048)
ROWS = (1, 8, 16, 33, 64, 128, 256)
REPS = 20


def random_tree_mask(r, gen):
    """``[r, r]`` bool ancestor-or-self mask from a random parent array (parent of i in [0, i))."""
    return ancestor_mask_of([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, r)])


def sdpa_current(q, k, v, n, full_mask):
    """The engine's current attention: ``q [R, H, D]``, ``k, v [S, KVH, D]``, mask ``[R, n]``."""
    rep = q.shape[1] // k.shape[1]
    keys = k[:n].transpose(0, 1)[None].repeat_interleave(rep, dim=1)
    vals = v[:n].transpose(0, 1)[None].repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, vals, attn_mask=full_mask)
    return o[0].transpose(0, 1)


def time_graph(fn):
    """ms per call: a CUDA graph of ``fn(layer)`` for every layer, replayed REPS times (median)."""
    for layer in range(LAYERS):  # warm up / compile outside the capture
        fn(layer)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for layer in range(LAYERS):
            fn(layer)
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(REPS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / LAYERS)
    ts.sort()
    return ts[len(ts) // 2]


def time_eager(fn):
    """ms per call, eager (launch overhead included): events around LAYERS calls, median of REPS."""
    ts = []
    for _ in range(REPS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for layer in range(LAYERS):
            fn(layer)
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / LAYERS)
    ts.sort()
    return ts[len(ts) // 2]


def main(path):
    dev = "cuda"
    out = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(),
           "shapes": {"H": H, "KVH": KVH, "D": D, "S": S, "layers_rotated": LAYERS, "dtype": "bfloat16"},
           "timing": "median ms per call; graph = CUDA-graph replay of one call per layer cache",
           "results": []}
    gen = torch.Generator().manual_seed(0)
    kc = torch.randn(LAYERS, S, KVH, D, generator=gen).to(dev, torch.bfloat16)
    vc = torch.randn(LAYERS, S, KVH, D, generator=gen).to(dev, torch.bfloat16)
    scale = D ** -0.5
    for prefix in PREFIXES:
        for r in ROWS:
            rec = {"L": prefix, "R": r, "config": default_config(r, H // KVH, KVH, S, D,
                                                                 torch.cuda.get_device_properties(0)
                                                                 .multi_processor_count)}
            try:
                q = torch.randn(r, H, D, generator=gen).to(dev, torch.bfloat16)
                mask = random_tree_mask(r, gen).to(dev)
                full = torch.cat([torch.ones(r, prefix, dtype=torch.bool, device=dev), mask], dim=1)
                plen = torch.tensor(prefix, dtype=torch.int32, device=dev)
                n = prefix + r
                ref = tree_attention_reference(q, kc[0], vc[0], prefix, mask, scale).float()
                o_sdpa = sdpa_current(q, kc[0], vc[0], n, full)
                o_tri = tree_attention(q, kc[0], vc[0], plen, mask, scale)
                o_ns = tree_attention(q, kc[0], vc[0], plen, mask, scale, num_splits=1)
                rec["max_abs_err"] = {"sdpa": (o_sdpa.float() - ref).abs().max().item(),
                                      "triton": (o_tri.float() - ref).abs().max().item(),
                                      "triton_nosplit": (o_ns.float() - ref).abs().max().item()}
                rec["triton_deterministic"] = bool(torch.equal(o_tri, tree_attention(q, kc[0], vc[0], plen, mask,
                                                                                      scale)))
                fns = {"sdpa": lambda i: sdpa_current(q, kc[i], vc[i], n, full),
                       "triton": lambda i: tree_attention(q, kc[i], vc[i], plen, mask, scale),
                       "triton_nosplit": lambda i: tree_attention(q, kc[i], vc[i], plen, mask, scale, num_splits=1)}
                rec["graph_ms"] = {k: time_graph(f) for k, f in fns.items()}
                rec["eager_ms"] = {k: time_eager(f) for k, f in fns.items()}
                kv_bytes = 2 * n * KVH * D * 2
                flops = 4 * r * H * n * D
                t = rec["graph_ms"]["triton"] * 1e-3
                rec["kv_bytes"] = kv_bytes
                rec["flops"] = flops
                rec["triton_GBps"] = kv_bytes / t / 1e9
                rec["triton_TFLOPs"] = flops / t / 1e12
                rec["speedup_graph_vs_sdpa"] = rec["graph_ms"]["sdpa"] / rec["graph_ms"]["triton"]
            except Exception as e:  # record and keep going
                rec["error"] = repr(e)
            print(json.dumps(rec), flush=True)
            out["results"].append(rec)
            with open(path, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python probes/tree_attention_bench.py OUT.json")
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    main(sys.argv[1])
