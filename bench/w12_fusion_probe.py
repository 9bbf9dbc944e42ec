"""The one-row W12 fusions (issue 5: ``specpilot.kernels.w12_swiglu`` and ``w12_addnorm``) side by side on the GPU:

    python bench/w12_fusion_probe.py OUT.json

1. The layer's tails at one row for Qwen3-8B, each from one CUDA graph cycling ≥ 512 MiB of weight copies:
   ``o`` then ``add_rmsnorm`` and ``silu_mul`` then ``down`` then ``add_rmsnorm``, with cuBLAS bf16, with the plain
   W12 GEMV, and fused (SwiGLU in the load; the add + norm in the GEMV's last program). The fused outputs are first
   compared with the unfused ones: ``new_x`` and the SwiGLU-only output bitwise, ``normed`` counted in differing
   elements (the square sums run over other warps).
2. The suite's section 3 (``specpilot.benchsuite.w12.ar_decode``): the engine's exact pass and pipelined AR
   decode of a random Qwen3-8B, bf16 against W12 with the fusions on and off.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from specpilot.benchsuite import w12 as suite
from specpilot.benchsuite.timing import time_calls
from specpilot.kernels import fused
from specpilot.kernels.w12_addnorm import w12_add_rmsnorm
from specpilot.kernels.w12_gemm import W12Linear, escape_table
from specpilot.kernels.w12_swiglu import w12_swiglu_down
from specpilot.provenance import git_commit, versions
from specpilot.w12.format import encode

dev = "cuda"
SHAPES = {"o/qwen3-8b": (4096, 4096, False), "down/qwen3-8b": (4096, 12288, True)}
EPS = 1e-6


def tail_times() -> list[dict]:
    out = []
    for name, (n, k, glu) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        t = encode(w, device=dev)
        layers = [W12Linear.from_w12(c, None) for c, _ in suite.copies_of(t, escape_table(t))]
        dense = [w] + [w.clone() for _ in range(-(-(512 << 20) // (w.numel() * 2)) - 1)]  # ≥ 512 MiB, as the W12 copies
        x = torch.randn(1, 2 * k if glu else k, device=dev, dtype=torch.bfloat16)
        res = torch.randn(1, n, device=dev, dtype=torch.bfloat16)
        nw = (1 + 0.1 * torch.randn(n, device=dev)).to(torch.bfloat16)
        act = fused.silu_mul if glu else (lambda a: a)
        plain = fused.add_rmsnorm(res, layers[0](act(x)), nw, EPS)
        got = w12_add_rmsnorm(x, layers[0], res, nw, EPS, glu=glu)
        row = {"proj": name, "n": n, "k": k, "glu": glu, "new_x_bitwise": bool(torch.equal(got[1], plain[1])),
               "normed_elements_differing": int((got[0] != plain[0]).sum()),
               "normed_max_abs_diff": float((got[0].float() - plain[0].float()).abs().max()),
               "deterministic": all(torch.equal(a, b) for a, b in zip(w12_add_rmsnorm(x, layers[0], res, nw, EPS,
                                                                                      glu=glu), got)),
               "cublas_us": time_calls(lambda a, wt: fused.add_rmsnorm(res, F.linear(act(a), wt), nw, EPS), dense, x,
                                       reps=4),
               "w12_unfused_us": time_calls(lambda a, lay: fused.add_rmsnorm(res, lay(act(a)), nw, EPS), layers, x,
                                            reps=4),
               "w12_fused_us": time_calls(lambda a, lay: w12_add_rmsnorm(a, lay, res, nw, EPS, glu=glu), layers, x,
                                          reps=4),
               "add_rmsnorm_us": time_calls(lambda a, _: fused.add_rmsnorm(res, a, nw, EPS), layers[:1], res, reps=64)}
        if glu:
            row["swiglu_only_bitwise"] = bool(torch.equal(w12_swiglu_down(x, layers[0]), layers[0](act(x))))
            row["w12_swiglu_only_us"] = time_calls(
                lambda a, lay: fused.add_rmsnorm(res, w12_swiglu_down(a, lay), nw, EPS), layers, x, reps=4)
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
          a["decode_speedup_unfused"], flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not torch.cuda.is_available():
        raise SystemExit("usage: python bench/w12_fusion_probe.py OUT.json  (needs a CUDA GPU)")
    main(sys.argv[1])
