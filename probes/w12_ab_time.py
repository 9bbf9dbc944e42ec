"""µs per call of the default ``w12_gemm`` and of cuBLAS on the Qwen3-8B projections at 1 / 8 / 16 / 32 rows, for
an A/B of two versions of the kernels: run it once per tree (``PYTHONPATH=A``, then ``PYTHONPATH=B``, then again)
in one device call and compare the JSON files (issue 5).

    python probes/w12_ab_time.py OUT.json [LABEL] [--ar]

``--ar``: also the exact pass at 1 row of random Qwen3-8B, bf16 then W12 (``measure_verify_ms``, CUDA graphs), as
``probes/w12_bench.py`` times AR decode.

Each output is checked against the reference (rounding bound of :mod:`specpilot.w12.gemm`) before it is
timed; timing as in ``probes/w12_bench.py`` (one CUDA graph, ≥ 512 MiB of weight copies, best of 5 replays).
The weights are drawn from a fixed seed, so both trees time the same bytes.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F

import specpilot
from specpilot.w12.gemm import w12_gemm
from specpilot.provenance import git_commit, versions

from timing import time_calls  # noqa: E402  (probes/timing.py)
from w12_bench import check, codes, projection_copies  # noqa: E402

dev = "cuda"


def ar_pass() -> dict:
    """Exact-pass ms at 1 row of random Qwen3-8B: bf16, then with every projection in W12."""
    from specpilot.w12.convert import to_w12
    from specpilot.pilot.setup import measure_verify_ms
    from specpilot.zoo.random_ckpt import random_transformer

    torch.manual_seed(0)
    model = random_transformer("qwen3-8b", dev)
    bf16 = measure_verify_ms(model, 512, (1,), repeats=20, static=True)[1]
    to_w12(model, inplace=True)
    torch.cuda.empty_cache()
    w12 = measure_verify_ms(model, 512, (1,), repeats=20, static=True)[1]
    del model
    torch.cuda.empty_cache()
    return {"bf16_ms": bf16, "w12_ms": w12, "speedup": bf16 / w12}


def main(out_path: str, label: str, ar: bool = False) -> dict:
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    res = {"label": label, "specpilot": specpilot.__file__, "device": torch.cuda.get_device_name(0),
           "versions": versions(), "commit": git_commit(), "rows": []}
    for name, n, k, w, t, esc, ts, ws in projection_copies("qwen3-8b", seed=0):
        g = torch.Generator(device=dev).manual_seed(n + 3 * k)
        aw = w.float().abs() + codes(t).abs()
        for m in (1, 8, 16, 32):
            x = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
            row = {"proj": name, "rows": m} | check(w12_gemm(x, t, escapes=esc), x, t, aw)
            row["w12_us"] = time_calls(lambda a, te: w12_gemm(a, te[0], escapes=te[1]), ts, x)
            row["cublas_us"] = time_calls(lambda a, w_: F.linear(a, w_), ws, x)
            row["speedup"] = row["cublas_us"] / row["w12_us"]
            res["rows"].append(row)
            print(label, name, m, f"w12 {row['w12_us']:.2f} cublas {row['cublas_us']:.2f} x{row['speedup']:.3f}",
                  "ok" if row["within_bound"] else "OUT OF BOUND", flush=True)
        del w, t, esc, aw, ts, ws
        torch.cuda.empty_cache()
    if ar:
        res["ar"] = ar_pass()
        print(label, "AR 1 row", res["ar"], flush=True)
    res["runtime_s"] = time.time() - t0
    json.dump(res, open(out_path, "w"), indent=1)
    return res


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--ar"]
    if len(args) not in (1, 2):
        sys.exit("usage: python probes/w12_ab_time.py OUT.json [LABEL] [--ar]")
    main(args[0], args[1] if len(args) == 2 else "", "--ar" in sys.argv[1:])
