"""The CPU's attention at a batched decode step's shapes: torch's flash SDPA, its math SDPA and a plain
matmul-softmax-matmul on ``q [B, 3, rows, 64]`` (SmolLM2: 3 KV heads, 3 query heads each, one row a request, so 3
rows a KV head), keys and values ``[B, 3, span, 64]``, a random bool mask; µs per call (mean of 200 after 10 warm-up),
and each one's max abs difference from flash's output. Writes ``OUT`` as JSON.

    OMP_NUM_THREADS=2 python probes/sdpa_cpu_small.py results/<dir>/sdpa.json
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def per_call_us(f, n: int = 200) -> float:
    for _ in range(10):
        f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return 1e6 * (time.perf_counter() - t0) / n


def main(out: str) -> None:
    torch.manual_seed(0)
    rows = []
    for b, span, r in ((8, 160, 3), (8, 260, 3), (32, 260, 3), (8, 160, 12)):
        q, k, v = torch.randn(b, 3, r, 64), torch.randn(b, 3, span, 64), torch.randn(b, 3, span, 64)
        m = torch.rand(b, 1, r, span) > 0.2
        m[..., 0] = True

        def flash():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

        def math_():
            with sdpa_kernel([SDPBackend.MATH]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

        def plain():
            s = (q @ k.transpose(-1, -2)) * 64 ** -0.5
            return torch.softmax(s.masked_fill(~m, float("-inf")), -1) @ v

        ref = flash()
        rows.append({"requests": b, "span": span, "rows_per_kv_head": r,
                     **{f"{n}_us": per_call_us(f) for n, f in (("flash", flash), ("math", math_), ("plain", plain))},
                     "math_max_abs_diff": float((math_() - ref).abs().max()),
                     "plain_max_abs_diff": float((plain() - ref).abs().max())})
        print(json.dumps(rows[-1]), flush=True)
    res = {"torch": torch.__version__, "threads": torch.get_num_threads(), "load": os.getloadavg(), "rows": rows}
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
