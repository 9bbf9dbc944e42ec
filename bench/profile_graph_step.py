"""Where the time of one CUDA-graph exact pass goes (Qwen3-8B architecture, random bf16 weights, 512 prefix).

Profiles graph replays at 1 and 33 rows with the PyTorch profiler and writes the kernels' total CUDA time,
grouped by name, plus the sum of kernel times vs the wall time per replay. Output: JSON at argv[1].
"""

import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specpilot.engine.graphs import BucketRunner
from specpilot.engine.model import ModelArgs, Transformer, rope_inv_freq
from specpilot.provenance import git_commit, versions

dev = "cuda"
args = ModelArgs(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                 n_heads=32, n_kv_heads=8, head_dim=128, rope_theta=1e6, qk_norm=True, max_position_embeddings=4096)
with torch.device("meta"):
    m = Transformer(args)
m = m.to_empty(device=dev).to(torch.bfloat16)
with torch.no_grad():
    for p in m.parameters():
        p.normal_(0, 0.02)
m.inv_freq = rope_inv_freq(args).to(dev)
m.eval().requires_grad_(False)
L = 512
cache = m.new_cache(4096 + 256)
with torch.inference_mode():
    m(torch.randint(0, 1000, (L,), device=dev), torch.arange(L, device=dev), cache, 0)
runner = BucketRunner(m, cache, graphs=True)
out = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(), "prefix_len": L}
for r in (1, 33):
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
    out[f"rows_{r}"] = {"wall_ms_per_pass": wall, "kernel_ms_per_pass": kern_ms, "top": rows[:25]}
    print(r, round(wall, 3), round(kern_ms, 3), flush=True)
    for x in rows[:15]:
        print("   ", round(x["us_per_pass"], 1), x["calls"], x["name"][:90])
json.dump(out, open(sys.argv[1], "w"), indent=2)
