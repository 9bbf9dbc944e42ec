"""CPU time of one decode step of the batched engine, by region, on a real target (docs/peer-vllm-cpu.md).

Process time on 1 thread, so other people's jobs on a shared machine change it far less than wall time. Each layer's
profiling regions (``specpilot.model.layers.region``) are timed: projections (the GEMMs), attention (K/V store and
gather, SDPA), norms and elementwise; the rest of the step is the LM head and its argmax, drafting, the engine's
bookkeeping and Python. Requests: the peer probe's chat prompts (GSM8K questions), 200 new tokens each, timed over 12
steps after 40 (contexts of about 150-200 tokens). Run it with ``PYTHONPATH`` at a source tree to time that tree.

    OMP_NUM_THREADS=1 python probes/batch_step_regions.py --target /work/smollm2 --requests 1,8,32 --system ar \
        --out results/.../step_regions.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

ACC: dict = defaultdict(float)


@contextlib.contextmanager
def timed_region(prof, name):
    c = time.process_time()
    try:
        yield
    finally:
        ACC[name] += time.process_time() - c


def profile_ops(eng, steps: int, top: int = 14) -> dict:
    """Self CPU ms per step of the ``top`` aten ops over ``steps`` engine steps under torch.profiler, and the rest."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            eng.step()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    out = {e.key: round(e.self_cpu_time_total / 1e3 / steps, 2) for e in ops[:top]}
    out["(all other ops)"] = round(sum(e.self_cpu_time_total for e in ops[top:]) / 1e3 / steps, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="/work/smollm2")
    ap.add_argument("--requests", default="1,8,32")
    ap.add_argument("--system", choices=("ar", "sealed"), default="ar", help="sealed: ngram/best_first N=2 D=2 k=2")
    ap.add_argument("--label", default="", help="a name for the source tree timed")
    ap.add_argument("--ops", type=int, default=0, help="after timing, profile this many more steps (torch.profiler) "
                    "and record the top aten ops' self CPU ms per step (the profiler's overhead inflates small ops)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import specpilot.model.layers as layers
    import specpilot.model.transformer as transformer
    from peer_vllm_cpu import prompts
    from specpilot.config import SystemConfig
    from specpilot.engine.batch import Request
    from specpilot.engine.deployment import Deployment

    layers.region = transformer.region = timed_region
    torch.set_num_threads(1)
    dep = Deployment(args.target, None, dtype="float32", device="cpu")
    ps = [list(dep.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                                 add_generation_prompt=True)["input_ids"]) for q in prompts(8)]
    cfg = (SystemConfig.ar() if args.system == "ar" else
           SystemConfig(drafter="ngram", tree="best_first", nodes=2, depth=2, top_k=2))
    for n in [int(x) for x in args.requests.split(",")]:
        eng = dep.batch_system(cfg, 32, max_len=1024)
        for i in range(n):
            eng.add_request(Request(f"r{i}", ps[i % 8], 200))
        for _ in range(40):
            eng.step()
        ACC.clear()
        steps, rows, toks = 12, 0, 0
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            outs = eng.step()
            rows += sum(o.drafted + 1 for o in outs)
            toks += sum(len(o.new_tokens) for o in outs)
        total, wall = 1e3 * (time.process_time() - c0) / steps, 1e3 * (time.perf_counter() - w0) / steps
        parts = {k: round(1e3 * v / steps, 1) for k, v in ACC.items()}
        parts["rest"] = round(total - sum(parts.values()), 1)
        row = {"tree": args.label, "source": layers.__file__, "system": cfg.label(), "requests": n,
               "rows_per_step": rows / steps, "tokens_per_step": toks / steps, "cpu_ms_per_step": round(total, 1),
               "wall_ms_per_step": round(wall, 1), "tokens_per_cpu_s": round(1e3 * toks / steps / total, 1),
               "by_region_cpu_ms": parts, "loadavg": os.getloadavg(), "torch": torch.__version__}
        if args.ops:
            row["ops_self_cpu_ms_per_step"] = profile_ops(eng, args.ops)
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
