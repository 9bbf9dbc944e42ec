"""Wide W12 passes (prefill): decode to bf16 then cuBLAS (:mod:`specpilot.w12.dense`) against the
tensor-core W12 kernels and cuBLAS bf16, by row count, on the Qwen3-8B projections; then the
prefill of a random Qwen3-8B.

    python probes/w12_dense_probe.py OUT.json

1. Correctness on the GPU: the dense decode equals the bf16 weight bit for bit (planted zeros, denormals,
   outliers, ±inf, NaN; every Qwen3-8B shape); a wide ``W12Linear`` pass equals ``F.linear`` bit for bit.
2. µs per call (one CUDA graph, ≥ 512 MiB of weight copies) at 16–2048 rows: cuBLAS, the byte tensor-core
   kernel (chunks of 256 rows), the word tensor-core kernel, decode + cuBLAS, and the decode alone. The
   crossover row count is what :data:`~specpilot.w12.linear.DENSE_ROWS` should be.
3. Prefill ms (eager forward of 512 and 2048 prompt tokens, median of 5): bf16, W12 with the dense path, W12
   without it.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F

import specpilot.w12.dense as wd
import specpilot.w12.gemm as wg
import specpilot.w12.linear as wl
from specpilot.w12.convert import to_w12
from specpilot.provenance import git_commit, versions
from specpilot.w12.format import encode
from specpilot.zoo.random_ckpt import random_transformer

from specpilot.bench.timing import time_calls
from specpilot.bench.w12 import SHAPES, bits_equal, projection_copies

dev = "cuda"
T0 = time.time()
ROWS = (16, 32, 64, 96, 128, 192, 256, 512, 1024, 2048)


def chunked(x, t, esc, **over):
    """The tensor-core W12 path as W12Linear ran it before the dense path: chunks of 256 rows."""
    if x.shape[0] <= wg.MAX_ROWS:
        return wg.w12_gemm(x, t, escapes=esc, gemv=False, **over)
    return torch.cat([wg.w12_gemm(x[i:i + wg.MAX_ROWS], t, escapes=esc, gemv=False, **over)
                      for i in range(0, x.shape[0], wg.MAX_ROWS)])


def dense(x, t):
    return F.linear(x, wd.w12_decode_dense(t))


def correctness() -> dict:
    out = {"cases": []}
    g = torch.Generator(device=dev).manual_seed(3)
    for name, (n, k) in [("planted 1000x3000", (1000, 3000))] + [(s, SHAPES[s]) for s in SHAPES if s.startswith("qwen3-8b")]:
        w = (torch.randn(n, k, generator=g, device=dev) * 0.02).to(torch.bfloat16)
        for i, v in enumerate([0.0, -0.0, 1e-40, -3e-39, 300.0, -5e4, 1e30, float("inf"), float("-inf"), float("nan")]):
            w[(37 * i + 5) % n, (53 * i + 7) % k] = v
        t = encode(w, device=dev)
        layer = wl.W12Linear.from_w12(t)
        x = torch.randn(wl.DENSE_ROWS + 36, k, device=dev, dtype=torch.bfloat16)
        case = {"shape": name, "escapes": t.num_escapes, "decode_bit_exact": bits_equal(wd.w12_decode_dense(t), w),
                "wide_pass_equals_f_linear": bits_equal(layer(x), F.linear(x, w))}
        out["cases"].append(case)
        print(case, flush=True)
        del w, t, layer
    out["all_ok"] = all(c["decode_bit_exact"] and c["wide_pass_equals_f_linear"] for c in out["cases"])
    return out


def timing() -> list[dict]:
    rows = []
    for name, n, k, w, t, esc, ts, ws in projection_copies("qwen3-8b"):
        dec = time_calls(lambda a, te: wd.w12_decode_dense(te[0]), ts, None, reps=2)
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            reps = 4 if m <= 256 else 1
            row = {"proj": name, "rows": m, "decode_us": dec,
                   "cublas_us": time_calls(lambda a, w_: F.linear(a, w_), ws, x, reps=reps),
                   "tc_bytes_us": time_calls(lambda a, te: chunked(a, te[0], te[1]), ts, x, reps=reps),
                   "tc_words_us": time_calls(lambda a, te: chunked(a, te[0], te[1], words=True), ts, x, reps=reps),
                   "dense_us": time_calls(lambda a, te: dense(a, te[0]), ts, x, reps=reps)}
            row["best_w12"] = min(("tc_bytes_us", "tc_words_us", "dense_us"), key=row.get)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def prefill() -> dict:
    model = random_transformer("qwen3-8b", dev)
    out = {}

    def ms(p):
        toks = torch.randint(0, 1000, (p,), device=dev)
        times = []
        for _ in range(6):
            cache = model.new_cache(p + 1)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.forward(toks, torch.arange(p, device=dev), cache, 0)
            torch.cuda.synchronize()
            times.append(1e3 * (time.perf_counter() - t0))
            del cache
        return sorted(times[1:])[2]

    for p in (512, 2048):
        out[f"bf16_{p}_ms"] = ms(p)
    to_w12(model, inplace=True)
    for p in (512, 2048):
        out[f"w12_dense_{p}_ms"] = ms(p)
    keep = wl.DENSE_ROWS
    wl.DENSE_ROWS = 10 ** 9
    for p in (512, 2048):
        out[f"w12_tensor_core_{p}_ms"] = ms(p)
    wl.DENSE_ROWS = keep
    print("prefill", out, flush=True)
    return out


def main():
    path = sys.argv[1]
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(),
           "dense_rows": wl.DENSE_ROWS}
    save = lambda: json.dump(res | {"runtime_s": time.time() - T0}, open(path, "w"), indent=1)  # noqa: E731
    res["correctness"] = correctness()
    save()
    res["timing"] = timing()
    save()
    res["prefill"] = prefill()
    save()


if __name__ == "__main__":
    main()
