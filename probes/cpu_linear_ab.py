"""Prepacked oneDNN projections (``specpilot.kernels.cpu_linear``) against plain ``F.linear`` on the CPU.

Two parts, one JSON:

1. ``gemm``: every distinct projection shape of the target (and its LM head) at 1-96 rows, one thread, best of
   ``--reps`` timings of ``F.linear`` and of the packed call, with the max abs difference between them.
2. ``steps``: engine steps of the target with the packed and the plain model, in rounds A B B A: the batched engine
   (AR and the sealed SmolLM2 n-gram system) at 1, 8 and 32 requests (the peer probe's chat prompts), wall and CPU ms
   per step in steady state (12 steps after 30), at 1 and 2 threads; and the single-request engine's tokens/s over
   one 128-token generation per prompt. Output tokens of packed and plain runs are compared.

    python probes/cpu_linear_ab.py --target /work/smollm2 --out results/cpu_linear_ab_cpu_<date>_<commit>/run.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROWS = (1, 2, 3, 4, 8, 16, 32, 64, 96)


def gemm_table(model, reps: int) -> list[dict]:
    from specpilot.kernels.cpu_linear import PackedLinear

    torch.set_num_threads(1)
    shapes = {}
    for name, m in model.named_modules():
        if isinstance(m, PackedLinear):
            shapes.setdefault(tuple(m.weight.shape), (name, m))
    out = []
    for (n, k), (name, m) in shapes.items():
        for r in ROWS:
            x = torch.randn(r, k)

            def best(f):
                f()
                ts = []
                for _ in range(reps):
                    t = time.perf_counter()
                    f()
                    ts.append(time.perf_counter() - t)
                return 1e3 * min(ts)

            with torch.no_grad():
                plain, packed = best(lambda: F.linear(x, m.weight)), best(lambda: m(x))
                diff = (m(x) - F.linear(x, m.weight)).abs().max().item()
            out.append({"layer": name, "n": n, "k": k, "rows": r, "plain_ms": round(plain, 4),
                        "packed_ms": round(packed, 4), "ratio": round(plain / packed, 3), "max_abs_diff": diff})
            print(json.dumps(out[-1]), flush=True)
    return out


def steps(dep, ps, system: str, threads: int, pack: bool) -> list[dict]:
    from specpilot.config import SystemConfig
    from specpilot.engine.batch import Request

    torch.set_num_threads(threads)
    cfg = (SystemConfig.ar() if system == "ar" else
           SystemConfig(drafter="ngram", tree="best_first", nodes=2, depth=2, top_k=2))
    rows = []
    for n in (1, 8, 32):
        eng = dep.batch_system(cfg, 32, max_len=1024)
        for i in range(n):
            eng.add_request(Request(f"r{i}", ps[i % len(ps)], 120))
        toks_all = []
        for _ in range(30):
            toks_all.append([o.new_tokens for o in eng.step()])
        w0, c0, toks = time.perf_counter(), time.process_time(), 0
        for _ in range(12):
            outs = eng.step()
            toks += sum(len(o.new_tokens) for o in outs)
            toks_all.append([o.new_tokens for o in outs])
        w, c = (time.perf_counter() - w0) / 12, (time.process_time() - c0) / 12
        rows.append({"engine": "batch", "system": system, "threads": threads, "packed": pack, "requests": n,
                     "wall_ms": round(1e3 * w, 1), "cpu_ms": round(1e3 * c, 1), "tokens_per_s": round(toks / 12 / w, 1),
                     "tokens": toks_all, "loadavg": os.getloadavg()})
    eng = dep.system(cfg)
    t0, gen, n_tok = time.perf_counter(), [], 0
    for p in ps:
        out = eng.generate(p, 128)
        gen.append(list(out.tokens))
        n_tok += len(gen[-1])
    w = time.perf_counter() - t0
    rows.append({"engine": "single", "system": system, "threads": threads, "packed": pack, "requests": 1,
                 "tokens_per_s": round(n_tok / w, 1), "tokens": gen, "loadavg": os.getloadavg()})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="/work/smollm2")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=1, help="A B B A blocks of the step part")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from peer_vllm_cpu import prompts
    from specpilot.engine.deployment import Deployment

    deps = {True: Deployment(args.target, None, dtype="float32", device="cpu"),
            False: Deployment(args.target, None, dtype="float32", device="cpu", pack=False)}
    ps = [list(deps[True].tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                                        add_generation_prompt=True)["input_ids"]) for q in prompts(8)]
    res = {"target": args.target, "torch": torch.__version__, "cpu": os.cpu_count(),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip(),
           "gemm": gemm_table(deps[True].target, args.reps), "steps": []}
    for _ in range(args.rounds):
        for threads in [int(t) for t in args.threads.split(",")]:
            for system in ("ar", "sealed"):
                for pack in (True, False, False, True):
                    for row in steps(deps[pack], ps, system, threads, pack):
                        res["steps"].append(row)
                        print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
    ref = {}
    for row in res["steps"]:
        key = (row["engine"], row["system"], row["threads"], row["requests"])
        ref.setdefault(key, row["tokens"])
        row["tokens_equal_first_run"] = row["tokens"] == ref[key]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
