"""Where the W12 one-row kernels lose to a plain read (issue 5): the epilogue's escapes and split-K sum.

    python probes/w12_epilogue_probe.py OUT.json

``probes/read_floor.py`` (H200, session 12) measured the W12 GEMV 4–6 µs above the time a plain streaming read
of the same bytes takes, on every Qwen3-8B projection, long or short. A constant excess points at the ends of
the kernel. The escape epilogue (:func:`~specpilot.w12.gemm._add_escapes`) is a chain of dependent
loads (row pointers, then each escape's column, then x at that column) run after the K loop, and the fused
split-K sum adds an atomic and a reload of the partials. This probe times, side by side at 1 row (µs per call,
one CUDA graph, ≥ 512 MiB of weight copies), each projection's default W12 call and a few launch variants on
three weight sets of the same shape:

- ``normal``: N(0, 0.02) bf16 (escape rate ~1e-4, as the benchmarks use);
- ``clean``: the same with |w| raised to at least 0.02 · 2^-8 (no weight outside its channel's window: no escapes);
- ``dense``: ``normal`` plus a zero planted at 1 in 1000 weights (escape rate ~1e-3).

``normal − clean`` is what the escapes cost; the split variants show what the in-kernel split-K sum costs.
Each output is checked against the reference first (the rounding bound of :mod:`specpilot.w12.gemm`).
"""

from __future__ import annotations

import json
import math
import sys
import time

import torch

from specpilot.w12.gemm import escape_table, w12_gemm
from specpilot.provenance import git_commit, versions
from specpilot.w12.format import encode

from timing import time_calls  # noqa: E402  (probes/timing.py)
from w12_bench import SHAPES, check, codes, copies_of  # noqa: E402

dev = "cuda"
VARIANTS = ({}, {"gemv": True}, {"gemv": True, "split_k": 1}, {"gemv": True, "split_k": 2},
            {"gemv": True, "fused_split": False}, {"gemv": False})


def weights(n: int, k: int, kind: str) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g, device=dev) * 0.02
    if kind == "clean":
        w = w.sign() * w.abs().clamp_min(0.02 * 2**-8)
    elif kind == "dense":
        w[torch.rand(n, k, generator=g, device=dev) < 1e-3] = 0.0
    return w.to(torch.bfloat16)


def main(out_path: str) -> dict:
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(), "rows": []}
    torch.backends.cuda.matmul.allow_tf32 = False
    for name in [s for s in SHAPES if s.startswith("qwen3-8b")]:
        n, k = SHAPES[name]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        for kind in ("normal", "clean", "dense"):
            w = weights(n, k, kind)
            t = encode(w, device=dev)
            esc = escape_table(t)
            aw = w.float().abs() + codes(t).abs()
            ts = copies_of(t, esc)
            for v in VARIANTS:
                row = {"proj": name, "weights": kind, "escapes": t.num_escapes,
                       "max_escapes_per_row": int((esc[0][1:] - esc[0][:-1]).max()), "config": v}
                try:
                    row |= check(w12_gemm(x, t, escapes=esc, **v), x, t, aw)
                    row["us"] = time_calls(lambda a, te, v=v: w12_gemm(a, te[0], escapes=te[1], **v), ts, x)
                except Exception as exc:  # an invalid split for the shape, say
                    row["error"] = str(exc).splitlines()[0][:160]
                res["rows"].append(row)
                print(json.dumps({k_: (round(v_, 3) if isinstance(v_, float) else v_) for k_, v_ in row.items()
                                  if k_ not in ("same_nonfinite", "max_abs_err")}), flush=True)
            del w, t, esc, aw, ts
            torch.cuda.empty_cache()
        res["runtime_s"] = time.time() - t0
        json.dump(res, open(out_path, "w"), indent=1)
    print(f"{'proj':18s} {'config':44s} {'normal':>7s} {'clean':>7s} {'dense':>7s}")
    for name in [s for s in SHAPES if s.startswith("qwen3-8b")]:
        for v in VARIANTS:
            us = {r["weights"]: r.get("us", math.nan) for r in res["rows"] if r["proj"] == name and r["config"] == v}
            print(f"{name:18s} {json.dumps(v):44s} {us['normal']:7.2f} {us['clean']:7.2f} {us['dense']:7.2f}")
    return res


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python probes/w12_epilogue_probe.py OUT.json")
    main(sys.argv[1])
