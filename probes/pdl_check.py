"""Programmatic dependent launch on the H200 (issue 5: W12's fixed cost per kernel), off against on, side by side.

    python probes/pdl_check.py OUT.json

1. Correctness: ``pytest``-free copies of ``tests/test_pdl.py``'s GPU check are not repeated here; run
   ``python -m pytest -q tests/test_pdl.py`` first. This script records only whether W12 outputs at 1 / 8 / 32 rows
   are bitwise equal with PDL off and on.
2. W12 GEMM on the Qwen3-8B projections at 1 / 8 / 16 / 32 rows, µs per call from one CUDA graph of back-to-back
   calls over ≥ 512 MiB of weight copies (``probes/w12_bench.py``'s method): PDL off, on with the W12 kernels'
   ``start`` style and with their ``prefetch`` style (:mod:`specpilot.kernels.pdl`), with cuBLAS in the same
   process for the ratio (cuBLAS's own launches never use PDL).
3. The exact pass of random Qwen3-8B at 1 and 33 rows through the bucket graphs (``measure_verify_ms``), bf16 and
   W12, PDL off and on (W12 in both styles): the fused elementwise kernels, tree attention and the W12 kernels use
   it; cuBLAS does not.

Writes OUT.json after every section (device, versions, commit, every figure).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from specpilot.kernels import pdl
from specpilot.w12.gemm import w12_gemm
from specpilot.w12.convert import to_w12
from specpilot.pilot.setup import measure_verify_ms
from specpilot.provenance import git_commit, versions
from specpilot.zoo.random_ckpt import random_transformer

from timing import time_calls  # noqa: E402  (probes/timing.py)
from w12_bench import projection_copies  # noqa: E402  (probes/w12_bench.py)

ROWS = (1, 8, 16, 32)
#: (name, pdl.ENABLED, pdl.W12_STYLE)
VARIANTS = (("off", False, "prefetch"), ("start", True, "start"), ("prefetch", True, "prefetch"))


def main() -> int:
    out_path = sys.argv[1]
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(),
           "method": __doc__.strip().splitlines()[0], "capability": list(torch.cuda.get_device_capability()),
           "gemm": [], "ar": {}}

    def save():
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)

    for name, n, k, w, t, esc, ts, ws in projection_copies("qwen3-8b"):
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"proj": name, "rows": m, "cublas_us": time_calls(F.linear, ws, x)}
            outs = {}
            for name_, flag, style in VARIANTS:
                pdl.ENABLED, pdl.W12_STYLE = flag, style
                outs[name_] = w12_gemm(x, t, escapes=esc)
                row[f"w12_{name_}_us"] = time_calls(lambda a, te: w12_gemm(a, te[0], escapes=te[1]), ts, x)
                row[f"speedup_{name_}"] = row["cublas_us"] / row[f"w12_{name_}_us"]
            pdl.ENABLED = False
            row["bitwise_equal"] = all(torch.equal(outs["off"], o) for o in outs.values())
            res["gemm"].append(row)
            print(json.dumps(row), flush=True)
        save()
        del w, t, esc, ts, ws
        torch.cuda.empty_cache()

    model = random_transformer("qwen3-8b", "cuda")
    for kind in ("bf16", "w12"):
        if kind == "w12":
            to_w12(model, inplace=True)
            torch.cuda.empty_cache()
        for name_, flag, style in VARIANTS[:2] if kind == "bf16" else VARIANTS:  # bf16: no W12 kernel, one "on"
            pdl.ENABLED, pdl.W12_STYLE = flag, style
            key = f"{kind}_{'on' if kind == 'bf16' and flag else name_}_ms"
            res["ar"][key] = measure_verify_ms(model, 512, (1, 33), repeats=20, static=True)
            print(key, res["ar"][key], flush=True)
            save()
    pdl.ENABLED = False
    ar = res["ar"]
    res["ar"]["w12_over_bf16_1row"] = {f"w12_{w}/bf16_{b}": ar[f"bf16_{b}_ms"][1] / ar[f"w12_{w}_ms"][1]
                                       for w in ("off", "start", "prefetch") for b in ("off", "on")}
    save()
    print("AR 1-row", res["ar"]["w12_over_bf16_1row"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
