"""GPU smoke and baseline timing before the CUDA-graph work: the engine on CUDA in bf16.

1. The bundled pair on CUDA bf16: AR vs speculative tokens (near-ties may flip in bf16) and tokens/s.
2. Qwen3-8B architecture with random bf16 weights in our eager engine: exact-pass ms by rows at a 512-token
   prefix, and the CUDA-event step profile by kernel class.
Writes one JSON object to the path given as argv[1].
"""

import json
import sys
import time

import torch

from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.pilot.profiler import StepProfiler, measure_peaks
from specpilot.zoo.random_ckpt import random_transformer
from specpilot.provenance import git_commit, versions
from specpilot.zoo import bundled_drafter_dir, bundled_target_dir

out = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit()}
dev = "cuda"


def timed(fn, n=20, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


# 1. bundled pair
try:
    dep = Deployment(bundled_target_dir(), bundled_drafter_dir(), dtype="bfloat16", device=dev)
    ids = dep.tokenizer("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", add_special_tokens=False)["input_ids"]
    res = {}
    ar = dep.system(SystemConfig.ar(dtype="bfloat16")).generate(ids, 128)
    ar = dep.system(SystemConfig.ar(dtype="bfloat16")).generate(ids, 128)
    res["ar"] = {"tokens_per_s": ar.tokens_per_s}
    for cfg in [SystemConfig.stock("ngram", dtype="bfloat16"), SystemConfig.stock("draft_model", dtype="bfloat16"),
                SystemConfig(drafter="draft_model", tree="best_first", nodes=16, depth=6, top_k=4, dtype="bfloat16")]:
        eng = dep.system(cfg)
        eng.generate(ids, 128)
        g = eng.generate(ids, 128)
        first_diff = next((i for i, (a, b) in enumerate(zip(g.tokens, ar.tokens)) if a != b), None)
        res[cfg.label()] = {"tokens_per_s": g.tokens_per_s, "tau": g.tau, "equal_to_ar": g.tokens == ar.tokens,
                            "first_diff": first_diff}
    out["bundled_bf16"] = res
except Exception as e:  # report, keep going
    out["bundled_bf16_error"] = repr(e)

# 2. Qwen3-8B architecture, random weights
try:
    m = random_transformer("qwen3-8b", dev)
    wbytes = sum(p.numel() * p.element_size() for p in m.parameters())
    peaks = measure_peaks(dev, torch.bfloat16, seconds_budget=2.0)
    out["peaks"] = peaks.to_dict()
    out["weight_bytes"] = wbytes
    out["byte_floor_ms_at_peak_bw"] = wbytes / peaks.bytes_per_s * 1e3
    L = 512
    cache = m.new_cache(L + 300)
    with torch.inference_mode():
        m(torch.randint(0, 1000, (L,), device=dev), torch.arange(L, device=dev), cache, 0)
        rows = {}
        for r in (1, 8, 16, 33, 64, 128, 256):
            toks = torch.randint(0, 1000, (r,), device=dev)
            pos = L + torch.arange(r, device=dev)
            mask = torch.ones(r, L + r, dtype=torch.bool, device=dev)
            rows[r] = timed(lambda: m.logits(m(toks, pos, cache, L, mask)).argmax(-1))
        out["eager_pass_ms_by_rows"] = rows
        out["eager_c"] = {r: v / rows[1] for r, v in rows.items()}
        prof = StepProfiler(dev)
        toks = torch.randint(0, 1000, (33,), device=dev)
        pos = L + torch.arange(33, device=dev)
        mask = torch.ones(33, L + 33, dtype=torch.bool, device=dev)
        for _ in range(3):
            m.logits(m(toks, pos, cache, L, mask, prof=prof), prof=prof)
        prof.reset()
        for _ in range(5):
            m.logits(m(toks, pos, cache, L, mask, prof=prof), prof=prof)
        out["profile_33_rows_ms_per_pass"] = {k: v / 5 for k, v in prof.totals_ms().items()}
except Exception as e:
    out["qwen3_8b_error"] = repr(e)

json.dump(out, open(sys.argv[1], "w"), indent=2)
print(json.dumps(out, indent=1)[:6000])
