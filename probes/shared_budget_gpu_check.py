"""The shared node budget on a CUDA target: the batched engine falls back to its eager pass (no padded runner), an
explicit ``padded=True`` is refused, and every request's output is compared with AR greedy from the single-request
engine, both float32 with TF32 off (bundled target, n-gram drafter, bundled prompts). Prints one JSON line.

Usage (repository root, on a CUDA machine)::

    python probes/shared_budget_gpu_check.py [--requests 12] [--max-new-tokens 48] [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch

from specpilot.config import SystemConfig
from specpilot.data.benchmarks import BENCHMARKS, load_requests
from specpilot.engine.deployment import Deployment
from specpilot.engine.batch import BatchEngine
from specpilot.errors import SpecPilotError
from specpilot.spec.ngram import NgramDrafter
from specpilot.zoo import bundled_target_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dep = Deployment(bundled_target_dir(), dtype="float32", device=a.device)
    tok = dep.tokenizer
    reqs = [r for b in BENCHMARKS for r in load_requests(b, a.requests // len(BENCHMARKS) + 1, tok)][: a.requests]
    prompts = [tok(r.text, add_special_tokens=False)["input_ids"] for r in reqs]
    ar_eng = dep.system(SystemConfig.ar())
    ar = [ar_eng.generate(p, a.max_new_tokens).tokens for p in prompts]
    cfg = SystemConfig(drafter="ngram", tree="best_first", nodes=8, depth=8, top_k=4, row_selection="shared_budget")
    target = ar_eng.target
    try:
        BatchEngine(target, cfg, NgramDrafter(max_matches=4, max_slots=4), max_num_seqs=4, padded=True)
        refused = None
    except SpecPilotError as e:
        refused = str(e)
    eng = BatchEngine(target, cfg, NgramDrafter(max_matches=4, max_slots=4), max_num_seqs=4)
    gens = eng.generate_all(prompts, a.max_new_tokens)
    equal = [g.tokens == t for g, t in zip(gens, ar)]
    steps = sum(len(g.accepted) for g in gens)
    out = {"device": torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device, "runner": eng.runner is not None, "padded_refused": refused,
           "requests": len(prompts), "equal_to_ar": sum(equal), "exact_passes": eng.exact_passes,
           "tokens": sum(len(g.tokens) for g in gens), "request_steps": steps,
           "mean_rows_per_request_step": sum(sum(g.rows) for g in gens) / max(steps, 1)}
    print(json.dumps(out))
    if a.out:
        with open(a.out, "w") as f:
            f.write(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
