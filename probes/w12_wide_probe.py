"""W12 at 64–256 rows (the prefill chunk): the word tensor-core kernel with all rows in one tile against the
dense path (decode to bf16, then cuBLAS) and cuBLAS bf16, on the Qwen3-8B projections (issue 5).

    python probes/w12_wide_probe.py OUT.json

Why: the default word kernel tiles rows by 64 and decodes each weight once per tile, so a 256-row prefill
chunk decodes it four times; the dense path decodes once but writes and re-reads a bf16 copy, +7.5 ms a
256-row chunk on a random 8B (``prefill_pair_check_h200_2026-11-30_session7.json``). ``block_m`` 128 / 256
decodes once per chunk with no bf16 round trip; whether the tile fits (registers: acc is BLOCK_N x BLOCK_M
float32; shared memory: the activation tile is BLOCK_M x BLOCK_K bf16 a stage) and runs near cuBLAS is what
this measures. Every variant is checked against ``F.linear`` on the bf16 weight before it is timed (max
relative error over the output, written to the JSON); a variant that fails to compile is recorded with its
error. Figures: µs per call, one CUDA graph cycling ≥ 512 MiB of weight copies (``probes/timing.py``).
"""

from __future__ import annotations

import itertools
import json
import sys
import time

import torch
import torch.nn.functional as F

import specpilot.w12.dense as wd
import specpilot.w12.gemm as wg
from specpilot.provenance import git_commit, versions

from timing import time_calls  # noqa: E402  (probes/timing.py)
from w12_bench import projection_copies  # noqa: E402

dev = "cuda"
ROWS = (64, 128, 192, 256)
VARIANTS = [dict(block_m=bm, num_warps=nw, block_k=bk, num_stages=ns)
            for bm, nw, bk, ns in itertools.product((128, 256), (4, 8), (64, 128), (2, 3))]


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| / max |ref| over the output (float)."""
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def run_probe(path: str, rows, variants, method: str, budget_s: float = 480.0) -> dict:
    """Time the word tensor-core kernel's launch variants against cuBLAS and the dense path on the Qwen3-8B
    projections; writes ``path`` (JSON) after every row count and stops starting new ones after ``budget_s``.

    Args:
        rows: activation row counts. variants: ``variants(m, n, k) -> list[dict]`` of ``w12_gemm`` overrides.
        method: one line for the JSON. Each variant is checked against ``F.linear`` on the bf16 weight (max
            relative error < 1e-2) before it is timed; one that fails to compile is recorded with its error.
    Returns: the result dict."""
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(),
           "method": method, "rows": []}
    for name, n, k, w, t, esc, ts, ws in projection_copies("qwen3-8b"):
        for m in rows:
            if time.time() - t0 > budget_s:
                break
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x, w)
            row = {"proj": name, "rows": m,
                   "cublas_us": time_calls(lambda a, w_: F.linear(a, w_), ws, x, reps=4),
                   "dense_us": time_calls(lambda a, te: F.linear(a, wd.w12_decode_dense(te[0])), ts, x, reps=4),
                   "default_us": time_calls(lambda a, te: wg.w12_gemm(a, te[0], escapes=te[1]), ts, x, reps=4),
                   "words_default_us": time_calls(
                       lambda a, te: wg.w12_gemm(a, te[0], escapes=te[1], gemv=False, words=True), ts, x, reps=4),
                   "variants": []}
            for v in variants(m, n, k):
                rec = dict(v)
                try:
                    y = wg.w12_gemm(x, t, escapes=esc, gemv=False, words=True, **v)
                    rec["rel_err"] = rel_err(y, ref)
                    if rec["rel_err"] < 1e-2:
                        rec["us"] = time_calls(lambda a, te, v=v: wg.w12_gemm(a, te[0], escapes=te[1], gemv=False,
                                                                               words=True, **v), ts, x, reps=4)
                except Exception as e:  # a tile that does not fit: recorded, not fatal
                    rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                row["variants"].append(rec)
            timed = [r for r in row["variants"] if "us" in r]
            best = min(timed, key=lambda r: r["us"]) if timed else None
            row["best_variant"] = best
            row["best_vs_cublas"] = row["cublas_us"] / best["us"] if best else None
            row["best_vs_dense"] = row["dense_us"] / best["us"] if best else None
            row["default_vs_cublas"] = row["cublas_us"] / row["default_us"]
            print(json.dumps({k_: row[k_] for k_ in row if k_ != "variants"}), flush=True)
            res["rows"].append(row)
            res["runtime_s"] = time.time() - t0
            with open(path, "w") as f:
                json.dump(res, f, indent=1)
    return res


def main():
    run_probe(sys.argv[1], ROWS, lambda m, n, k: VARIANTS, __doc__.strip().splitlines()[0])


if __name__ == "__main__":
    main()
