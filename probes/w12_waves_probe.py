"""Wave quantization of the W12 tensor-core kernel: the default launch against the same launch with the registers
capped (``maxnreg``), beside cuBLAS bf16, on the Qwen3-32B and -8B projections at 8 / 16 / 32 rows (issue 5).

    python probes/w12_waves_probe.py OUT.json [PREFIX ...]     # projections whose names start so (default: 32B, 8B)

Why: session 17's final suite read Qwen3-32B gate_up at 1.02x cuBLAS at 8 rows and 0.91x at 32 (1.22x / 1.04x in its
first run), unexplained. Offline ptxas (sm_90a) puts the kernel at 86 registers at 8–16 rows, so an SM holds 5
four-warp programs (88 × 128 × 5 ≤ 65536 < 88 × 128 × 6): 660 on 132 SMs, while 32B gate_up launches 800 (split 1),
and a second wave of 140 programs, each streaming all of K, runs nearly alone. At 80 registers (no spills, offline)
an SM holds 6 (792). This times the default, no cap (``maxnreg=0``) and caps at 96 / 80 / 72; ``maxnreg`` changes register allocation only, so the outputs must be bitwise
equal (checked), and the default's within the rounding bound of the reference. Timing as in ``probes/w12_bench.py``;
weights from a fixed seed.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from specpilot.w12.gemm import default_config, w12_gemm
from specpilot.provenance import git_commit, versions

from timing import time_calls  # noqa: E402  (probes/timing.py)
from w12_bench import bits_equal, check, codes, prefix_cli, projection_copies, write_result  # noqa: E402

dev = "cuda"
CAPS = (0, 96, 80, 72)  # 0: no cap (the default caps some launches: default_config's maxnreg)


def main(out_path: str, prefixes: tuple = ("qwen3-32b", "qwen3-8b")) -> dict:
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(),
           "sms": torch.cuda.get_device_properties(0).multi_processor_count, "rows": []}
    for prefix in prefixes:
        for name, n, k, w, t, esc, ts, ws in projection_copies(prefix, seed=0):
            g = torch.Generator(device=dev).manual_seed(n + 5 * k)
            aw = w.float().abs() + codes(t).abs()
            for m in (8, 16, 32):
                x = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
                cfg = default_config(m, n, k)
                ref = w12_gemm(x, t, escapes=esc)
                row = {"proj": name, "rows": m, "programs": -(-n // cfg["block_n"]) * cfg["split_k"] * -(-m // cfg["block_m"]),
                       "config": cfg, "cublas_us": time_calls(lambda a, w_: F.linear(a, w_), ws, x),
                       "default": check(ref, x, t, aw)}
                row["default"]["us"] = time_calls(lambda a, te: w12_gemm(a, te[0], escapes=te[1]), ts, x)
                row["default"]["speedup"] = row["cublas_us"] / row["default"]["us"]
                for cap in CAPS:
                    same = bits_equal(w12_gemm(x, t, escapes=esc, maxnreg=cap), ref)
                    us = time_calls(lambda a, te, c=cap: w12_gemm(a, te[0], escapes=te[1], maxnreg=c), ts, x)
                    row[f"maxnreg{cap}"] = {"us": us, "bitwise_default": same, "speedup": row["cublas_us"] / us,
                                            "vs_default": row["default"]["us"] / us}
                res["rows"].append(row)
                print(name, m, row["programs"], f"cublas {row['cublas_us']:.2f} default {row['default']['us']:.2f} "
                      f"({row['default']['speedup']:.3f}x)",
                      " ".join(f"cap{c} {row[f'maxnreg{c}']['us']:.2f} ({row[f'maxnreg{c}']['speedup']:.3f}x)" for c in CAPS),
                      "ok" if row["default"]["within_bound"] and all(row[f"maxnreg{c}"]["bitwise_default"] for c in CAPS)
                      else "MISMATCH", flush=True)
            write_result(res, t0, out_path)
            del w, t, esc, aw, ts, ws
            torch.cuda.empty_cache()
    return write_result(res, t0, out_path)


if __name__ == "__main__":
    main(*prefix_cli(sys.argv, "w12_waves_probe.py", ("qwen3-32b", "qwen3-8b")))
