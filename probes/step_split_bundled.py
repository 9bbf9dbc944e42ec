"""Where a speculative step's time goes on a launch-bound target (the bundled pair on a GPU): per system, ms per
decode step timed plainly, the profiled regions (drafter, exact_pass, other; CUDA events) and the host's share
(wall time of propose, tree building, acceptance) beside the recording's draft_ms that the cost model prices.
Usage: python3 probes/step_split_bundled.py OUT.json"""

import json
import sys
import time

import torch

from specpilot.config import SystemConfig
from specpilot.data.benchmarks import load_requests
from specpilot.engine.deployment import Deployment
from specpilot.pilot.profiler import StepProfiler
from specpilot.pilot.replay import record
from specpilot.provenance import git_commit
from specpilot.zoo import bundled_block_dir, bundled_drafter_dir, bundled_target_dir

dep = Deployment(bundled_target_dir(), bundled_drafter_dir(), dtype="bfloat16", device="cuda",
                 block_dirs=[bundled_block_dir()])
tok = dep.tokenizer
prompts = [tok.encode(r.text) for name in ("gsm8k", "mt_bench") for r in load_requests(name, 2, tok)]
systems = {"ar": SystemConfig.ar(), "stock": SystemConfig.stock("draft_model"),
           "ngram_bf_N24": SystemConfig(drafter="ngram", tree="best_first", nodes=24, depth=10, top_k=2),
           "dm_bf_N32": SystemConfig(drafter="draft_model", tree="best_first", nodes=32, depth=3, top_k=8),
           "block_bf_N32": SystemConfig(drafter="block", tree="best_first", nodes=32, depth=16, top_k=16),
           "block_chain16": SystemConfig(drafter="block", tree="chain", nodes=16, depth=16, top_k=16)}
res = {"commit": git_commit(), "device": torch.cuda.get_device_name(), "systems": {}}
ar_out = None
for name, cfg in systems.items():
    eng = dep.system(cfg)
    for p in prompts:
        eng.generate(p, 8)
    steps = ms = 0.0
    outs = []
    for p in prompts:
        torch.cuda.synchronize()
        g = eng.generate(p, 64)
        outs.append(g.tokens)
        steps += g.steps
        ms += 1e3 * (g.time_s - g.prefill_s)
    row = {"ms_per_step": ms / steps, "tau": sum(len(o) - 1 for o in outs) / steps}
    if cfg.drafter != "none":
        prof = StepProfiler("cuda")
        st = 0
        for p in prompts:
            st += eng.generate(p, 64, prof=prof).steps
        row["gpu_ms_per_step"] = {k: v / st for k, v in prof.totals_ms().items()}
        d = eng.drafter
        rec = record(d, prompts, [o for o in ar_out], cfg.depth, cfg.top_k,
                     target=dep.target if cfg.drafter == "block" else None)
        row["record_draft_ms"] = rec.draft_ms
    else:
        ar_out = outs
    res["systems"][name] = row
    print(name, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=2)
