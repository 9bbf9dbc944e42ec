"""GPU check of the graphed draft model (issue 4): bundled pair on CUDA, float32: speculative output ==
AR output with the static (CUDA-graph) drafter, lattices equal to the dynamic drafter; bf16 tokens/s of AR,
draft_model chain and best_first (graphs on). Writes JSON to argv[1]."""

import json
import sys
import time

import torch

from specpilot.config import SystemConfig
from specpilot.spec.draft_model import DraftModelDrafter
from specpilot.engine.deployment import Deployment
from specpilot.pilot.setup import build_requests
from specpilot.provenance import git_commit, versions
from specpilot.zoo import bundled_drafter_dir, bundled_target_dir

res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit()}
for dtype in ("float32", "bfloat16"):
    dep = Deployment(bundled_target_dir(), bundled_drafter_dir(), dtype=dtype, device="cuda")
    prompts = [list(r.prompt_ids) for r in build_requests(dep, 2, 128)]
    out = {}
    for name, cfg in (("ar", SystemConfig.ar(dtype=dtype)),
                      ("draft_chain", SystemConfig.stock("draft_model", dtype=dtype)),
                      ("draft_best_first", SystemConfig(drafter="draft_model", tree="best_first", nodes=16, depth=6,
                                                        top_k=4, dtype=dtype))):
        eng = dep.system(cfg)
        eng.generate(prompts[0], 16)  # capture graphs
        toks, t, steps, acc = [], 0.0, 0, 0
        for p in prompts:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            g = eng.generate(p, 128)
            torch.cuda.synchronize()
            t += time.perf_counter() - t0
            toks.append(g.tokens)
            steps += g.steps
        out[name] = {"tokens": toks, "tokens_per_s": sum(map(len, toks)) / t, "steps": steps,
                     "tau": sum(map(len, toks)) / max(steps, 1)}
    res[dtype] = {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in out.items()}
    res[dtype]["equal_to_ar"] = {k: out[k]["tokens"] == out["ar"]["tokens"] for k in out}
    if dtype == "float32":  # lattices of the static drafter equal the dynamic one's
        dm = dep.draft_model
        a, b = DraftModelDrafter(dm, 4, static=False), DraftModelDrafter(dm, 4, static=True)
        same = all(x._rows[i][j][0] == y._rows[i][j][0] for p in prompts[:4]
                   for x, y in [(a.propose(p, 6), b.propose(p, 6))] for i in range(6) for j in range(4))
        res[dtype]["static_lattice_tokens_equal"] = same
    print(dtype, json.dumps(res[dtype]), flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
