"""The batched CPU decode step's attention at SmolLM2's shape: the CPU flash SDPA (what the eager pass runs) against
the compiled stack's ``masked_attention`` (keys a window of the pool, or gathered first), the C++ kernel over each
request's own keys (``specpilot.kernels.cpu_attention``), the SDPA on a head-major copy of the pool (a layout not
built), and the time to read the same K/V once. 32 requests of the peer workload's lengths (8 GSM8K chat prompts four times, 100 tokens generated),
one query row each, 2 threads. Every variant's output is checked against the SDPA's.

Usage: ``PYTHONPATH=. python probes/decode_attention_cpu.py OUT.json``
"""

import json
import platform
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from specpilot.kernels import cpu_attention
from specpilot.model.compiled_stack import masked_attention

torch.set_num_threads(2)
torch.manual_seed(0)
W, KVH, G, D, LAYERS, SLOT = 32, 3, 3, 64, 30, 1024  # SmolLM2: 9 query heads on 3 KV heads of 64
lens = torch.tensor([96, 56, 87, 65, 140, 86, 74, 101]).repeat(4) + 100
span = int(lens.max())
pool_k, pool_v = torch.randn(W, LAYERS, SLOT, KVH, D), torch.randn(W, LAYERS, SLOT, KVH, D)
q = torch.randn(W, KVH, G, D)
mask = (torch.arange(span)[None, :] < lens[:, None])[:, None, None, :].expand(W, 1, G, span).contiguous()
compiled = torch.compile(masked_attention, dynamic=True)
idx = torch.randperm(W)


def sdpa(layer):
    k, v = pool_k[:, layer, :span], pool_v[:, layer, :span]
    return F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)


def window(layer):
    return compiled(q, pool_k[:, layer, :span], pool_v[:, layer, :span], mask)


def gathered(layer):
    k = pool_k[:, layer, :span].index_select(0, idx)
    v = pool_v[:, layer, :span].index_select(0, idx)
    return compiled(q, k, v, mask)


def sdpa_gathered(layer):
    k = pool_k[:, layer, :span].index_select(0, idx)
    v = pool_v[:, layer, :span].index_select(0, idx)
    return F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)


hm_k, hm_v = pool_k.permute(0, 1, 3, 2, 4).contiguous(), pool_v.permute(0, 1, 3, 2, 4).contiguous()


def sdpa_head_major(layer):  # a pool laid out [slot, layer, KVH, pos, D]: each head's keys contiguous
    return F.scaled_dot_product_attention(q, hm_k[:, layer, :, :span], hm_v[:, layer, :, :span], attn_mask=mask)


slots_all = torch.arange(W)


def cpp_decode(layer):  # one query row a request: q [W, H, D]
    return cpu_attention.decode_attention(q.reshape(W, KVH * G, D), pool_k, pool_v, layer, slots_all, lens)


def read_kv(layer):
    return pool_k[:, layer, :span].sum() + pool_v[:, layer, :span].sum()


def ms(fn, n=60):
    for i in range(5):
        fn(i % LAYERS)
    t = time.perf_counter()
    for i in range(n):
        fn(i % LAYERS)
    return (time.perf_counter() - t) / n * 1e3


errors = {"window": (window(0) - sdpa(0)).abs().max().item(), "head_major": (sdpa_head_major(0) - sdpa(0)).abs().max().item(),
          "gathered": (gathered(0) - sdpa_gathered(0)).abs().max().item(),
          "cpp_decode": (cpp_decode(0).reshape(W, KVH, G, D) - sdpa(0)).abs().max().item()}
variants = {"sdpa": sdpa, "masked_attention_window": window, "sdpa_gathered": sdpa_gathered,
            "masked_attention_gathered": gathered, "sdpa_head_major": sdpa_head_major, "cpp_decode": cpp_decode, "read_kv_once": read_kv}
times = {k: [] for k in variants}
for _ in range(3):  # interleaved rounds
    for name, fn in variants.items():
        times[name].append(ms(fn))
sweep = {}  # the window form against the SDPA by request count (the same lengths, the first W of them)
for w in (1, 2, 4, 8, 16, 32):
    sw = int(lens[:w].max())
    mw = mask[:w, :, :, :sw].contiguous()

    def sd(layer, w=w, sw=sw, mw=mw):
        k, v = pool_k[:w, layer, :sw], pool_v[:w, layer, :sw]
        return F.scaled_dot_product_attention(q[:w], k.transpose(1, 2), v.transpose(1, 2), attn_mask=mw)

    def ma(layer, w=w, sw=sw, mw=mw):
        return compiled(q[:w], pool_k[:w, layer, :sw], pool_v[:w, layer, :sw], mw)

    def cd(layer, w=w):
        return cpu_attention.decode_attention(q[:w].reshape(w, KVH * G, D), pool_k, pool_v, layer, slots_all[:w],
                                              lens[:w])

    a, b, c = [], [], []
    for _ in range(3):
        a.append(ms(sd, 100))
        b.append(ms(ma, 100))
        c.append(ms(cd, 100))
    sweep[str(w)] = {"sdpa_ms": min(a), "masked_attention_ms": min(b), "cpp_decode_ms": min(c),
                     "ratio": min(b) / min(a), "cpp_ratio": min(c) / min(a)}
by_rows = {}  # several rows a request (a chain's or tree's verification): the SDPA of the eager pass against the kernel
from specpilot.kernels.batch_attention import pack_batch_masks  # noqa: E402
from specpilot.model.batch import BatchRows  # noqa: E402
from specpilot.model.layers import batch_sdpa  # noqa: E402

for w in (1, 8, 32):
    for r in (2, 4, 7, 16):
        rows = BatchRows(list(range(w)), [int(x) - r for x in lens[:w]], [r] * w, [None] * w)
        p = rows.prepared("cpu")
        qr = torch.randn(w * r, KVH * G, D)
        sw = p.span

        def sd(layer, p=p, qr=qr, sw=sw, w=w):
            return batch_sdpa(qr, pool_k[:w, layer, :sw], pool_v[:w, layer, :sw], p)

        def kr(layer, p=p, qr=qr):
            return cpu_attention.tree_decode_attention(qr, pool_k, pool_v, layer, p.slots, p.starts, p.counts,
                                                       p.row_off, p.words)

        err = (sd(0) - kr(0)).abs().max().item()
        a, c = [], []
        for _ in range(3):
            a.append(ms(sd, 40))
            c.append(ms(kr, 40))
        by_rows[f"{w}x{r}"] = {"requests": w, "rows_each": r, "sdpa_ms": min(a), "kernel_ms": min(c),
                               "ratio": min(c) / min(a), "max_abs_error": err}
        print(f"{w}x{r}", by_rows[f"{w}x{r}"], flush=True)
res = {"probe": "decode_attention_cpu", "date": time.strftime("%Y-%m-%d"),
       "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
       "versions": {"torch": torch.__version__, "python": platform.python_version()},
       "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
       "shape": {"requests": W, "kv_heads": KVH, "rows_per_kv_head": G, "head_dim": D, "span": span,
                 "mean_keys": float(lens.float().mean()), "dtype": "float32"},
       "ms_per_layer": {k: min(v) for k, v in times.items()}, "ms_per_layer_rounds": times,
       "max_abs_error_vs_sdpa": errors, "by_requests": sweep, "by_rows": by_rows}
res["ratio_to_sdpa"] = {"window": res["ms_per_layer"]["masked_attention_window"] / res["ms_per_layer"]["sdpa"],
                        "gathered": res["ms_per_layer"]["masked_attention_gathered"] / res["ms_per_layer"]["sdpa_gathered"],
                        "cpp_decode": res["ms_per_layer"]["cpp_decode"] / res["ms_per_layer"]["sdpa"],
                        "cpp_decode_to_window": res["ms_per_layer"]["cpp_decode"]
                        / res["ms_per_layer"]["masked_attention_window"]}
json.dump(res, open(sys.argv[1], "w"), indent=1)
print(json.dumps({k: res[k] for k in ("ms_per_layer", "ratio_to_sdpa", "max_abs_error_vs_sdpa", "by_requests")},
                 indent=1))
