"""Replay τ against live τ on the same prompts (§2.4): does the replay table predict what the engine does?

For each system (drafter + tree policy), the prompts of ``specpilot replay`` (the first ``--per-benchmark``
prompts of GSM8K, HumanEval, MBPP and MT-Bench) are generated live by the engine (float32, CPU by default) and
replayed from a recording along AR's outputs; τ pooled over the prompts (tokens committed after the prefill /
exact passes) of both, and the live output's equality with AR, go to ``OUT.json``.

Usage: ``python probes/live_vs_replay.py TARGET_DIR OUT.json --system ngram:chain:8 --system
block:best_first:32:DRAFTER_DIR ...`` (``drafter:tree:nodes[:drafter_dir]``; depth 16, top-K 16, the n-gram
chain top-K 1 as in the replay table).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specpilot.config import SystemConfig
from specpilot.data.benchmarks import BENCHMARKS, load_requests
from specpilot.engine.deployment import Deployment
from specpilot.pilot.replay import record, replay


def parse_system(s: str) -> SystemConfig:
    """``drafter:tree:nodes[:dir]`` -> the replay table's config for it (depth 16)."""
    parts = s.split(":")
    drafter, tree, nodes = parts[0], parts[1], int(parts[2])
    path = parts[3] if len(parts) > 3 else None
    k = 1 if tree == "chain" else 16
    return SystemConfig(drafter=drafter, drafter_path=path, tree=tree, nodes=nodes, depth=16, top_k=k)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("out")
    ap.add_argument("--system", action="append", required=True)
    ap.add_argument("--per-benchmark", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    a = ap.parse_args()
    cfgs = [parse_system(s) for s in a.system]
    blocks = sorted({c.drafter_path for c in cfgs if c.drafter == "block"})
    dep = Deployment(a.target, block_dirs=blocks, dtype="float32", device="cpu")
    tok = dep.tokenizer
    reqs = [r for b in BENCHMARKS for r in load_requests(b, a.per_benchmark, tok)]
    prompts = [tok(r.text, add_special_tokens=False)["input_ids"] for r in reqs]
    ar_eng = dep.system(SystemConfig.ar())
    ar = [ar_eng.generate(p, a.max_new_tokens).tokens for p in prompts]
    res = {"target": a.target, "prompts": [f"{r.benchmark}[{r.index}]" for r in reqs],
           "max_new_tokens": a.max_new_tokens, "systems": []}
    for spec, cfg in zip(a.system, cfgs):
        eng = dep.system(cfg)
        t0 = time.time()
        rec = record(eng.drafter, prompts, ar, cfg.depth, cfg.top_k, target=dep.target)
        r_tau, r_steps = replay(rec, cfg)
        live = [eng.generate(p, a.max_new_tokens) for p in prompts]
        l_acc = sum(sum(g.accepted) for g in live)
        l_steps = sum(g.steps for g in live)
        row = {"system": spec, "label": cfg.label(), "replay_tau": r_tau, "replay_steps": r_steps,
               "live_tau": l_acc / l_steps, "live_steps": l_steps,
               "rel_diff": (l_acc / l_steps) / r_tau - 1, "live_equals_ar": all(g.tokens == t for g, t in zip(live, ar)),
               "seconds": round(time.time() - t0, 1)}
        res["systems"].append(row)
        print(json.dumps(row), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
