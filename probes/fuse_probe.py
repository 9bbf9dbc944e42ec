"""Fused vs separate q/k/v and gate/up projections: CUDA-graph exact pass of the Qwen3-8B shape (random bf16),
512-token prefix, by rows. Same random weights in both. Writes JSON to argv[1]."""

import json
import sys

import torch

from specpilot.engine.runner import BucketRunner
from specpilot.provenance import git_commit, versions
from specpilot.zoo.random_ckpt import random_transformer

out = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(), "prefix_len": 512}
L = 512
for fuse in (False, True):
    m = random_transformer("qwen3-8b", "cuda", fuse=fuse)
    cache = m.new_cache(1024)
    with torch.inference_mode():
        m(torch.randint(0, 1000, (L,), device="cuda"), torch.arange(L, device="cuda"), cache, 0)
    runner = BucketRunner(m, cache, (1, 8, 32, 64))
    res = {}
    for r in (1, 8, 32, 64):
        toks, pos = list(range(r)), list(range(L, L + r))
        for _ in range(3):
            runner.run(toks, pos, L, None).tolist()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(30):
            runner.run(toks, pos, L, None)
        b.record()
        torch.cuda.synchronize()
        res[r] = a.elapsed_time(b) / 30
    out["fused" if fuse else "separate"] = res
    print(fuse, res, flush=True)
    del m, cache, runner
    torch.cuda.empty_cache()
json.dump(out, open(sys.argv[1], "w"), indent=2)
