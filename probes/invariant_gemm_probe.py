"""The batch-invariant GEMM against cuBLAS on the Qwen3-8B projection shapes (bf16, one GPU).

For each shape and row count: median time of ``F.linear`` (cuBLAS) and of
:func:`specpilot.kernels.gemm.invariant_gemm` (CUDA events, 30 reps after warm-up; the weights of the smaller
shapes may sit partly in L2 between reps, as in a decode step they do not), and whether each row computed
among 2048 equals the row computed among 1, 32 or 224 (bitwise) for both. Writes ``OUT/invariant_gemm.json``.
Usage: python3 probes/invariant_gemm_probe.py OUT_DIR
"""

import json
import sys

import torch
import torch.nn.functional as F

from specpilot.kernels.gemm import invariant_config, invariant_gemm
from specpilot.provenance import git_commit, versions

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
ROWS = [1, 8, 32, 64, 128, 224, 512, 2048]


def ms(fn, reps=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main(out):
    torch.manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "versions": versions(), "commit": git_commit(), "shapes": {}}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(2048, k, device="cuda", dtype=torch.bfloat16)
        full_inv, full_cub = invariant_gemm(x, w), F.linear(x, w)
        r = {"config": invariant_config(n, k), "rows": {}}
        for m in ROWS:
            xm = x[:m].contiguous()
            inv_same = torch.equal(invariant_gemm(xm, w), full_inv[:m])
            cub_rows_same = int((F.linear(xm, w) == full_cub[:m]).all(dim=1).sum())
            r["rows"][m] = {"cublas_ms": ms(lambda: F.linear(xm, w)), "invariant_ms": ms(lambda: invariant_gemm(xm, w)),
                            "invariant_rows_equal_at_2048": inv_same, "cublas_rows_equal_at_2048": cub_rows_same}
            print(name, m, r["rows"][m], flush=True)
        res["shapes"][name] = r
        del w, x, full_inv, full_cub
    layers = 36  # Qwen3-8B: the four projections per layer plus one LM head, per row count
    res["pass_estimate_ms"] = {m: {kind: sum(res["shapes"][s]["rows"][m][f"{kind}_ms"] * (1 if s == "lm_head" else layers)
                                             for s in SHAPES) for kind in ("cublas", "invariant")} for m in ROWS}
    print(json.dumps(res["pass_estimate_ms"], indent=1))
    with open(f"{out}/invariant_gemm.json", "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
