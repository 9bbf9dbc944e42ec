"""Two engines of one config, a third between them, and the same engine with ``w12``: prefill and request
times in a palindrome per prompt (the 8B pilot's seal measured AR 0.956x against an identical AR
system; this checks whether a second engine of one config is slower, and what W12 costs in the prefill).

    python probes/prefill_pair_check.py TARGET_DIR OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.provenance import git_commit, versions


def main():
    target, path = sys.argv[1], sys.argv[2]
    t0 = time.time()
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only to smoke-test the script
    dep = Deployment(target, None, dtype="bfloat16", device=dev)
    ar = SystemConfig(drafter="none", tree="chain", nodes=1, depth=1, top_k=1, dtype="bfloat16")
    engines = {"ar1": dep.system(ar), "stock": dep.system(SystemConfig.stock("ngram").model_copy(update={"dtype": "bfloat16"})), "ar2": dep.system(ar)}
    res = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "versions": versions(), "commit": git_commit(), "runs": []}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(300, min(5000, dep.target.args.vocab_size), (int(n),), generator=g).tolist() for n in (150, 300, 450, 600, 900, 1200)]

    def run(order, tag):
        for i, p in enumerate(prompts):
            for name in order + order[::-1]:
                if dev == "cuda":
                    torch.cuda.synchronize()
                out = engines[name].generate(p, 48)
                res["runs"].append({"phase": tag, "prompt": i, "len": len(p), "system": name,
                                    "prefill_ms": 1e3 * out.prefill_s, "time_ms": 1e3 * out.time_s})

    for e in engines.values():  # warm-up
        e.generate(prompts[0], 8)
    run(["ar1", "stock", "ar2"], "same config twice")
    summary = {}
    for name in engines:
        rs = [r for r in res["runs"] if r["system"] == name]
        summary[name] = {"prefill_ms_median": statistics.median(r["prefill_ms"] for r in rs),
                         "time_ms_median": statistics.median(r["time_ms"] for r in rs)}
    res["summary"] = summary
    print(json.dumps(summary), flush=True)
    json.dump(res, open(path, "w"), indent=1)
    if time.time() - t0 < 120:
        engines["w12"] = dep.system(ar.model_copy(update={"w12": True}))
        engines["w12"].generate(prompts[0], 8)
        run(["ar1", "w12"], "w12")
        for name in ("ar1", "w12"):
            rs = [r for r in res["runs"] if r["system"] == name and r["phase"] == "w12"]
            summary[name + "_w12phase"] = {
                "prefill_ms_by_len": {n: statistics.median(r["prefill_ms"] for r in rs if r["len"] == n)
                                      for n in sorted({r["len"] for r in rs})},
                "time_ms_median": statistics.median(r["time_ms"] for r in rs)}
        print(json.dumps(summary), flush=True)
    res["runtime_s"] = time.time() - t0
    json.dump(res, open(path, "w"), indent=1)


if __name__ == "__main__":
    main()
