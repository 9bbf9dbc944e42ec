"""The CPU's 2-3-row LM head padded to 4 rows (``transformer.SLOW_HEAD_ROWS``) against no padding, in the
single-request engine: SmolLM2-135M-Instruct float32 with its sealed system (n-gram best_first N=2, passes of 1-3
rows) and AR, one thread, rounds A B B A over the same prompts; tokens/s of each and whether the tokens are equal.

    OMP_NUM_THREADS=1 python probes/head_pad_ab.py SMOLLM2_DIR OUT.json
"""
import json
import statistics
import sys
import time

import torch

import specpilot.model.transformer as tr
from specpilot.config import SystemConfig
from specpilot.data.benchmarks import BENCHMARKS, load_requests
from specpilot.engine.deployment import Deployment
from specpilot.provenance import git_commit, versions
from specpilot.text import encode_text

torch.set_num_threads(1)
dep = Deployment(sys.argv[1], dtype="float32", device="cpu")
tok = dep.tokenizer
reqs = [r for b in BENCHMARKS for r in load_requests(b, 2, tokenizer=tok)]
prompts = [encode_text(tok, r.text) for r in reqs]  # load_requests applied the chat template
systems = {"sealed": SystemConfig(drafter="ngram", tree="best_first", nodes=2, depth=2, top_k=2),
           "ar": SystemConfig.ar(dtype="float32")}
pads = {"pad4": (2, 3), "none": ()}
out = {"probe": "head_pad_ab", "commit": git_commit(), "versions": versions(), "threads": 1,
       "prompts": len(prompts), "max_new_tokens": 64, "runs": {}}
for sname, cfg in systems.items():
    eng = dep.system(cfg)
    toks, rates = {}, {p: [] for p in pads}
    for rnd, order in enumerate((("pad4", "none"), ("none", "pad4"), ("pad4", "none"), ("none", "pad4"))):
        for p in order:
            tr.SLOW_HEAD_ROWS = pads[p]
            n, t0 = 0, time.perf_counter()
            got = [eng.generate(q, 64).tokens for q in prompts]
            dt = time.perf_counter() - t0
            rates[p].append(sum(len(g) for g in got) / dt)
            toks.setdefault(p, got)
            print(sname, rnd, p, round(rates[p][-1], 2), flush=True)
    out["runs"][sname] = {"tokens_per_s": rates, "median": {p: statistics.median(v) for p, v in rates.items()},
                          "ratio_pad4_over_none": statistics.median(rates["pad4"]) / statistics.median(rates["none"]),
                          "tokens_equal": toks["pad4"] == toks["none"]}
    print(sname, out["runs"][sname]["ratio_pad4_over_none"], out["runs"][sname]["tokens_equal"], flush=True)
json.dump(out, open(sys.argv[2], "w"), indent=1)
