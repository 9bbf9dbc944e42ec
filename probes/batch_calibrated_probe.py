"""The calibrated drafter in the batched engine on a GPU, before a pilot spends calls on it: per batch size, AR, the
n-gram chain (stock) and calibrated systems side by side, tokens/s, live τ (tokens a request commits per step) and
whether outputs equal AR's. A system that loses here will lose in the pilot; τ far below the calibration's replay
says the drafter's continuations part from what the target computes; τ near it with a loss says the step costs.

Usage: python probes/batch_calibrated_probe.py TARGET_DIR CALIBRATION OUT.json [--sizes 1,16] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.pilot.batch_runs import timed_batch
from specpilot.pilot.setup import build_requests
from specpilot.provenance import git_commit, versions


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target"), ap.add_argument("calibration"), ap.add_argument("out")
    ap.add_argument("--sizes", default="1,16"), ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda"), ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    dep = Deployment(a.target, dtype=a.dtype, device=a.device)
    reqs = build_requests(dep, 2, a.new_tokens)
    cal = dict(drafter="calibrated", drafter_path=a.calibration, dtype=a.dtype)
    systems = {"ar": SystemConfig.ar(dtype=a.dtype), "stock": SystemConfig.stock("ngram", depth=6, dtype=a.dtype),
               "cal_chain6": SystemConfig(tree="chain", nodes=6, depth=6, top_k=1, **cal),
               "cal_bf6": SystemConfig(tree="best_first", nodes=6, depth=6, top_k=4, **cal),
               "cal_bf12": SystemConfig(tree="best_first", nodes=12, depth=8, top_k=4, **cal)}
    max_len = max(len(r.prompt_ids) for r in reqs) + a.new_tokens + 16
    res = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "versions": versions(),
           "commit": git_commit(), "target": a.target, "calibration": a.calibration, "new_tokens": a.new_tokens,
           "systems": {k: v.label() for k, v in systems.items()}, "sizes": {}}
    for n in [int(s) for s in a.sizes.split(",")]:
        prompts = [reqs[i % len(reqs)].prompt_ids for i in range(n)]
        row, outs = {}, {}
        engines = {}
        for k, cfg in systems.items():
            t0 = time.perf_counter()
            engines[k] = dep.batch_system(cfg, max_num_seqs=n, max_len=max_len)
            engines[k].capture_graphs()
            timed_batch(engines[k], prompts, 8)  # warm-up
            row[k] = {"build_s": time.perf_counter() - t0, "runs_tok_s": []}
        for order in (list(systems), list(systems)[::-1]):
            for k in order:
                toks, dt, _ = timed_batch(engines[k], prompts, a.new_tokens)
                row[k]["runs_tok_s"].append(sum(len(t) for t in toks) / dt)
                outs[k] = toks
        for k, eng in engines.items():  # τ from one untimed run of the same prompts
            gens = eng.generate_all([list(p) for p in prompts], a.new_tokens)
            steps = sum(len(g.accepted) for g in gens)
            row[k]["tau"] = sum(sum(g.accepted) for g in gens) / max(steps, 1)
            row[k]["tok_s"] = max(row[k]["runs_tok_s"])
            row[k]["equal_ar"] = outs[k] == outs["ar"]
            row[k]["drafter_counts"] = dict(eng.drafter.counts) if k.startswith("cal") else None
        for k in row:
            row[k]["vs_ar"] = row[k]["tok_s"] / row["ar"]["tok_s"]
        res["sizes"][str(n)] = row
        del engines
        torch.cuda.empty_cache() if a.device == "cuda" else None
        print(n, {k: (round(v["tok_s"], 1), round(v["vs_ar"], 3), round(v["tau"], 2), v["equal_ar"])
                  for k, v in row.items()}, flush=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
