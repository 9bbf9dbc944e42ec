"""W12 GEMM decode variants on the GPU (issue 5): the byte-wise decode vs the packed one (two weights per
32-bit operation, ``packed=True``), a launch-config sweep around each, cuBLAS alongside; then the AR step
with the best config per (projection, rows).

    python bench/w12_probe.py OUT.json [BUDGET_S]

1. Correctness of ``packed=True`` on the GPU: planted escapes (zeros, denormals, outliers, ±inf, NaN) at
   1 / 17 / 64 rows, within the rounding bound of :mod:`specpilot.kernels.w12_gemm` against the reference,
   NaN / inf where the reference has them, two runs bitwise equal (the packed kernel sums the column classes
   ``k mod 4`` in separate dots, so it need not equal ``packed=False`` bitwise; the bound is the contract).
2. µs per call (one CUDA graph, ≥ 512 MiB of weight copies, no L2 reuse) of cuBLAS and of each variant on
   the Qwen3-8B projections at 1, 8, 16, 32 rows.
3. The exact pass at 1 and 33 rows, bf16 vs W12 with the best variant per (projection, row bucket) and vs
   W12 with the defaults.

Writes OUT.json after every section (device, versions, commit, every figure).
"""

from __future__ import annotations

import json
import math
import sys
import time

import torch
import torch.nn.functional as F

import specpilot.kernels.w12_gemm as wg
from specpilot.mechanisms.w12 import to_w12
from specpilot.pilot.setup import measure_verify_ms
from specpilot.provenance import git_commit, versions
from specpilot.w12.format import decode, encode
from specpilot.zoo.random_ckpt import random_transformer

from timing import time_calls  # noqa: E402  (bench/timing.py)
from w12_bench import SHAPES, bits_equal, check, codes, copies_of  # noqa: E402

dev = "cuda"
ROWS = (1, 8, 16, 32)
T0 = time.time()


def variants(m: int) -> list[dict]:
    """The configs tried at ``m`` rows: defaults, packed with the default blocking, and a small grid."""
    out = [{}, {"packed": True}]
    for bn in (64, 128):
        for bk in (128, 256):
            for st, nw in ((3, 4), (4, 4), (4, 8), (5, 4)):
                v = {"packed": True, "block_n": bn, "block_k": bk, "num_stages": st, "num_warps": nw}
                if v != {"packed": True, "block_n": 64, "block_k": 128, "num_stages": 4, "num_warps": 4}:
                    out.append(v)
    out += [{"packed": True, "split_k": s} for s in (1, 2, 4, 8)]
    return out


def correctness() -> dict:
    g = torch.Generator(device=dev).manual_seed(1)
    n, k = 1000, 3000
    w = (torch.randn(n, k, generator=g, device=dev) * 0.02).to(torch.bfloat16)
    for i, v in enumerate([0.0, -0.0, 1e-40, -3e-39, 1e-30, 300.0, -5e4, 1e30, float("inf"), float("-inf"), float("nan")]):
        for r in (37 * i + 5, 101 * i + 3, 997):
            w[r % n, (53 * i + 7 * r) % k] = v
    t = encode(w, device=dev)
    esc = wg.escape_table(t)
    aw = decode(t, check=False).float().abs().nan_to_num(0, 0, 0) + codes(t).abs()
    cases = []
    for m in (1, 17, 64):
        x = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
        for over in ({"packed": True}, {"packed": True, "split_k": 1}, {"packed": True, "block_n": 128, "block_k": 256},
                     {"packed": True, "w_left": False}):
            out = wg.w12_gemm(x, t, escapes=esc, **over)
            row = {"rows": m, "config": over} | check(out, x, t, aw)
            row["deterministic"] = bits_equal(out, wg.w12_gemm(x, t, escapes=esc, **over))
            cases.append(row)
    ok = all(c["within_bound"] and c["deterministic"] for c in cases)
    print("packed correctness", ok, max(c["max_err_over_bound"] for c in cases), flush=True)
    return {"all_ok": ok, "cases": cases}


def sweep(budget_s: float) -> tuple[list[dict], dict]:
    rows_out, best = [], {}
    for name in [s for s in SHAPES if s.startswith("qwen3-8b")]:
        n, k = SHAPES[name]
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        t = encode(w, device=dev)
        ts = copies_of(t, wg.escape_table(t))
        ws = [w] + [w.clone() for _ in range(max(1, math.ceil((512 << 20) / (n * k * 2))) - 1)]
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            cub = time_calls(lambda a, w_: F.linear(a, w_), ws, x, reps=4)
            res = []
            for v in variants(m):
                if time.time() - T0 > budget_s:
                    break
                try:
                    us = time_calls(lambda a, te: wg.w12_gemm(a, te[0], escapes=te[1], **v), ts, x, reps=4)
                    res.append({"proj": name, "rows": m, "config": v, "us": us, "cublas_us": cub, "speedup": cub / us})
                except Exception as exc:  # shared memory, invalid split, ...
                    res.append({"proj": name, "rows": m, "config": v, "error": str(exc).splitlines()[0][:120]})
            rows_out += res
            timed = sorted((r for r in res if "us" in r), key=lambda r: r["us"])
            if timed:
                best[(name, m)] = timed[0]
                d = next((r for r in res if r["config"] == {} and "us" in r), None)
                dus = f"{d['us']:.2f}" if d else "-"
                print(name, m, f"cublas {cub:.2f} us  default {dus}  best {timed[0]['us']:.2f} "
                      f"{timed[0]['config']} -> {timed[0]['speedup']:.3f}x cuBLAS", flush=True)
        del ts, t, ws, w
        torch.cuda.empty_cache()
    return rows_out, best


def ar(best: dict) -> dict:
    """Exact pass at 1 and 33 rows: bf16, W12 defaults, W12 with the best sweep config per (shape, rows)."""
    model = random_transformer("qwen3-8b", dev)
    out = {"bf16_ms": measure_verify_ms(model, 512, (1, 33), repeats=20, static=True)}
    to_w12(model, inplace=True)
    torch.cuda.empty_cache()
    out["w12_default_ms"] = measure_verify_ms(model, 512, (1, 33), repeats=20, static=True)
    shape_of = {SHAPES[s]: s for s in SHAPES if s.startswith("qwen3-8b")}
    base_cfg = wg.default_config

    def tuned(m, n, k, num_sms=132):
        cfg = base_cfg(m, n, k, num_sms)
        name = shape_of.get((n, k))
        bucket = min((r for r in ROWS if r >= m), default=None)
        if name and bucket and (name, bucket) in best:
            cfg.update(best[(name, bucket)]["config"])
        return cfg

    wg.default_config = tuned
    try:
        out["w12_tuned_ms"] = measure_verify_ms(model, 512, (1, 33), repeats=20, static=True)
    finally:
        wg.default_config = base_cfg
    out["speedup_tuned"] = {r: out["bf16_ms"][r] / out["w12_tuned_ms"][r] for r in out["bf16_ms"]}
    print("AR", out, flush=True)
    return out


def main():
    path, budget = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 330.0
    torch.backends.cuda.matmul.allow_tf32 = False
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit()}
    save = lambda: json.dump(res | {"runtime_s": time.time() - T0}, open(path, "w"), indent=1)  # noqa: E731
    res["correctness"] = correctness()
    save()
    res["sweep"], best = sweep(budget)
    res["best"] = [b for b in best.values()]
    save()
    res["ar"] = ar(best)
    save()


if __name__ == "__main__":
    main()
