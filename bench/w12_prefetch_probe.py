"""L2 bulk prefetch ahead of the W12 kernels' loads: ``w12_gemm(..., prefetch=D)`` for D K steps ahead, beside
cuBLAS bf16 and the default (no prefetch), on the Qwen3-8B and -32B projections; then AR decode with it (issue 5).

    python bench/w12_prefetch_probe.py OUT.json [--quick]

Why: the profiles of sessions 12–17 put the W12 kernels' loss against a plain read in exposed load latency (each
one-warp GEMV program runs a few K steps with every load waited on; ncu: 45–67% of DRAM bandwidth) and in a fixed
cost of the tensor-core kernel at 8–32 rows. ``prefetch=D`` has one thread a program issue
``cp.async.bulk.prefetch.L2`` (no registers, nothing waits on it) for its share of its band's record bytes D steps
ahead (:func:`~specpilot.kernels.w12_tiles._prefetch_steps`), so the DRAM stream runs ahead of the loads and the
loads find their lines in L2; ``prefetch_lines=True`` instead has each thread issue ``prefetch.global.L2`` for lines
of the program's own rows D steps ahead. (Session 18's first call, with the bulk op issued before each step's
loads and step 0 included, lost at every D in 1..64 on every shape: ``w12_prefetch_probe_h200_2026-12-02_session18_run1.json``.)

1. GEMM: per projection and row count, cuBLAS, the default and each variant; each one's output must be bitwise the
   default's (a prefetch changes no value), the default's within the rounding bound of the reference.
2. AR decode (random Qwen3-8B, the ``w12`` mechanism): bf16, W12 as it is, W12 with the one-row GEMV's and the
   tensor-core kernel's prefetch defaults set to the best variant of section 1 (only when one beats the default),
   interleaved rounds; tokens of the two W12 runs must be equal (same kernels, same order). 3. Qwen3-32B shapes.
Timing as in ``bench/w12_bench.py``; weights from a fixed seed.
"""

from __future__ import annotations

import copy
import math
import sys
import time

import torch
import torch.nn.functional as F

from specpilot.benchsuite.w12 import decode_tokens_per_s
from specpilot.kernels import w12_gemm as gemm_mod
from specpilot.kernels import w12_gemv as gemv_mod
from specpilot.kernels.w12_gemm import W12Linear, w12_gemm
from specpilot.mechanisms.w12 import to_w12
from specpilot.provenance import git_commit, versions
from specpilot.zoo.random_ckpt import random_transformer

from timing import time_calls  # noqa: E402  (bench/timing.py)
from w12_bench import bits_equal, check, codes, projection_copies, write_result  # noqa: E402

dev = "cuda"
#: (label, overrides): the bulk share of the band D steps ahead, or the program's own lines D steps ahead
VARIANTS = (("bulk1", dict(prefetch=1)), ("bulk2", dict(prefetch=2)), ("lines1", dict(prefetch=1, prefetch_lines=True)),
            ("lines2", dict(prefetch=2, prefetch_lines=True)))


def gemm_rows(prefix: str, rows: tuple, variants: tuple) -> list:
    out = []
    for name, n, k, w, t, esc, ts, ws in projection_copies(prefix, seed=0):
        g = torch.Generator(device=dev).manual_seed(n + 3 * k)
        aw = w.float().abs() + codes(t).abs()
        for m in rows:
            x = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
            ref = w12_gemm(x, t, escapes=esc)
            row = {"proj": name, "rows": m, "cublas_us": time_calls(lambda a, w_: F.linear(a, w_), ws, x),
                   "default": check(ref, x, t, aw)}
            row["default"]["us"] = time_calls(lambda a, te: w12_gemm(a, te[0], escapes=te[1]), ts, x)
            for label, over in variants:
                same = bits_equal(w12_gemm(x, t, escapes=esc, **over), ref)
                us = time_calls(lambda a, te, o=over: w12_gemm(a, te[0], escapes=te[1], **o), ts, x)
                row[label] = {"us": us, "bitwise_default": same, "vs_default": row["default"]["us"] / us,
                              "speedup": row["cublas_us"] / us}
            row["default"]["speedup"] = row["cublas_us"] / row["default"]["us"]
            out.append(row)
            best = min((v[0] for v in variants), key=lambda v: row[v]["us"])
            print(name, m, f"cublas {row['cublas_us']:.2f} default {row['default']['us']:.2f} "
                  f"({row['default']['speedup']:.3f}x)", " ".join(f"{v} {row[v]['us']:.2f}" for v, _ in variants),
                  f"best {best} {row[best]['speedup']:.3f}x",
                  "ok" if row["default"]["within_bound"] and all(row[v]["bitwise_default"] for v, _ in variants)
                  else "MISMATCH", flush=True)
        del w, t, esc, aw, ts, ws
        torch.cuda.empty_cache()
    return out


def best_variant(rows: list, one_row: bool) -> tuple[str | None, float]:
    """The variant with the best geometric mean of speedup over the default, over the 8B rows at one row (the GEMV)
    or at 2–32 rows (the tensor-core kernel), and that mean; None when no variant beats the default."""
    sel = [r for r in rows if r["proj"].startswith("qwen3-8b") and (r["rows"] == 1) == one_row and r["rows"] <= 32]
    score = {v: math.exp(sum(math.log(r[v]["vs_default"]) for r in sel) / len(sel)) for v, _ in VARIANTS}
    best = max(score, key=score.get)
    return (best if score[best] > 1 else None), score[best]


def ar(gemv: dict, mma: dict) -> dict:
    model = random_transformer("qwen3-8b", dev)
    proj = to_w12(model, head=False)
    full = copy.copy(proj)
    full._modules = dict(proj._modules)
    full.lm_head = W12Linear.from_linear(model.lm_head)
    pf = copy.copy(full)
    pf._modules = dict(full._modules)

    def setter(g, m):
        def f():
            gemv_mod.GEMV_PREFETCH, gemm_mod.MMA_PREFETCH = g.get("prefetch", 0), m.get("prefetch", 0)
            gemv_mod.GEMV_PREFETCH_LINES = g.get("prefetch_lines", False)
            gemm_mod.MMA_PREFETCH_LINES = m.get("prefetch_lines", False)
        return f

    dec = decode_tokens_per_s({"bf16": model, "w12": full, "w12_prefetch": pf}, rounds=5,
                              setup={"bf16": setter({}, {}), "w12": setter({}, {}), "w12_prefetch": setter(gemv, mma)})
    setter({}, {})()
    dec |= {"gemv_prefetch": gemv, "mma_prefetch": mma, "speedup_w12": dec["w12"] / dec["bf16"],
            "speedup_w12_prefetch": dec["w12_prefetch"] / dec["bf16"],
            "tokens_equal_w12_prefetch": dec["tokens_sha256"]["w12"] == dec["tokens_sha256"]["w12_prefetch"]}
    print("AR decode", dec, flush=True)
    del model, proj, full, pf
    torch.cuda.empty_cache()
    return dec


def main(out_path: str, quick: bool) -> dict:
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(),
           "variants": dict(VARIANTS)}
    res["gemm"] = gemm_rows("qwen3-8b", (1, 8, 16, 32), VARIANTS)
    write_result(res, t0, out_path)
    res["best"] = {"gemv": best_variant(res["gemm"], True), "mma": best_variant(res["gemm"], False)}
    print("best variants (geomean vs default)", res["best"], flush=True)
    pick = {k: dict(VARIANTS)[v] if v else {} for k, (v, _) in res["best"].items()}
    if not quick and (pick["gemv"] or pick["mma"]):
        res["ar_decode"] = ar(pick["gemv"], pick["mma"])
        write_result(res, t0, out_path)
    if not quick:
        res["gemm_32b"] = gemm_rows("qwen3-32b", (1, 8, 32), VARIANTS[:1] + VARIANTS[2:3])
    return write_result(res, t0, out_path)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--quick"]
    if len(args) != 1:
        sys.exit("usage: python bench/w12_prefetch_probe.py OUT.json [--quick]")
    if not torch.cuda.is_available():
        sys.exit("this probe times CUDA kernels: it needs a CUDA GPU")
    main(args[0], "--quick" in sys.argv[1:])
