"""Where the tensor-core W12 kernel's time goes at 8–32 rows: a fixed cost per launch against a cost per K step,
beside cuBLAS bf16 at the same shapes (issue 5: qkv / o miss 1.25x there).

    python probes/w12_mma_fixed_cost_probe.py OUT.json

The Qwen3-8B qkv / o rows (N = 6144 / 4096) at 8, 16 and 32 activation rows with the W12 launch held at its
default for K = 4096 (:func:`~specpilot.w12.gemm.default_config`: BLOCK_K 64, its split K) and K grown so
that each program runs 4, 8, 12, 16 steps of 64 columns (K = split · 256 .. split · 1024). ``t = fixed + steps ·
per_step`` is fitted per series (:func:`w12_fixed_cost_probe.fit`); cuBLAS is timed at the same K and fitted the same
way (it picks its own kernel per K, so its fit is descriptive only). Each W12 output is checked against the
reference before it is timed; timing as in ``probes/w12_bench.py`` (one CUDA graph, ≥ 512 MiB of weight copies, best
of 5 replays).
"""

from __future__ import annotations

import math
import sys
import time

import torch
import torch.nn.functional as F

from specpilot.w12.gemm import default_config, escape_table, w12_gemm
from specpilot.provenance import git_commit, versions
from specpilot.w12.format import encode

from timing import time_calls  # noqa: E402  (probes/timing.py)
from w12_bench import check, codes, copies_of, write_result  # noqa: E402
from w12_fixed_cost_probe import fit  # noqa: E402

dev = "cuda"


def main(out_path: str) -> dict:
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(), "series": []}
    g = torch.Generator(device=dev).manual_seed(11)
    for name, n in (("qkv", 6144), ("o", 4096)):
        for m in (8, 16, 32):
            cfg = default_config(m, n, 4096)
            split = cfg["split_k"]
            pts = []
            for steps in (4, 8, 12, 16):
                k = split * steps * 64
                w = (torch.randn(n, k, generator=g, device=dev) * 0.02).to(torch.bfloat16)
                t = encode(w, device=dev)
                esc = escape_table(t)
                x = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
                kw = {key: cfg[key] for key in ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages")}
                row = {"k": k, "steps": steps} | check(w12_gemm(x, t, escapes=esc, **kw), x, t,
                                                       w.float().abs() + codes(t).abs())
                ts = copies_of(t, esc)
                row["w12_us"] = time_calls(lambda a, te: w12_gemm(a, te[0], escapes=te[1], **kw), ts, x)
                ws = [w] + [w.clone() for _ in range(max(1, math.ceil((512 << 20) / (n * k * 2))) - 1)]
                row["cublas_us"] = time_calls(lambda a, w_: F.linear(a, w_), ws, x)
                pts.append(row)
                del ts, ws
            s = {"proj": name, "n": n, "rows": m, "config": cfg, "points": pts,
                 "w12": fit([p["steps"] for p in pts], [p["w12_us"] for p in pts]),
                 "cublas": fit([p["steps"] for p in pts], [p["cublas_us"] for p in pts])}
            res["series"].append(s)
            print(f"{name} {m} rows split {split}: w12 " + " ".join(f"{p['w12_us']:.2f}" for p in pts)
                  + f" -> {s['w12']['fixed_us']:.2f} + {s['w12']['per_step_us']:.2f}/step; cublas "
                  + " ".join(f"{p['cublas_us']:.2f}" for p in pts)
                  + f" -> {s['cublas']['fixed_us']:.2f} + {s['cublas']['per_step_us']:.2f}/step", flush=True)
            torch.cuda.empty_cache()
    return write_result(res, t0, out_path)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python probes/w12_mma_fixed_cost_probe.py OUT.json")
    if not torch.cuda.is_available():
        sys.exit("this probe times CUDA kernels: it needs a CUDA GPU")
    main(sys.argv[1])
