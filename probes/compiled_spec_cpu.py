"""Does speculation pay at 8 requests once the batched CPU pass is compiled? SmolLM2, float32, 2 threads.

The eager batched pilot sealed AR at 8 requests (its shared n-gram budget was 2 nodes a step there, 0.995x AR),
but the step it measured is not the one a ``serve --compile`` server runs: compiled, the per-row elementwise work
is fused, so extra verification rows may cost less. This probe runs, in one process, compiled engines of AR and
of the n-gram best-first tree under a shared budget of B nodes a step (B in ``--budgets``), plus eager AR as a
reference, on the peer comparison's workload (the first 8 GSM8K questions as chat turns, 8 at once, ``--new``
tokens each, prefix reuse off); runs rotate the engine order each round. Recorded: tokens/s per run, the median
step over steps running all 8 requests without a prefill, accepted tokens per step, outputs equal to eager AR's.

    python probes/compiled_spec_cpu.py SMOLLM2_DIR OUT.json [--budgets 4,8,16] [--rounds 3] [--new 128]
"""

import argparse
import json
import os
import statistics
import time

import torch

from specpilot.config import SystemConfig
from specpilot.data.benchmarks import PROMPTS_DIR
from specpilot.engine.batch import Request
from specpilot.engine.deployment import Deployment
from specpilot.provenance import git_commit

torch.set_num_threads(2)
N = 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--budgets", default="4,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    load = {"before": os.getloadavg()}
    dep, tok = Deployment(args.model_dir), AutoTokenizer.from_pretrained(args.model_dir)
    lines = (PROMPTS_DIR / "gsm8k_test.jsonl").read_text().splitlines()
    prompts = [tok.apply_chat_template([{"role": "user", "content": json.loads(lines[i])["question"]}],
                                       add_generation_prompt=True, tokenize=True, return_dict=False) for i in range(N)]
    ar = SystemConfig.ar()
    ngram = SystemConfig(drafter="ngram", tree="best_first", nodes=6, depth=6, top_k=4)
    systems = {"eager_ar": (ar, False), "compiled_ar": (ar, True)}
    for b in (int(x) for x in args.budgets.split(",")):
        systems[f"compiled_shared{b}"] = (ngram.apply({"row_selection": "shared_budget", "shared_budget": (b,) * N}),
                                          True)
    engines, compile_s = {}, {}
    for name, (cfg, compiled) in systems.items():
        engines[name] = dep.batch_system(cfg, max_num_seqs=N, max_len=1024, prefix_caching=False,
                                         compile_cpu=compiled)
        t0 = time.perf_counter()
        engines[name].compile_shapes()
        compile_s[name] = round(time.perf_counter() - t0, 1)
        print(name, "built; compile_shapes", compile_s[name], "s", flush=True)

    def run(name: str, tag: str):
        eng = engines[name]
        for i, p in enumerate(prompts):
            eng.add_request(Request(f"{tag}{i}", list(p), args.new))
        steps, outs, n_steps, t = [], {}, 0, time.perf_counter()
        while eng.has_work():
            s0, b = time.perf_counter(), eng.prefill_passes
            for o in eng.step():
                outs.setdefault(o.request_id[len(tag):], []).extend(o.new_tokens)
            n_steps += 1
            if eng.prefill_passes == b and len(eng._running) == N:
                steps.append(time.perf_counter() - s0)
        wall = time.perf_counter() - t
        tokens = sum(len(v) for v in outs.values())
        return {"wall_s": round(wall, 3), "tokens": tokens, "tok_s": round(tokens / wall, 1), "steps": n_steps,
                "full_steps": len(steps), "step_ms_median": round(1e3 * statistics.median(steps), 2)}, outs

    names = list(systems)
    runs = {k: [] for k in names}
    outs = {k: [] for k in names}
    for rnd in range(args.rounds):
        order = names[rnd % len(names):] + names[: rnd % len(names)]
        if rnd % 2:
            order = order[::-1]
        for name in order:
            r, o = run(name, f"{name}{rnd}-")
            runs[name].append(r)
            outs[name].append(o)
            print(rnd, name, r, flush=True)
    load["after"] = os.getloadavg()
    ref = outs["eager_ar"][0]
    med = {k: statistics.median(r["tok_s"] for r in v) for k, v in runs.items()}
    result = {
        "probe": "probes/compiled_spec_cpu.py", "device": "cpu", "torch": torch.__version__, "commit": git_commit(),
        "threads": torch.get_num_threads(), "model": args.model_dir, "dtype": "float32",
        "workload": {"requests": N, "max_new_tokens": args.new, "prompts": "gsm8k_test.jsonl 0-7, chat template",
                     "prefix_caching": False, "rounds": args.rounds, "order": "rotated each round, odd rounds reversed"},
        "systems": {k: {"config": c.label(), "compiled": comp} for k, (c, comp) in systems.items()},
        "compile_shapes_s": compile_s, "runs": runs, "tok_s_median": med,
        "vs_compiled_ar": {k: round(v / med["compiled_ar"], 3) for k, v in med.items()},
        "outputs_equal_eager_ar": {k: all(o == ref for o in v) for k, v in outs.items()},
        "loadavg_1_5_15": load,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("tok_s_median", "vs_compiled_ar", "outputs_equal_eager_ar")}, indent=1))


if __name__ == "__main__":
    main()
