"""The batched engine in process on the CPU, the vLLM comparison's workload: SmolLM2-135M-Instruct (float32), the
first 8 GSM8K test questions as chat prompts (32 requests = the 8 four times), at most 128 new tokens (EOS ends a
request, as in the servers), all queued at once, `BatchEngine.step` until done; wall clock of the whole run, and of
the steps that ran a prefill pass.

Run it from the checkout to measure, or with ``PYTHONPATH`` set to another checkout (an A/B against an older commit
in a ``git worktree``): the engine imported is the one measured, the probe is the same.

    OMP_NUM_THREADS=2 python probes/batch_inproc_cpu.py --sizes 8,32 --rounds 2 --out results/.../inproc.json

``--system LABEL=JSON`` (repeatable) adds systems beside AR (a SystemConfig's fields as a JSON object, e.g. an n-gram
shared budget); each round runs every system once, the order rotated, and each output is compared with AR's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="/work/smollm2")
    ap.add_argument("--sizes", default="8,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=1024, help="context per slot (the servers run 1024): every "
                    "system's engine holds its whole K/V pool at once")
    ap.add_argument("--system", action="append", default=[], help="LABEL=JSON SystemConfig fields (repeatable)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import specpilot
    from transformers import AutoTokenizer

    from specpilot.config import SystemConfig
    from specpilot.data.benchmarks import PROMPTS_DIR
    from specpilot.engine.batch import Request
    from specpilot.engine.deployment import Deployment

    root = Path(specpilot.__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dep = Deployment(a.target)
    tok = AutoTokenizer.from_pretrained(a.target)
    qs = [json.loads(x)["question"] for x in (PROMPTS_DIR / "gsm8k_test.jsonl").read_text().splitlines()[:8]]
    base = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for q in qs]
    out = {"engine_checkout": str(root), "engine_commit": commit, "torch": torch.__version__, "threads": a.threads,
           "machine": platform.processor() or platform.machine(), "load_before": os.getloadavg(), "runs": []}
    systems = {"ar": SystemConfig.ar()}
    for spec in a.system:
        label, _, js = spec.partition("=")
        systems[label] = SystemConfig(**json.loads(js))
    out["systems"] = {k: v.model_dump(mode="json") for k, v in systems.items()}
    for n in [int(x) for x in a.sizes.split(",")]:
        prompts = (base * (n // 8 + 1))[:n]
        engines = {k: dep.batch_system(cfg, max_num_seqs=n, max_len=a.max_len) for k, cfg in systems.items()}
        ar_out = None
        for rnd in range(a.rounds + 1):  # round 0 warms up
            order = list(engines)[rnd % len(engines):] + list(engines)[:rnd % len(engines)]
            for label in (list(engines) if rnd == 0 else order):  # AR first in the warm-up: its outputs are the oracle
                eng = engines[label]
                for i, p in enumerate(prompts):
                    eng.add_request(Request(f"r{rnd}_{i}", list(p), a.max_tokens))
                got = {f"r{rnd}_{i}": [] for i in range(n)}
                t0, pre, steps = time.perf_counter(), 0.0, 0
                while eng.has_work():
                    s0, before = time.perf_counter(), eng.prefill_passes
                    for o in eng.step():
                        got[o.request_id] += o.new_tokens
                    pre += time.perf_counter() - s0 if eng.prefill_passes != before else 0.0
                    steps += 1
                wall = time.perf_counter() - t0
                toks = [got[f"r{rnd}_{i}"] for i in range(n)]
                ar_out = toks if ar_out is None else ar_out
                if rnd:
                    out["runs"].append({"system": label, "requests": n, "round": rnd, "tokens": sum(map(len, toks)),
                                        "wall_s": wall, "tok_per_s": sum(map(len, toks)) / wall, "steps": steps,
                                        "prefill_steps_s": pre, "outputs_equal_ar": toks == ar_out})
                    print(json.dumps(out["runs"][-1]), flush=True)
    out["load_after"] = os.getloadavg()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
