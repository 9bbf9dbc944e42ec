"""Where a batched CPU decode step's time goes, by top-level aten op: SmolLM2-135M-Instruct (float32), the vLLM
comparison's prompts (the first 8 GSM8K test questions as chat turns, repeated), AR, ``--requests`` running.

After 20 warm-up steps (``--steps``): the median wall time of 20 steps, then one step under torch.profiler, its top-level ops
(those not called from another aten op) summed by name. The gap between the wall time and the ops' sum is the
Python around them (the engine's bookkeeping, module calls).

    OMP_NUM_THREADS=2 python probes/batch_step_ops.py --requests 8,32 --out results/.../ops.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections import Counter
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="/work/smollm2")
    ap.add_argument("--requests", default="8,32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20, help="timed steps (after as many warm-up steps)")
    ap.add_argument("--compile", action="store_true", help="the compiled stack (`serve --compile`)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoTokenizer

    from specpilot.config import SystemConfig
    from specpilot.data.benchmarks import PROMPTS_DIR
    from specpilot.engine.batch import Request
    from specpilot.engine.deployment import Deployment

    dep = Deployment(a.target)
    tok = AutoTokenizer.from_pretrained(a.target)
    qs = [json.loads(x)["question"] for x in (PROMPTS_DIR / "gsm8k_test.jsonl").read_text().splitlines()[:8]]
    base = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for q in qs]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"commit": commit, "compile": a.compile, "torch": torch.__version__, "threads": a.threads, "load_before": os.getloadavg(),
           "runs": []}
    for n in [int(x) for x in a.requests.split(",")]:
        eng = dep.batch_system(SystemConfig.ar(), max_num_seqs=n, compile_cpu=a.compile)
        for i, p in enumerate((base * (n // 8 + 1))[:n]):
            eng.add_request(Request(f"r{i}", list(p), 400))
        for _ in range(a.steps):
            eng.step()
        ts = []
        for _ in range(a.steps):
            t = time.perf_counter()
            eng.step()
            ts.append(time.perf_counter() - t)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            eng.step()
        ops = ("aten::", "mkldnn", "specpilot::", "Torch-Compiled Region", "## Call CompiledFxGraph")
        top = [e for e in prof.events() if e.name.startswith(ops) and
               (e.cpu_parent is None or not e.cpu_parent.name.startswith(ops))]
        calls, us = Counter(e.name for e in top), Counter()
        for e in top:
            us[e.name] += e.cpu_time_total
        run = {"requests": n, "step_ms_median": 1e3 * sorted(ts)[len(ts) // 2], "ops": len(top),
               "ops_ms": sum(us.values()) / 1e3,
               "by_op_ms": {k: round(v / 1e3, 3) for k, v in us.most_common(15)},
               "calls": {k: calls[k] for k, _ in us.most_common(15)},
               # exclusive time by name: under --compile the top level is one compiled region
               "self_ms": {e.key: round(e.self_cpu_time_total / 1e3, 3) for e in sorted(
                   prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:20]}}
        out["runs"].append(run)
        print(json.dumps(run), flush=True)
    out["load_after"] = os.getloadavg()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
