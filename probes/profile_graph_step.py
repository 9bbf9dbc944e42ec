"""Where the time of one CUDA-graph exact pass goes (Qwen3-8B architecture, random bf16 weights, 512 prefix).

Profiles graph replays at 1 and 33 rows with the PyTorch profiler and writes the kernels' total CUDA time,
grouped by name, plus the sum of kernel times vs the wall time per replay. Output: JSON at argv[1].

    python probes/profile_graph_step.py OUT.json          # bf16 projections (cuBLAS)
    python probes/profile_graph_step.py OUT.json --w12    # then the same model with W12 projections, in
                                                         # the same process: keys rows_N and w12_rows_N
"""

import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specpilot.engine.runner import BucketRunner
from specpilot.zoo.random_ckpt import random_transformer
from specpilot.provenance import git_commit, versions

if len(sys.argv) < 2 or sys.argv[1].startswith("-") or any(a != "--w12" for a in sys.argv[2:]):
    sys.exit("usage: python probes/profile_graph_step.py OUT.json [--w12]")
if not torch.cuda.is_available():
    sys.exit("profile_graph_step: needs a CUDA GPU")
dev = "cuda"
m = random_transformer("qwen3-8b", dev)
L = 512
cache = m.new_cache(4096 + 256)
with torch.inference_mode():
    m(torch.randint(0, 1000, (L,), device=dev), torch.arange(L, device=dev), cache, 0)
out = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(), "prefix_len": L}
kinds = ["", "w12_"] if "--w12" in sys.argv[2:] else [""]
for kind, r in [(k, r) for k in kinds for r in (1, 33)]:
    if kind == "w12_" and r == 1:
        from specpilot.w12.convert import to_w12

        del runner
        to_w12(m, inplace=True)
        torch.cuda.empty_cache()
    if r == 1:
        runner = BucketRunner(m, cache, graphs=True)
    toks, pos = list(range(r)), list(range(L, L + r))
    mask = torch.ones(r, r, dtype=torch.bool).tril()
    for _ in range(3):
        runner.run(toks, pos, L, mask).tolist()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        runner.run(toks, pos, L, mask).tolist()
    wall = (time.perf_counter() - t0) / 20 * 1e3
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            runner.run(toks, pos, L, mask).tolist()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0 and e.device_type.name == "CUDA" if hasattr(e, "device_type") else t > 0:
            rows.append({"name": e.key[:120], "calls": e.count // 5, "us_per_pass": t / 5})
    rows.sort(key=lambda x: -x["us_per_pass"])
    kern_ms = sum(x["us_per_pass"] for x in rows) / 1e3
    out[f"{kind}rows_{r}"] = {"wall_ms_per_pass": wall, "kernel_ms_per_pass": kern_ms, "top": rows[:25]}
    print(kind, r, round(wall, 3), round(kern_ms, 3), flush=True)
    for x in rows[:15]:
        print("   ", round(x["us_per_pass"], 1), x["calls"], x["name"][:90])
json.dump(out, open(sys.argv[1], "w"), indent=2)
