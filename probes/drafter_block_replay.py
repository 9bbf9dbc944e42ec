"""Per-request drafter block (§4.4) by exact replay of the batched engine on the bundled pair: the bundled block
drafter (and the n-gram drafter) on the bundled target, float32 CPU. Replay only: no timing.

Records each drafter's lattices along the target's AR outputs on the bundled benchmarks (depth 16, top-K 8), then
replays the batched engine (:func:`specpilot.pilot.replay_batch.replay_batch`: every request queued at once, ``n``
slots, continuous batching) with every request drafting 16 positions (off) and with the drafter block
``(16, 12, 8)`` (:mod:`specpilot.spec.drafter_block`), and, as a control, with every request drafting the block's
smallest depth (8) at every step, and with the rule starting a request at the block's largest depth instead of its
smallest. Reported per (drafter, tree, n): draft positions asked of the
drafter per exact pass (all requests; the drafter rows of a drafter that runs one row per asked position), the
most in one pass, draft tokens accepted per exact pass, tokens committed per exact pass, steps.

Usage (repository root)::

    python probes/drafter_block_replay.py [--per-benchmark 16] [--max-new-tokens 128] --out results/DIR
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from specpilot.config import SystemConfig
from specpilot.data.benchmarks import BENCHMARKS, load_requests
from specpilot.engine.deployment import Deployment
from specpilot.pilot.replay import record
from specpilot.pilot.replay_batch import batch_summary, replay_batch
from specpilot.spec import drafter_block
from specpilot.zoo import bundled_block_dir, bundled_target_dir

DEPTH, TOP_K, BLOCK = 16, 8, (16, 12, 8)


class StartLargest(drafter_block.BlockHistory):
    """The rule, but a request's first step drafts the largest allowed depth (the variant not taken)."""

    def pick(self, allowed):
        return max(allowed) if self.accept_ema is None else super().pick(allowed)


def rows_at(steps, q: float) -> int:
    """The ``q`` quantile (nearest rank) of the draft positions asked per step."""
    rows = sorted(sum(s.depths) for s in steps)
    return rows[min(len(rows) - 1, int(q * len(rows)))] if rows else 0
BATCHES = (1, 4, 8, 16)
TREES = (("chain", 16, 1), ("best_first", 16, 8))  # stock batching (each request's top-1 chain), a best-first tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-benchmark", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
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
    rows = []
    for kind, path in (("block", str(block)), ("ngram", None)):
        cfg = SystemConfig(drafter=kind, drafter_path=path, tree="best_first", top_k=TOP_K, depth=DEPTH, nodes=DEPTH)
        t1 = time.time()
        rec = record(dep.system(cfg).drafter, prompts, ar, DEPTH, TOP_K, target=dep.target if kind == "block" else None)
        print(f"{kind}: recorded in {time.time() - t1:.1f} s", flush=True)
        for tree, nodes, k in TREES:
            base = SystemConfig(drafter=kind, tree=tree, nodes=nodes, depth=DEPTH, top_k=k)
            for n in BATCHES:
                off_steps = replay_batch(rec, base, n)
                off = {**batch_summary(off_steps), "p95_draft_rows": rows_at(off_steps, 0.95)}
                steps = replay_batch(rec, base.apply({"drafter_block": BLOCK}), n)
                on = {**batch_summary(steps), "p95_draft_rows": rows_at(steps, 0.95)}
                big_steps = replay_batch(rec, base.apply({"drafter_block": BLOCK}), n, history=StartLargest)
                big = {**batch_summary(big_steps), "p95_draft_rows": rows_at(big_steps, 0.95)}
                fixed = batch_summary(replay_batch(rec, base.apply({"depth": min(BLOCK)}), n))
                picks = Counter(d for s in steps for d in s.depths)
                row = {"drafter": kind, "tree": tree, "nodes": nodes, "top_k": k, "requests": n, "off": off, "on": on,
                       "fixed_smallest": fixed, "start_largest": big,
                       "depths_asked": {str(d): c for d, c in sorted(picks.items())},
                       "draft_rows_change": on["draft_rows_per_step"] / off["draft_rows_per_step"] - 1,
                       "accepted_change": on["accepted_per_step"] / off["accepted_per_step"] - 1
                       if off["accepted_per_step"] else None,
                       "tokens_change": on["tokens_per_step"] / off["tokens_per_step"] - 1}
                rows.append(row)
                print(json.dumps({"drafter": kind, "tree": tree, "n": n,
                                  "rows": [round(off["draft_rows_per_step"], 2), round(on["draft_rows_per_step"], 2)],
                                  "acc": [round(off["accepted_per_step"], 3), round(on["accepted_per_step"], 3)],
                                  "tok": [round(off["tokens_per_step"], 3), round(on["tokens_per_step"], 3)],
                                  "max": [off["max_draft_rows"], on["max_draft_rows"], big["max_draft_rows"]],
                                  "fixed8": [round(fixed[k], 3) for k in ("draft_rows_per_step", "accepted_per_step")],
                                  "picks": row["depths_asked"]}), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"what": "exact replay of the batched engine on the CPU (float32): counts only, no timing",
           "command": " ".join(["python"] + sys.argv), "commit": commit, "target": "bundled",
           "block": "bundled block", "per_benchmark": a.per_benchmark, "max_new_tokens": a.max_new_tokens,
           "benchmarks": list(BENCHMARKS), "requests": len(prompts), "record_depth": DEPTH, "record_top_k": TOP_K,
           "drafter_block": list(BLOCK), "rule": {"decay": drafter_block.DECAY, "threshold": drafter_block.THRESHOLD,
                                                   "headroom": drafter_block.HEADROOM},
           "dtype": "float32", "device": "cpu", "ar_tokens": sum(len(x) for x in ar),
           "wall_s": round(time.time() - t0, 1), "rows": rows}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "result.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
