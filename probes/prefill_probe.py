"""Prefill time by prompt length on CUDA (bf16, bundled target and Qwen3-8B shape): first call of each new
length vs a repeat, to see per-shape plan building on the eager prefill path. JSON to argv[1]."""

import json
import sys
import time

import torch

from specpilot.model.checkpoint import load_model
from specpilot.provenance import git_commit, versions
from specpilot.zoo import bundled_target_dir

res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(), "rows": []}
m = load_model(bundled_target_dir(), "bfloat16", "cuda")
cache = m.new_cache(2048)
import contextlib

import specpilot.model.layers as model_mod  # the attention layer enters sdpa_backends per call

ours = model_mod.sdpa_backends
with torch.inference_mode():
    for backends, lengths in (("default", (97, 131, 163, 201, 97, 131)), ("ours", (99, 133, 167, 203, 99, 133))):
        model_mod.sdpa_backends = ours if backends == "ours" else (lambda dev: contextlib.nullcontext())
        for n in lengths:
            ids = torch.randint(0, m.args.vocab_size, (n,), device="cuda")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            m.logits(m(ids, torch.arange(n, device="cuda"), cache, 0)).argmax(-1).tolist()
            torch.cuda.synchronize()
            res["rows"].append({"backends": backends, "len": n, "ms": 1e3 * (time.perf_counter() - t0)})
            print(res["rows"][-1], flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
