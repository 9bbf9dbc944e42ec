"""GPU check of pipelined AR: the bundled target in bf16 on CUDA, AR through the graph runner with
steps queued ahead vs the plain step loop (forced by passing a profiler): identical tokens, and tokens/s
of both. JSON to argv[1]."""

import json
import sys
import time

import torch

from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.pilot.profiler import StepProfiler
from specpilot.pilot.setup import build_requests
from specpilot.provenance import git_commit, versions
from specpilot.zoo import bundled_target_dir

res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit()}
dep = Deployment(bundled_target_dir(), None, dtype="bfloat16", device="cuda")
prompts = [list(r.prompt_ids) for r in build_requests(dep, 2, 128)]
eng = dep.system(SystemConfig.ar(dtype="bfloat16"))
for p in prompts:  # warm-up: graphs, and every prompt length's eager prefill
    eng.generate(p, 4)
    eng.generate(p, 4, prof=StepProfiler("cuda"))
out = {}
for name, prof in (("pipelined", None), ("plain", "profiler")):
    toks, t = [], 0.0
    for p in prompts:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        g = eng.generate(p, 128, prof=StepProfiler("cuda") if prof else None)
        torch.cuda.synchronize()
        t += time.perf_counter() - t0
        toks.append(g.tokens)
    out[name] = toks
    res[name + "_tokens_per_s"] = sum(map(len, toks)) / t
res["identical_tokens"] = out["pipelined"] == out["plain"]
print(json.dumps(res), flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
