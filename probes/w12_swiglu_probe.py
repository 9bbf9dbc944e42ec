"""SwiGLU in the W12 down projection's load (issue 5, ``specpilot.w12.swiglu``), side by side on the GPU:

    python probes/w12_swiglu_probe.py OUT.json

1. The MLP's tail at one row for Qwen3-8B ``down`` (``gate_up [1, 2I]`` in, ``[1, hidden]`` out), each
   from one CUDA graph cycling ≥ 512 MiB of weight copies: ``silu_mul`` + cuBLAS bf16, ``silu_mul`` + the W12
   GEMV, and the fused W12 GEMV. The fused output is first checked bitwise against ``silu_mul`` + the GEMV.
2. The suite's section 3 (``specpilot.bench.w12.ar_decode``): the engine's exact pass and pipelined AR
   decode of a random Qwen3-8B, bf16 against W12 with the fusion on and off.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from specpilot.bench import w12 as suite
from specpilot.bench.timing import time_calls
from specpilot.kernels import fused
from specpilot.w12.gemm import W12Linear, escape_table, w12_gemm
from specpilot.w12.swiglu import w12_swiglu_down
from specpilot.provenance import git_commit, versions
from specpilot.w12.format import encode

dev = "cuda"
SHAPES = {"down/qwen3-8b": (4096, 12288)}  # 32B down goes to the tensor cores at one row: nothing to fuse into


def tail_times() -> list[dict]:
    out = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        t = encode(w, device=dev)
        layers = [W12Linear.from_w12(c, None) for c, _ in suite.copies_of(t, escape_table(t))]
        dense = [w] + [w.clone() for _ in range(-(-(512 << 20) // (w.numel() * 2)) - 1)]  # ≥ 512 MiB, as the W12 copies
        gu = torch.randn(1, 2 * k, device=dev, dtype=torch.bfloat16)
        want = w12_gemm(fused.silu_mul(gu), t)
        got = w12_swiglu_down(gu, layers[0])
        row = {"proj": name, "n": n, "k": k, "bitwise_equal": bool(torch.equal(got, want)),
               "deterministic": bool(torch.equal(w12_swiglu_down(gu, layers[0]), got)),
               "cublas_us": time_calls(lambda a, wt: F.linear(fused.silu_mul(a), wt), dense, gu, reps=4),
               "w12_unfused_us": time_calls(lambda a, lay: lay(fused.silu_mul(a)), layers, gu, reps=4),
               "w12_fused_us": time_calls(lambda a, lay: w12_swiglu_down(a, lay), layers, gu, reps=4),
               "silu_mul_us": time_calls(lambda a, _: fused.silu_mul(a), layers[:1], gu, reps=64)}
        row["fused_vs_unfused"] = row["w12_unfused_us"] / row["w12_fused_us"]
        row["fused_vs_cublas"] = row["cublas_us"] / row["w12_fused_us"]
        print(row, flush=True)
        out.append(row)
        del layers, dense, w, t
        torch.cuda.empty_cache()
    return out


def main(path: str) -> None:
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit()}
    res["tail"] = tail_times()
    json.dump(res, open(path, "w"), indent=1)
    res["ar_decode"] = suite.ar_decode()
    json.dump(res, open(path, "w"), indent=1, default=str)
    a = res["ar_decode"]
    print("decode tokens/s", a["decode_tokens_per_s"], "speedup fused", a["decode_speedup"], "unfused",
          a["decode_speedup_swiglu_unfused"], flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not torch.cuda.is_available():
        raise SystemExit("usage: python probes/w12_swiglu_probe.py OUT.json  (needs a CUDA GPU)")
    main(sys.argv[1])
