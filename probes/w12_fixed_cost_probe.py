"""Where the one-row lines GEMV's time goes: a fixed cost per launch against a cost per K step (issue 5).

    python probes/w12_fixed_cost_probe.py OUT.json

The Qwen3-8B qkv / o rows (N = 6144 / 4096) at one activation row with K grown one 256-column step a program at a
time, the grid held fixed: split 4 with K = 1024 .. 4096 (1..4 steps a program, the qkv / o default grid) and split 1
with K = 256 .. 1024 (1..4 steps, a quarter of the programs). ``t = fixed + steps · per_step`` is fitted per series;
``fixed`` holds the launch, ramp, epilogue (partials, counter, escapes, store) and the first load's latency.

Each series is timed twice: with the weight's own escapes, and with an empty escape table (the same records; the
output is then not the weight's product, so only timed). Also per shape at the default K: ``fused_split=False``
(partials summed by a second kernel). Every escaped output is checked against the reference before it is timed;
timing as in ``probes/w12_bench.py`` (one CUDA graph, ≥ 512 MiB of weight copies, best of 5 replays).
"""

from __future__ import annotations

import sys
import time

import torch

from specpilot.w12.gemm import escape_table, w12_gemm
from specpilot.provenance import git_commit, versions
from specpilot.w12.format import encode

from timing import time_calls  # noqa: E402  (probes/timing.py)
from w12_bench import check, codes, copies_of, write_result  # noqa: E402

dev = "cuda"


def no_escapes(esc):
    """An escape table of the same channels with no entries."""
    row_ptr, esc_k, esc_d = esc
    return torch.zeros_like(row_ptr), esc_k[:0], esc_d[:0]


def fit(steps: list[int], us: list[float]) -> dict:
    n = len(steps)
    mx, my = sum(steps) / n, sum(us) / n
    b = sum((s - mx) * (u - my) for s, u in zip(steps, us)) / sum((s - mx) ** 2 for s in steps)
    return {"fixed_us": my - b * mx, "per_step_us": b}


def main(out_path: str) -> dict:
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(), "series": []}
    g = torch.Generator(device=dev).manual_seed(5)
    for name, n in (("qkv", 6144), ("o", 4096)):
        for split, ks in ((4, (1024, 2048, 3072, 4096)), (1, (256, 512, 768, 1024))):
            for escapes in (True, False):
                pts = []
                for k in ks:
                    w = (torch.randn(n, k, generator=g, device=dev) * 0.02).to(torch.bfloat16)
                    t = encode(w, device=dev)
                    esc = escape_table(t)
                    x = torch.randn(1, k, generator=g, device=dev).to(torch.bfloat16)
                    ts = [(c, e if escapes else no_escapes(e)) for c, e in copies_of(t, esc)]
                    kw = dict(gemv=True, lines=True, split_k=split)
                    row = {"k": k, "steps": k // 256 // split, "escapes": t.num_escapes if escapes else 0}
                    if escapes:
                        row |= check(w12_gemm(x, t, escapes=esc, **kw), x, t, w.float().abs() + codes(t).abs())
                    row["us"] = time_calls(lambda a, tw: w12_gemm(a, tw[0], escapes=tw[1], **kw), ts, x)
                    if split > 1 and k == ks[-1]:
                        kw2 = kw | {"fused_split": False}
                        row["two_kernel_us"] = time_calls(lambda a, tw: w12_gemm(a, tw[0], escapes=tw[1], **kw2), ts, x)
                    pts.append(row)
                    del ts
                s = {"proj": name, "n": n, "split_k": split, "with_escapes": escapes, "points": pts}
                s |= fit([p["steps"] for p in pts], [p["us"] for p in pts])
                res["series"].append(s)
                print(f"{name} split {split} escapes {escapes}: " + " ".join(f"{p['us']:.2f}" for p in pts)
                      + f" -> fixed {s['fixed_us']:.2f} + {s['per_step_us']:.2f}/step", flush=True)
                torch.cuda.empty_cache()
    return write_result(res, t0, out_path)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python probes/w12_fixed_cost_probe.py OUT.json")
    if not torch.cuda.is_available():
        sys.exit("this probe times CUDA kernels: it needs a CUDA GPU")
    main(sys.argv[1])
