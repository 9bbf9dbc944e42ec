"""Shared node budget vs equal split (§4.4) by exact replay of the batched engine on the bundled pair: the n-gram
drafter and the bundled block drafter on the bundled target, float32 CPU.

Records each drafter's lattices along the target's AR outputs on the bundled benchmarks (depth 16, top-K 8), then
replays the batched engine (:func:`specpilot.pilot.replay_batch.replay_batch`: every request queued at once, ``n``
slots, continuous batching) with the same total node budget two ways: ``per_request`` (each request its own
best-first tree of N nodes, the equal split) and ``shared_budget`` (N x n nodes per step, best-first across all
running requests). Reported per (drafter, n, depth, N): draft tokens accepted per exact pass, tokens committed per
exact pass, steps, nodes verified per exact pass. Requests run in benchmark order and in a shuffled order (seed 0,
batches that mix benchmarks).

Usage (repository root)::

    python probes/shared_budget_replay.py [--per-benchmark 8] [--max-new-tokens 64] --out results/DIR
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

from specpilot.config import SystemConfig
from specpilot.data.benchmarks import BENCHMARKS, load_requests
from specpilot.engine.deployment import Deployment
from specpilot.pilot.replay import Recording, record
from specpilot.pilot.replay_batch import batch_summary, replay_batch
from specpilot.zoo import bundled_block_dir, bundled_target_dir

DEPTH, TOP_K = 16, 8
BATCHES, DEPTHS, NODES = (4, 8), (8, 16), (8, 16)


def reorder(rec: Recording, idx: list[int]) -> Recording:
    return Recording([rec.prompts[i] for i in idx], [rec.ar[i] for i in idx], [rec.lattices[i] for i in idx],
                     rec.depth, rec.top_k, rec.draft_ms, rec.drafter_path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-benchmark", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    t0 = time.time()
    block = bundled_block_dir()
    dep = Deployment(bundled_target_dir(), block_dirs=[block], dtype="float32", device="cpu")
    tok = dep.tokenizer
    reqs = [r for b in BENCHMARKS for r in load_requests(b, a.per_benchmark, tok)]
    prompts = [tok(r.text, add_special_tokens=False)["input_ids"] for r in reqs]
    ar_eng = dep.system(SystemConfig.ar())
    ar = [ar_eng.generate(p, a.max_new_tokens).tokens for p in prompts]
    print(f"AR outputs of {len(prompts)} prompts in {time.time() - t0:.1f} s", flush=True)
    recs = {}
    for kind, path in (("ngram", None), ("block", str(block))):
        cfg = SystemConfig(drafter=kind, drafter_path=path, tree="best_first", top_k=TOP_K, depth=DEPTH, nodes=DEPTH)
        t1 = time.time()
        recs[kind] = record(dep.system(cfg).drafter, prompts, ar, DEPTH, TOP_K,
                            target=dep.target if kind == "block" else None)
        print(f"{kind}: recorded in {time.time() - t1:.1f} s", flush=True)
    shuffled = list(range(len(prompts)))
    random.Random(0).shuffle(shuffled)
    rows = []
    for kind, rec in recs.items():
        for order, idx in (("benchmark", list(range(len(prompts)))), ("shuffled", shuffled)):
            r = reorder(rec, idx)
            for n in BATCHES:
                for depth in DEPTHS:
                    for nodes in NODES:
                        base = SystemConfig(drafter=kind, tree="best_first", nodes=nodes, depth=depth, top_k=TOP_K)
                        eq = batch_summary(replay_batch(r, base, n))
                        sh = batch_summary(replay_batch(r, base.apply({"row_selection": "shared_budget"}), n))
                        row = {"drafter": kind, "order": order, "requests": n, "depth": depth, "nodes_per_request": nodes,
                               "budget": nodes * n, "equal": eq, "shared": sh,
                               "accepted_gain": sh["accepted_per_step"] / eq["accepted_per_step"] - 1
                               if eq["accepted_per_step"] else None,
                               "tokens_gain": sh["tokens_per_step"] / eq["tokens_per_step"] - 1}
                        rows.append(row)
                        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                                          if k not in ("equal", "shared")}), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"command": " ".join(["python"] + sys.argv), "commit": commit, "target": "bundled", "block": "bundled block",
           "per_benchmark": a.per_benchmark, "max_new_tokens": a.max_new_tokens, "benchmarks": list(BENCHMARKS),
           "requests": len(prompts), "record_depth": DEPTH, "record_top_k": TOP_K, "dtype": "float32",
           "device": "cpu", "ar_tokens": sum(len(x) for x in ar), "wall_s": round(time.time() - t0, 1), "rows": rows}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "result.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
