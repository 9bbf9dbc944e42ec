"""Do learned drafters pay on a CPU? Single-request systems timed live beside AR on a real target (§2.4, §5.1).

Each system generates the first ``--per-benchmark`` prompts of GSM8K, HumanEval, MBPP and MT-Bench (float32, the
tokenizer's chat template for MT-Bench), ``--rounds`` rounds in a palindrome per round (A B ... B A: drift in the
machine's speed cancels), one torch thread by default. Per system: decode tokens/s (tokens after the prefill over
the decode time, summed over prompts, the faster of each prompt's two runs per round, then the median over rounds),
its ratio to AR's from the same rounds, τ, and whether every output equals AR's. No system here is sealed: this
measures candidates a pilot would have to judge, it approves nothing.

Usage: ``python probes/learned_drafters_cpu.py TARGET_DIR OUT.json --system ngram:chain:16:16:1 --system
eagle3:best_first:16:6:8:DRAFTER_DIR ...`` (``drafter:tree:nodes:depth:top_k[:dir]``; AR always runs).
"""

from __future__ import annotations

import argparse
import os
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from specpilot.config import SystemConfig
from specpilot.data.benchmarks import BENCHMARKS, load_requests
from specpilot.engine.deployment import Deployment
from specpilot.provenance import git_commit, versions


def parse_system(s: str) -> SystemConfig:
    """``drafter:tree:nodes:depth:top_k[:dir]`` -> its :class:`SystemConfig`."""
    p = s.split(":")
    return SystemConfig(drafter=p[0], tree=p[1], nodes=int(p[2]), depth=int(p[3]), top_k=int(p[4]),
                        drafter_path=p[5] if len(p) > 5 else None)


def decode_rate(gens) -> tuple[int, float]:
    """(decode tokens, decode seconds) of generations: tokens after the prefill's first, time after the prefill."""
    return sum(len(g.tokens) - 1 for g in gens), sum(g.time_s - g.prefill_s for g in gens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target")
    ap.add_argument("out")
    ap.add_argument("--system", action="append", required=True)
    ap.add_argument("--per-benchmark", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfgs = {"ar": SystemConfig.ar(), **{s: parse_system(s) for s in a.system}}
    blocks = sorted({c.drafter_path for c in cfgs.values() if c.drafter == "block"})
    dep = Deployment(a.target, block_dirs=blocks, dtype="float32", device="cpu")
    tok = dep.tokenizer
    reqs = [r for b in BENCHMARKS for r in load_requests(b, a.per_benchmark, tok)]
    prompts = [tok(r.text, add_special_tokens=False)["input_ids"] for r in reqs]
    engines = {k: dep.system(c) for k, c in cfgs.items()}
    for e in engines.values():  # warm-up: first-use costs paid
        e.generate(prompts[0], 8)
    order = list(engines)
    per_round: dict[str, list[float]] = {k: [] for k in engines}
    last: dict = {}
    for _ in range(a.rounds):
        best: dict[str, list] = {k: [None] * len(prompts) for k in engines}
        for i, p in enumerate(prompts):
            for k in order + order[::-1]:
                g = engines[k].generate(p, a.max_new_tokens)
                if best[k][i] is None or g.time_s - g.prefill_s < best[k][i].time_s - best[k][i].prefill_s:
                    best[k][i] = g
        for k in engines:
            n, s = decode_rate(best[k])
            per_round[k].append(n / s)
        last = best
    ar_tokens = [g.tokens for g in last["ar"]]
    rows = []
    for k, cfg in cfgs.items():
        gens = last[k]
        rate = statistics.median(per_round[k])
        ratios = [r / ar for r, ar in zip(per_round[k], per_round["ar"])]
        steps = sum(g.steps for g in gens)
        rows.append({"system": k, "label": cfg.label(), "tokens_per_s": round(rate, 2),
                     "tokens_per_s_rounds": [round(r, 2) for r in per_round[k]],
                     "vs_ar": round(statistics.median(ratios), 4), "vs_ar_rounds": [round(r, 4) for r in ratios],
                     "tau": round(sum(sum(g.accepted) for g in gens) / max(steps, 1), 4),
                     "outputs_equal_ar": all(g.tokens == t for g, t in zip(gens, ar_tokens))})
        print(json.dumps(rows[-1]), flush=True)
    res = {"target": a.target, "prompts": [f"{r.benchmark}[{r.index}]" for r in reqs],
           "max_new_tokens": a.max_new_tokens, "rounds": a.rounds, "threads": a.threads,
           "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
           "commit": git_commit(), "versions": versions(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "systems": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
