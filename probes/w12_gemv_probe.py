"""W12 one-row GEMV (``w12_gemm(..., gemv=True)``: 3-instruction decode to float32 in registers, FMAs)
against cuBLAS bf16 and the tensor-core W12 kernel on the Qwen3-8B projections; then the exact pass at
1 row with every W12 projection on the GEMV path (issue 5).

    python probes/w12_gemv_probe.py OUT.json [BUDGET_S] [--no-few-rows] [--no-words]

1. Correctness on the GPU: planted escapes (zeros, denormals, outliers, ±inf, NaN), each config: within the
   rounding bound of :mod:`specpilot.w12.gemm` against the reference, NaN / inf where the reference
   has them, two runs bitwise equal.
2. µs per call at 1 row (one CUDA graph, ≥ 512 MiB of weight copies: no L2 reuse): cuBLAS ``F.linear``, the
   tensor-core W12 kernel (defaults) and GEMV configs.
3. Exact pass at 1 row (CUDA graphs, fused kernels): bf16, W12 on the tensor-core kernel only, W12 with the
   default routing, W12 GEMV with the best config per shape.
4. (not with ``--no-few-rows``) 2, 4 and 8 rows: the GEMV (``gemv=True``) checked, then timed against the tensor-core kernel and cuBLAS,
   default launch (:func:`~specpilot.w12.gemv.gemv_config`) and 4 / 8 / 16 groups a thread, with and
   without ``load_stages``.
5. (not with ``--no-words``) 8, 16 and 32 rows: the tensor-core kernel over record words (``words=True``,
   :mod:`specpilot.w12.mma`) checked, then timed against the byte-loading one and cuBLAS, default
   launch and a few variants.
"""

from __future__ import annotations

import json
import math
import sys
import time

import torch
import torch.nn.functional as F

import specpilot.w12.gemm as wg
from specpilot.w12.convert import to_w12
from specpilot.pilot.setup import measure_verify_ms
from specpilot.provenance import git_commit, versions
from specpilot.w12.gemv import gemv_config
from specpilot.w12.format import decode, encode
from specpilot.zoo.random_ckpt import random_transformer

from timing import time_calls  # noqa: E402  (probes/timing.py)
from w12_bench import SHAPES, bits_equal, check, codes, copies_of  # noqa: E402

dev = "cuda"
T0 = time.time()
CONFIGS = [{"gemv": True}] + [
    # session 11: the defaults before the one-row rule change (qkv; o and down; gate_up), the best of the session-11
    # runs (results/w12_gemv_probe_h200_2026-12-01_session11{,_run2}.json) and neighbours of the new rule's
    {"gemv": True, "block_n": bn, "block_k": bk, "split_k": sp, "num_warps": nw, "num_stages": 3}
    for bn, bk, sp, nw in ((16, 1024, 1, 4), (16, 2048, 1, 8), (16, 256, 1, 1), (16, 512, 2, 2), (16, 512, 4, 2),
                           (8, 1024, 1, 2), (16, 256, 4, 1), (8, 512, 2, 1), (16, 1024, 2, 4), (8, 512, 4, 1),
                           (8, 1024, 2, 2), (16, 256, 2, 1), (16, 512, 1, 2))] + [
    # session 11: ``load_stages`` (cp.async through shared memory; 0.45-0.95x cuBLAS where the plain loop is 1.0-1.2x,
    # ..._session11_run2.json): two kept as a check
    {"gemv": True, "load_stages": 3}, {"gemv": True, "block_n": 16, "block_k": 1024, "split_k": 1, "num_warps": 4,
                                       "num_stages": 3, "load_stages": 3}]

FEW_ROW_CONFIGS = ((256, 4, 1), (512, 8, 1), (256, 2, 1), (512, 4, 1), (256, 2, 3), (512, 4, 3), (256, 4, 3),
                   (512, 8, 3), (256, 2, 4), (1024, 8, 3), (1024, 4, 3))  # block_k, num_warps, load_stages


def correctness() -> dict:
    g = torch.Generator(device=dev).manual_seed(2)
    n, k = 1000, 3000
    w = (torch.randn(n, k, generator=g, device=dev) * 0.02).to(torch.bfloat16)
    for i, v in enumerate([0.0, -0.0, 1e-40, -3e-39, 1e-30, 300.0, -5e4, 1e30, float("inf"), float("-inf"), float("nan")]):
        for r in (37 * i + 5, 101 * i + 3, 997):
            w[r % n, (53 * i + 7 * r) % k] = v
    t = encode(w, device=dev)
    esc = wg.escape_table(t)
    aw = decode(t, check=False).float().abs().nan_to_num(0, 0, 0) + codes(t).abs()
    x = torch.randn(1, k, generator=g, device=dev).to(torch.bfloat16)
    cases = []
    for over in CONFIGS:
        try:
            out = wg.w12_gemm(x, t, escapes=esc, **over)
            row = {"config": over} | check(out, x, t, aw)
            row["deterministic"] = bits_equal(out, wg.w12_gemm(x, t, escapes=esc, **over))
        except Exception as exc:
            row = {"config": over, "error": str(exc).splitlines()[0][:160], "within_bound": False, "deterministic": False}
        cases.append(row)
    ok = [c for c in cases if c["within_bound"] and c["deterministic"]]
    print("gemv correctness", len(ok), "of", len(cases), flush=True)
    return {"all_ok": len(ok) == len(cases), "cases": cases}


def timing(good: list[dict], budget_s: float) -> tuple[list[dict], dict]:
    rows, best = [], {}
    for name in [s for s in SHAPES if s.startswith("qwen3-8b")]:
        n, k = SHAPES[name]
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        t = encode(w, device=dev)
        ts = copies_of(t, wg.escape_table(t))
        ws = [w] + [w.clone() for _ in range(max(1, math.ceil((512 << 20) / (n * k * 2))) - 1)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        cub = time_calls(lambda a, w_: F.linear(a, w_), ws, x, reps=4)
        tc = time_calls(lambda a, te: wg.w12_gemm(a, te[0], escapes=te[1], gemv=False), ts, x, reps=4)
        res = []
        for v in good:
            if time.time() - T0 > budget_s:
                break
            try:
                us = time_calls(lambda a, te: wg.w12_gemm(a, te[0], escapes=te[1], **v), ts, x, reps=4)
                res.append({"proj": name, "config": v, "us": us, "cublas_us": cub, "tensor_core_w12_us": tc,
                            "speedup_vs_cublas": cub / us, "w12_TBps": t.nbytes / us / 1e6})
            except Exception as exc:
                res.append({"proj": name, "config": v, "error": str(exc).splitlines()[0][:160]})
        rows += res
        timed = sorted((r for r in res if "us" in r), key=lambda r: r["us"])
        if timed:
            best[(n, k)] = timed[0]["config"]
            print(name, f"cublas {cub:.2f}  w12 tensor-core {tc:.2f}  gemv best {timed[0]['us']:.2f} us "
                  f"({timed[0]['speedup_vs_cublas']:.3f}x cuBLAS, {timed[0]['w12_TBps']:.2f} TB/s) {timed[0]['config']}",
                  flush=True)
        del ts, t, ws, w
        torch.cuda.empty_cache()
    return rows, best


def ar(best: dict) -> dict:
    model = random_transformer("qwen3-8b", dev)
    out = {"bf16_ms": measure_verify_ms(model, 512, (1,), repeats=20, static=True)[1]}
    to_w12(model, inplace=True)
    torch.cuda.empty_cache()
    plain = wg.w12_gemm

    def tensor_core(x, w12, bias=None, escapes=None, **over):
        return plain(x, w12, bias, escapes, **({"gemv": False} | over))

    wg.w12_gemm = tensor_core
    try:
        out["w12_tensor_core_ms"] = measure_verify_ms(model, 512, (1,), repeats=20, static=True)[1]
    finally:
        wg.w12_gemm = plain
    out["w12_default_ms"] = measure_verify_ms(model, 512, (1,), repeats=20, static=True)[1]

    def routed(x, w12, bias=None, escapes=None, **over):
        if x.shape[0] == 1 and not over:
            over = dict(best.get(tuple(w12.shape), {"gemv": True}))
        return plain(x, w12, bias, escapes, **over)

    wg.w12_gemm = routed
    try:
        out["w12_gemv_ms"] = measure_verify_ms(model, 512, (1,), repeats=20, static=True)[1]
    finally:
        wg.w12_gemm = plain
    out["speedup_gemv_vs_bf16"] = out["bf16_ms"] / out["w12_gemv_ms"]
    print("AR 1 row", out, flush=True)
    return out


def shape_setup(name: str):
    """One Qwen3-8B projection: ``n, k``, a random bf16 weight, its W12 encoding and escape table, copies of
    both (≥ 512 MiB, so timed calls read HBM, not L2) and ``|w| + |c|`` for the rounding bound."""
    n, k = SHAPES[name]
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    t = encode(w, device=dev)
    esc = wg.escape_table(t)
    ws = [w] + [w.clone() for _ in range(max(1, math.ceil((512 << 20) / (n * k * 2))) - 1)]
    return n, k, w, t, esc, copies_of(t, esc), ws, decode(t, check=False).float().abs() + codes(t).abs()


def few_rows() -> list[dict]:
    """2, 4 and 8 rows: the GEMV (``gemv=True``, default launch) vs the tensor-core W12 kernel vs cuBLAS, each
    checked against the reference first (rounding bound, two runs bitwise equal)."""
    rows = []
    for name in [s for s in SHAPES if s.startswith("qwen3-8b")]:
        n, k, w, t, esc, ts, ws, aw = shape_setup(name)
        for m in (2, 4, 8):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            out = wg.w12_gemm(x, t, escapes=esc, gemv=True)
            row = {"proj": name, "rows": m} | check(out, x, t, aw)
            row["deterministic"] = bits_equal(out, wg.w12_gemm(x, t, escapes=esc, gemv=True))
            row["cublas_us"] = time_calls(lambda a, w_: F.linear(a, w_), ws, x, reps=4)
            row["tensor_core_w12_us"] = time_calls(lambda a, te: wg.w12_gemm(a, te[0], escapes=te[1], gemv=False), ts,
                                                   x, reps=4)
            row["gemv_us"] = time_calls(lambda a, te: wg.w12_gemm(a, te[0], escapes=te[1], gemv=True), ts, x, reps=4)
            row["gemv_vs_cublas"] = row["cublas_us"] / row["gemv_us"]
            row["gemv_default"] = gemv_config(n, k, m=m)
            row["gemv_configs"] = []  # 4 / 8 / 16 groups of 8 weights a thread (ptxas_probe.py: registers)
            for bk, nw, ls in FEW_ROW_CONFIGS:
                over = dict(block_n=16, block_k=bk, num_warps=nw, split_k=1, num_stages=3, load_stages=ls)
                got = wg.w12_gemm(x, t, escapes=esc, gemv=True, **over)
                ok = check(got, x, t, aw)["within_bound"] and bits_equal(got, wg.w12_gemm(x, t, escapes=esc, gemv=True,
                                                                                         **over))
                us = time_calls(lambda a, te: wg.w12_gemm(a, te[0], escapes=te[1], gemv=True, **over), ts, x,
                                reps=4) if ok else None
                row["gemv_configs"].append(over | {"ok": ok, "us": us})
            print(name, m, "rows", {k_: row[k_] for k_ in ("within_bound", "deterministic", "cublas_us",
                                                           "tensor_core_w12_us", "gemv_us")}, flush=True)
            rows.append(row)
        del ts, t, ws, w
        torch.cuda.empty_cache()
    return rows


WORDS_VARIANTS = ({}, {"block_n": 128}, {"num_warps": 8}, {"block_k": 256}, {"num_stages": 3}, {"block_n": 128, "num_warps": 8})


def words_rows() -> list[dict]:
    """Section 5: ``words=True`` at 8 / 16 / 32 rows vs ``words=False`` vs cuBLAS, each variant checked
    against the reference first (rounding bound, two runs bitwise equal)."""
    rows = []
    for name in [s for s in SHAPES if s.startswith("qwen3-8b")]:
        n, k, w, t, esc, ts, ws, aw = shape_setup(name)
        for m in (8, 16, 32):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            row = {"proj": name, "rows": m, "cublas_us": time_calls(lambda a, w_: F.linear(a, w_), ws, x, reps=4),
                   "bytes_us": time_calls(lambda a, te: wg.w12_gemm(a, te[0], escapes=te[1], gemv=False), ts, x,
                                          reps=4), "words": []}
            for v in WORDS_VARIANTS:
                over = dict(gemv=False, words=True, **v)
                try:
                    got = wg.w12_gemm(x, t, escapes=esc, **over)
                    ok = check(got, x, t, aw)["within_bound"] and bits_equal(got, wg.w12_gemm(x, t, escapes=esc, **over))
                    us = time_calls(lambda a, te: wg.w12_gemm(a, te[0], escapes=te[1], **over), ts, x, reps=4) if ok else None
                    row["words"].append(v | {"ok": ok, "us": us, "vs_cublas": row["cublas_us"] / us if us else None})
                except Exception as exc:  # a variant that does not compile is recorded, not fatal
                    row["words"].append(v | {"error": str(exc).splitlines()[0][:160]})
            print(name, m, "rows", json.dumps(row), flush=True)
            rows.append(row)
        del ts, t, ws, w, aw
        torch.cuda.empty_cache()
    return rows


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--no-")]
    path, budget = args[0], float(args[1]) if len(args) > 1 else 150.0
    torch.backends.cuda.matmul.allow_tf32 = False
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit()}
    save = lambda: json.dump(res | {"runtime_s": time.time() - T0}, open(path, "w"), indent=1)  # noqa: E731
    res["correctness"] = correctness()
    save()
    good = [c["config"] for c in res["correctness"]["cases"] if c["within_bound"] and c["deterministic"]]
    res["timing"], best = timing(good, budget)
    save()
    res["ar"] = ar(best)
    save()
    if "--no-few-rows" not in sys.argv:
        res["few_rows"] = few_rows()
        save()
    if "--no-words" not in sys.argv:
        res["words"] = words_rows()
        save()


if __name__ == "__main__":
    main()
