"""The exact pass of the Qwen3-8B architecture (random bf16 weights) replayed as CUDA graphs.

Times, at a 512-token prefix, one exact pass (forward + LM head + argmax) per row bucket through the
static path as a CUDA graph, against the eager dynamic path; then AR decoding through the engine with
graphs. Writes JSON to argv[1].
"""

import json
import sys
import time

import torch

from specpilot.config import SystemConfig
from specpilot.engine.engine import Engine
from specpilot.engine.runner import BucketRunner
from specpilot.zoo.random_ckpt import random_transformer
from specpilot.provenance import git_commit, versions

dev = "cuda"
out = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(),
       "model": "qwen3-8b architecture, random bf16 weights", "prefix_len": 512}
m = random_transformer("qwen3-8b", dev)
out["weight_bytes"] = sum(p.numel() * p.element_size() for p in m.parameters())


def cuda_ms(fn, n=30, warm=5):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


L = 512
cache = m.new_cache(4096 + 256)
with torch.inference_mode():
    m(torch.randint(0, 1000, (L,), device=dev), torch.arange(L, device=dev), cache, 0)
runner = BucketRunner(m, cache, graphs=True, output="argmax")
graph_ms, eager_ms = {}, {}
for r in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256):
    toks = torch.randint(0, 1000, (r,)).tolist()
    pos = list(range(L, L + r))
    mask = torch.ones(r, r, dtype=torch.bool).tril()
    t0 = time.perf_counter()
    runner.run(toks, pos, L, mask)
    torch.cuda.synchronize()
    graph_ms[r] = {"capture_s": time.perf_counter() - t0,
                   "ms": cuda_ms(lambda: runner.run(toks, pos, L, mask).tolist())}
    if r in (1, 8, 33, 64, 256) or r == 32:
        tt = torch.tensor(toks, device=dev)
        pp = torch.tensor(pos, device=dev)
        full = torch.ones(r, L + r, dtype=torch.bool, device=dev)
        with torch.inference_mode():
            eager_ms[r] = cuda_ms(lambda: m.logits(m(tt, pp, cache, L, full)).argmax(-1).tolist(), n=10)
    print(r, graph_ms[r], eager_ms.get(r), flush=True)
out["graph_pass_ms"] = graph_ms
out["eager_pass_ms"] = eager_ms
out["c_graph"] = {r: v["ms"] / graph_ms[1]["ms"] for r, v in graph_ms.items()}

# AR decoding through the engine (graphs on), 512-token prompt, 128 new tokens
eng = Engine(m, SystemConfig.ar(dtype="bfloat16"), None, eos_ids=[], buckets=True)
prompt = torch.randint(0, 1000, (512,)).tolist()
eng.generate(prompt, 16)
torch.cuda.synchronize()
g = eng.generate(prompt, 128)
out["ar_engine_graphs"] = {"tokens_per_s": g.tokens_per_s, "time_s": g.time_s, "prefill_s": g.prefill_s,
                           "decode_ms_per_step": 1e3 * (g.time_s - g.prefill_s) / g.steps}
eng2 = Engine(m, SystemConfig.ar(dtype="bfloat16"), None, eos_ids=[], buckets=False)
g2 = eng2.generate(prompt, 32)
out["ar_engine_eager"] = {"decode_ms_per_step": 1e3 * (g2.time_s - g2.prefill_s) / g2.steps}
out["ar_graph_tokens_equal_eager_prefix"] = g.tokens[:32] == g2.tokens
print(json.dumps(out, indent=1))
json.dump(out, open(sys.argv[1], "w"), indent=2)
