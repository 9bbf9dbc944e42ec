"""The residual add + RMSNorm split across the one-row W12 GEMVs (issue 5, ``specpilot.w12.norm``), side by
side on the GPU:

    python probes/w12_norm_probe.py OUT.json

1. The attention block's tail at one row for Qwen3-8B (attention output ``[1, 4096]`` -> o -> add + norm -> gate_up),
   each variant from one CUDA graph cycling ≥ 512 MiB of weight copies: cuBLAS bf16 + ``add_rmsnorm``, the W12
   GEMVs + ``add_rmsnorm``, and the fused pair (``w12_add_residual`` then ``w12_norm_in``). Checked first: the fused
   residual stream is bitwise ``add_rmsnorm``'s, and the fused gate_up output's difference from the unfused one.
2. The suite's section 3 (``specpilot.bench.w12.ar_decode``): the engine's exact pass and pipelined AR decode
   of a random Qwen3-8B, bf16 against W12 with the norm fusion on and off (and the SwiGLU fusion off).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from specpilot.bench import w12 as suite
from specpilot.bench.timing import time_graph
from specpilot.kernels import fused
from specpilot.w12.gemm import W12Linear, escape_table
from specpilot.w12.norm import w12_add_residual, w12_norm_in
from specpilot.provenance import git_commit, versions
from specpilot.w12.format import encode

dev = "cuda"
HIDDEN, GATE_UP = 4096, 2 * 12288
EPS = 1e-6


def tail_times(reps: int = 4) -> dict:
    """µs of o -> add + norm -> gate_up at one row, three ways, cycling weight copies."""
    w_o = torch.randn(HIDDEN, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02
    w_gu = torch.randn(GATE_UP, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02
    t_o, t_gu = encode(w_o, device=dev), encode(w_gu, device=dev)
    o_layers = [W12Linear.from_w12(c, None) for c, _ in suite.copies_of(t_o, escape_table(t_o), 256 << 20)]
    gu_layers = [W12Linear.from_w12(c, None) for c, _ in suite.copies_of(t_gu, escape_table(t_gu), 512 << 20)]
    pairs = list(zip(o_layers * (len(gu_layers) // len(o_layers) + 1), gu_layers))
    copies = -(-(512 << 20) // ((w_o.numel() + w_gu.numel()) * 2))
    dense = [(w_o, w_gu)] + [(w_o.clone(), w_gu.clone()) for _ in range(copies - 1)]
    a = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    x = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16) * 4
    norm_w = (1 + 0.1 * torch.randn(HIDDEN, device=dev)).to(torch.bfloat16)

    def unfused(lo, lg):
        h, nx = fused.add_rmsnorm(x, lo(a), norm_w, EPS)
        return nx, lg(h)

    def fused_pair(lo, lg):
        nx, sq = w12_add_residual(a, lo, x)
        return nx, w12_norm_in(nx, sq, norm_w, EPS, lg)

    def cublas(wo, wg):
        h, nx = fused.add_rmsnorm(x, F.linear(a, wo), norm_w, EPS)
        return nx, F.linear(h, wg)

    nx_u, gu_u = unfused(*pairs[0])
    nx_f, gu_f = fused_pair(*pairs[0])
    diff = (gu_f.float() - gu_u.float()).abs()
    row = {"residual_bitwise_equal": bool(torch.equal(nx_u, nx_f)),
           "gate_up_bitwise_equal": bool(torch.equal(gu_u, gu_f)),
           "gate_up_differing_elements": int((gu_u != gu_f).sum()), "gate_up_elements": gu_u.numel(),
           "gate_up_max_abs_diff": diff.max().item(), "gate_up_max_abs": gu_u.float().abs().max().item(),
           "deterministic": all(torch.equal(u, v) for u, v in zip(fused_pair(*pairs[0]), (nx_f, gu_f))),
           "cublas_us": time_graph([lambda p=p: cublas(*p) for _ in range(reps) for p in dense]),
           "w12_unfused_us": time_graph([lambda p=p: unfused(*p) for _ in range(reps) for p in pairs]),
           "w12_fused_us": time_graph([lambda p=p: fused_pair(*p) for _ in range(reps) for p in pairs]),
           "add_rmsnorm_us": time_graph([lambda: fused.add_rmsnorm(x, a, norm_w, EPS) for _ in range(64)])}
    row["fused_vs_unfused"] = row["w12_unfused_us"] / row["w12_fused_us"]
    row["fused_vs_cublas"] = row["cublas_us"] / row["w12_fused_us"]
    print(row, flush=True)
    return row


def main(path: str) -> None:
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit()}
    res["tail"] = tail_times()
    torch.cuda.empty_cache()
    json.dump(res, open(path, "w"), indent=1)
    res["ar_decode"] = suite.ar_decode()
    json.dump(res, open(path, "w"), indent=1, default=str)
    a = res["ar_decode"]
    print("decode tokens/s", a["decode_tokens_per_s"], "speedup", a["decode_speedup"], "norm unfused",
          a["decode_speedup_norm_unfused"], "swiglu unfused", a["decode_speedup_swiglu_unfused"], flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not torch.cuda.is_available():
        raise SystemExit("usage: python probes/w12_norm_probe.py OUT.json  (needs a CUDA GPU)")
    main(sys.argv[1])
