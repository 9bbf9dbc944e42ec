"""τ of an EAGLE-3 drafter beside block drafters, by exact replay (§2.4) along the target's AR outputs on the bundled
benchmarks: chain (recorded with top-K 1: the drafter's greedy chain), best_first at 16 / 32 nodes, eagle2_topk at
16, ddtree_marginal at 32 (recorded with top-K 8 for eagle3: 8 children per node, 8 nodes expanded per depth; top-K
16 for block drafters, as the replay table), all at depth 8. Float32 CPU.

Usage (repository root)::

    python probes/eagle3_replay.py --target DIR --eagle3 E3_DIR [--block B_DIR ...] --out result.json
"""

from __future__ import annotations

import argparse
import json
import time

from specpilot.config import SystemConfig
from specpilot.data.benchmarks import BENCHMARKS, load_requests
from specpilot.engine.deployment import Deployment
from specpilot.pilot.replay import record, replay

DEPTH = 8
POLICIES = [("chain", 8), ("best_first", 16), ("best_first", 32), ("eagle2_topk", 16), ("ddtree_marginal", 32)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--eagle3", action="append", default=[])
    ap.add_argument("--block", action="append", default=[])
    ap.add_argument("--per-benchmark", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dep = Deployment(a.target, block_dirs=a.block, dtype="float32", device="cpu")
    tok = dep.tokenizer
    reqs = [r for b in BENCHMARKS for r in load_requests(b, a.per_benchmark, tok)]
    prompts = [tok(r.text, add_special_tokens=False)["input_ids"] for r in reqs]
    ar_eng = dep.system(SystemConfig.ar())
    ar = [ar_eng.generate(p, a.max_new_tokens).tokens for p in prompts]
    rows = []
    drafters = [("eagle3", d, 8) for d in a.eagle3] + [("block", d, 16) for d in a.block]
    for kind, path, k in drafters:
        recs = {}
        for kk in (1, k):
            t0 = time.time()
            drafter = dep.system(SystemConfig(drafter=kind, drafter_path=path, top_k=kk, depth=DEPTH,
                                              nodes=DEPTH)).drafter
            recs[kk] = record(drafter, prompts, ar, DEPTH, kk, target=dep.target)
            print(f"{kind} {path} top-K {kk}: recorded in {time.time() - t0:.1f} s, "
                  f"{recs[kk].draft_ms:.2f} ms per propose", flush=True)
        for tree, nodes in POLICIES:
            kk = 1 if tree == "chain" else k
            cfg = SystemConfig(drafter=kind, drafter_path=path, tree=tree, nodes=nodes, depth=DEPTH, top_k=kk)
            tau, steps = replay(recs[kk], cfg)
            rows.append({"drafter": kind, "path": path, "policy": tree, "nodes": nodes, "depth": DEPTH, "top_k": kk,
                         "tau": round(tau, 4), "steps": steps, "draft_ms": round(recs[kk].draft_ms, 3)})
            print(json.dumps(rows[-1]), flush=True)
    out = {"target": a.target, "per_benchmark": a.per_benchmark, "max_new_tokens": a.max_new_tokens,
           "benchmarks": list(BENCHMARKS), "requests": len(prompts), "rows": rows}
    with open(a.out, "w") as f:
        f.write(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
