"""The batched engine's CPU pass eager vs its compiled decoder stack (``BatchEngine(compile_cpu=True)``), SmolLM2.

Workload as the prototype's (``results/cpu_stack_compile_cpu_2026-12-05_1f9f580/``): 8 GSM8K chat prompts, 128 new
tokens, AR, a batched engine of 8 slots, prefix reuse off, float32, 2 torch threads. One eager and one compiled
engine are built once (the compiled one's two graphs compiled by ``compile_shapes``, timed), then runs alternate,
three each (E C C E E C). "step" = the median over a run of the steps that run all 8 requests and no prefill.
Also recorded: the compiled engine's pass counts (compiled / eager fallback) and Dynamo's graph count before and
after the timed runs (a recompile mid-run would raise it), outputs equal token for token, load averages.

    python probes/compiled_stack_ab.py SMOLLM2_DIR OUT.json
"""

import json
import os
import statistics
import sys
import time

import torch

from specpilot.config import SystemConfig
from specpilot.data.benchmarks import PROMPTS_DIR
from specpilot.engine.batch import Request
from specpilot.engine.deployment import Deployment
from specpilot.provenance import git_commit

torch.set_num_threads(2)
N, NEW = 8, 128


def main(model_dir: str, out: str) -> None:
    from torch._dynamo.utils import counters
    from transformers import AutoTokenizer

    load = {"before": os.getloadavg()}
    dep, tok = Deployment(model_dir), AutoTokenizer.from_pretrained(model_dir)
    lines = (PROMPTS_DIR / "gsm8k_test.jsonl").read_text().splitlines()
    prompts = [tok.apply_chat_template([{"role": "user", "content": json.loads(lines[i])["question"]}],
                                       add_generation_prompt=True, tokenize=True, return_dict=False) for i in range(N)]
    engines = {c: dep.batch_system(SystemConfig.ar(), max_num_seqs=N, max_len=1024, prefix_caching=False,
                                   compile_cpu=c == "compiled") for c in ("eager", "compiled")}
    t0 = time.perf_counter()
    warm_passes = engines["compiled"].compile_shapes()
    warm_s = time.perf_counter() - t0
    graphs_after_warm = counters["stats"]["unique_graphs"]
    print(f"compile_shapes: {warm_passes} passes, {warm_s:.1f} s, {graphs_after_warm} graphs", flush=True)

    def run(name: str, tag: str):
        eng = engines[name]
        for i, p in enumerate(prompts):
            eng.add_request(Request(f"{tag}{i}", list(p), NEW))
        steps, outs, t = [], {}, time.perf_counter()
        while eng.has_work():
            s0, b = time.perf_counter(), eng.prefill_passes
            for o in eng.step():
                outs.setdefault(o.request_id[len(tag):], []).extend(o.new_tokens)
            if eng.prefill_passes == b and len(eng._running) == N:
                steps.append(time.perf_counter() - s0)
        wall = time.perf_counter() - t
        tokens = sum(len(v) for v in outs.values())
        return {"wall_s": round(wall, 3), "tokens": tokens, "tok_s": round(tokens / wall, 1), "full_steps": len(steps),
                "step_ms_median": round(1e3 * statistics.median(steps), 2)}, outs

    runs, outs = {"eager": [], "compiled": []}, {"eager": [], "compiled": []}
    for rnd in range(3):
        for name in (("eager", "compiled") if rnd % 2 == 0 else ("compiled", "eager")):
            r, o = run(name, f"{name}{rnd}-")
            runs[name].append(r)
            outs[name].append(o)
            print(name, rnd, r, flush=True)
    load["after"] = os.getloadavg()
    ref = outs["eager"][0]
    equal = all(o == ref for name in outs for o in outs[name])
    med = {k: {"step_ms_median": statistics.median(r["step_ms_median"] for r in v),
               "tok_s_median": statistics.median(r["tok_s"] for r in v)} for k, v in runs.items()}
    result = {
        "probe": "probes/compiled_stack_ab.py", "device": "cpu", "torch": torch.__version__, "commit": git_commit(),
        "threads": torch.get_num_threads(), "model": model_dir, "dtype": "float32",
        "workload": {"requests": N, "max_new_tokens": NEW, "system": "AR", "max_num_seqs": N, "prefix_caching": False,
                     "prompts": "gsm8k_test.jsonl 0-7, chat template", "order": "E C, C E, E C (alternating)"},
        "compile_shapes": {"passes": warm_passes, "seconds": round(warm_s, 1), "graphs": graphs_after_warm},
        "graphs_after_runs": counters["stats"]["unique_graphs"],
        "compiled_engine_passes": dict(engines["compiled"].stack.passes),
        "runs": runs, "median_of_runs": med,
        "speedup_tok_s": round(med["compiled"]["tok_s_median"] / med["eager"]["tok_s_median"], 3),
        "outputs_equal": equal, "loadavg_1_5_15": load,
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
