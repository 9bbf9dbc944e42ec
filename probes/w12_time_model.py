"""A two-term time model of W12 and cuBLAS per row count, fitted to a ``probes/w12_bench.py`` result (issue 5):
``t = fixed + bytes / bandwidth`` over the eight projection shapes, and what it says about 1.25x.

    python probes/w12_time_model.py results/w12_bench_h200_2026-12-01_session9.json OUT.json

Bytes are the weights read: 2 a weight for bf16, 1.5 for W12 (12 bits; escapes and record padding ignored,
< 0.1%). Least squares per row count and kernel; ``needed_fixed_us`` is the fixed cost W12 would need, at its
fitted bandwidth, to reach 1.25x cuBLAS's measured time on each Qwen3-8B shape (negative or below cuBLAS's own
fixed cost: out of reach for a kernel that pays cuBLAS's fixed cost; session 12's ``probes/read_floor.py`` measured a
plain read's fixed cost at 1.9 µs, well below cuBLAS's 4.4, so that reading of it was too strict); ``ratio_at_cublas_fixed_cost`` is the model's W12
speedup over cuBLAS (cuBLAS time / W12 time) if W12 had cuBLAS's fixed cost and its own fitted bandwidth. At one
row the W12 fit blends two kernels (the GEMV on short-K / very wide shapes, the tensor-core kernel elsewhere; see
``one_row_gemv``). No GPU needed: it reads measured figures only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

SHAPES = {"qwen3-8b/qkv": (6144, 4096), "qwen3-8b/o": (4096, 4096), "qwen3-8b/gate_up": (24576, 4096),
          "qwen3-8b/down": (4096, 12288), "qwen3-32b/qkv": (10240, 5120), "qwen3-32b/o": (5120, 8192),
          "qwen3-32b/gate_up": (51200, 5120), "qwen3-32b/down": (5120, 25600)}
TARGET = 1.25


def fit(mb: np.ndarray, us: np.ndarray) -> dict:
    """Least-squares ``us = fixed + mb * slope``: ``{fixed_us, tb_per_s, max_rel_residual}`` (MB = 1e6 bytes, so
    1 / slope is in TB/s)."""
    a = np.vstack([np.ones_like(mb), mb]).T
    (fixed, slope), *_ = np.linalg.lstsq(a, us, rcond=None)
    resid = np.abs(a @ np.array([fixed, slope]) - us) / us
    return {"fixed_us": float(fixed), "tb_per_s": float(1.0 / slope), "max_rel_residual": float(resid.max())}


def model(bench: dict) -> dict:
    """The fits and the 1.25x requirement per row count (module docstring). Raises KeyError on a result without
    ``gemm`` rows."""
    out = {}
    for m in sorted({g["rows"] for g in bench["gemm"]}):
        rows = [g for g in bench["gemm"] if g["rows"] == m and g["proj"] in SHAPES]
        mb = np.array([SHAPES[g["proj"]][0] * SHAPES[g["proj"]][1] * 2 / 1e6 for g in rows])
        cub, w12 = fit(mb, np.array([g["cublas_us"] for g in rows])), fit(0.75 * mb, np.array([g["w12_us"] for g in rows]))
        need = {}
        for g, b in zip(rows, mb):
            if g["proj"].startswith("qwen3-8b"):
                goal = g["cublas_us"] / TARGET
                best = (cub["fixed_us"] + b / cub["tb_per_s"]) / (cub["fixed_us"] + 0.75 * b / w12["tb_per_s"])
                need[g["proj"]] = {"cublas_us": g["cublas_us"], "w12_us": g["w12_us"], "goal_us": goal,
                                   "needed_fixed_us": goal - 0.75 * b / w12["tb_per_s"],  # MB / (TB/s) = µs
                                   "ratio_at_cublas_fixed_cost": best}
        out[str(m)] = {"cublas": cub, "w12": w12, "qwen3_8b_at_1_25x": need}
    return out


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    bench = json.loads(Path(sys.argv[1]).read_text())
    res = {"source": sys.argv[1], "source_commit": bench.get("commit"), "device": bench.get("device"),
           "method": __doc__.strip().splitlines()[0], "rows": model(bench)}
    Path(sys.argv[2]).write_text(json.dumps(res, indent=1) + "\n")
    for m, r in res["rows"].items():
        print(f"{m:>4} rows: cuBLAS {r['cublas']['fixed_us']:.2f} µs + {r['cublas']['tb_per_s']:.2f} TB/s; "
              f"W12 {r['w12']['fixed_us']:.2f} µs + {r['w12']['tb_per_s']:.2f} TB/s; W12 fixed cost needed for "
              + ", ".join(f"{p.split('/')[1]} {v['needed_fixed_us']:.1f} (ratio at cuBLAS's fixed cost "
                          f"{v['ratio_at_cublas_fixed_cost']:.2f})" for p, v in r["qwen3_8b_at_1_25x"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
