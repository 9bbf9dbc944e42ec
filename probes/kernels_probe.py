"""The fused kernels on the GPU: the skinny GEMM vs cuBLAS per Qwen3-8B projection, and the exact pass with
fused kernels vs op by op (CUDA graphs, 512-token prefix, random bf16 weights), plus a profile of the fused pass.

    python probes/kernels_probe.py OUT.json [--sweep]

GEMM timing: one CUDA graph of many calls cycling through enough weight copies (≥ 512 MiB) that nothing
is served from L2, as in a real pass where every layer's weights are distinct; µs per call and the
bandwidth of the weight bytes. ``--sweep`` also times a grid of launch configurations (to tune
``gemm.default_config``).
"""

import dataclasses
import itertools
import json
import sys
import time

import torch
import torch.nn.functional as F

from specpilot.engine.runner import BUCKETS, BucketRunner
from specpilot.kernels import gemm
from specpilot.pilot.kernel_profile import profile_kernels
from specpilot.pilot.setup import measure_verify_ms
from specpilot.provenance import git_commit, versions
from specpilot.zoo.random_ckpt import random_transformer

from specpilot.bench.timing import time_calls

dev = "cuda"
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
ROWS = (1, 8, 16, 32, 48, 64)



def gemm_table(sweep: bool) -> list[dict]:
    rows = []
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(1, -(-(512 << 20) // nbytes))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x, ws[0]).float()
            got = gemm.skinny_gemm(x, ws[0]).float()
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            cub = time_calls(lambda a, w: F.linear(a, w), ws, x)
            ours = time_calls(lambda a, w: gemm.skinny_gemm(a, w), ws, x)
            row = {"proj": name, "n": n, "k": k, "rows": m, "cublas_us": cub, "skinny_us": ours,
                   "speedup": cub / ours, "cublas_TBps": nbytes / cub / 1e6, "skinny_TBps": nbytes / ours / 1e6,
                   "rel_err_vs_cublas": err, "config": gemm.default_config(m, n, k)}
            if sweep and m in (1, 64):
                grid = []
                for bn, bk, split, st in itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8), (3, 5)):
                    if (k // bk) % split or (k // bk) // split < 2:
                        continue
                    try:
                        us = time_calls(lambda a, w: gemm.skinny_gemm(a, w, block_n=bn, block_k=bk, split_k=split,
                                                                     num_stages=st), ws, x, reps=4)
                    except Exception as exc:  # out of shared memory etc.
                        grid.append({"block_n": bn, "block_k": bk, "split_k": split, "stages": st, "error": str(exc)[:80]})
                        continue
                    grid.append({"block_n": bn, "block_k": bk, "split_k": split, "stages": st, "us": us})
                ok = sorted((c for c in grid if "us" in c), key=lambda c: c["us"])
                row["sweep_best"] = ok[:5]
            rows.append(row)
            print(json.dumps({k_: v for k_, v in row.items() if k_ != "sweep_best"}), flush=True)
            if "sweep_best" in row:
                print("   best:", row["sweep_best"][:3], flush=True)
        del ws
        torch.cuda.empty_cache()
    return rows


def pass_variants(model) -> dict:
    """Exact-pass ms by rows (engine buckets, graphs) for the kernel variants."""
    import importlib

    ta = importlib.import_module("specpilot.kernels.tree_attention")

    rows = tuple(sorted({*BUCKETS, 33}))
    real_cfg = ta.default_config

    def few_splits(r, g, kvh, s, d, num_sms=132):
        cfg = real_cfg(r, g, kvh, s, d, num_sms)
        return cfg | {"num_splits": 1} if r * g >= 64 else cfg

    out = {}
    default = model.kernels
    for name, kernels, skinny, attn_cfg in (("op_by_op", False, False, real_cfg), ("fused_cublas", True, False, real_cfg),
                                            ("fused_skinny", True, True, real_cfg),
                                            ("fused_cublas_attn_nosplit_m64", True, False, few_splits)):
        model.kernels = dataclasses.replace(default, fused=kernels, skinny_gemm=skinny)
        ta.default_config = attn_cfg
        t0 = time.time()
        out[name] = measure_verify_ms(model, 512, rows, repeats=20, static=True)
        print(name, {r: round(v, 3) for r, v in out[name].items()}, f"({time.time() - t0:.0f} s)", flush=True)
        torch.cuda.empty_cache()
    model.kernels, ta.default_config = default, real_cfg
    return out


def profile_pass(model, rows: int) -> dict:
    cache = model.new_cache(512 + 256 + 1)
    with torch.inference_mode():
        model(torch.randint(0, 1000, (512,), device=dev), torch.arange(512, device=dev), cache, 0)
    runner = BucketRunner(model, cache, graphs=True)
    toks, pos = list(range(rows)), list(range(512, 512 + rows))
    mask = torch.ones(rows, rows, dtype=torch.bool).tril()
    return {"rows": rows} | profile_kernels(lambda: runner.run(toks, pos, 512, mask).tolist()).to_dict()


def main():
    out_path = sys.argv[1]
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(), "prefix_len": 512}
    res["gemm"] = gemm_table("--sweep" in sys.argv)
    json.dump(res, open(out_path, "w"), indent=1)
    model = random_transformer("qwen3-8b", dev)
    res["pass_ms"] = pass_variants(model)
    res["c"] = {v: {r: t / d[1] for r, t in d.items()} for v, d in res["pass_ms"].items()}
    json.dump(res, open(out_path, "w"), indent=1)
    res["profile"] = [profile_pass(model, r) for r in (1, 2, 33, 64)]
    for p in res["profile"]:
        print("profile", p["rows"], "wall", round(p["wall_ms"], 3), "kernels", round(p["kernel_ms"], 3),
              "n", p["kernels"], {k: round(v, 3) for k, v in p["by_class_ms"].items()}, flush=True)
    json.dump(res, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
