"""Where does a load plan that runs AR lose to the AR engine? (GPU, the batched pilot's sealed plan.)

The bench of a six-size plan (calibrated shared-budget tree at 1 request, AR at 2-32) ran 0.972x / 0.965x the AR
engine at 16 / 32 requests, where every step of the plan is an AR step. Two things differ from an AR engine: the
plan's rows per request (its pool and CUDA-graph buckets were sized for the size-1 seal's budget at 32 requests, 32
nodes, though only 1 request ever runs it; now sized by the loads each system runs at: 8) and its feature-reading
drafter (every pass returns target features). Variants, measured side by side by the batched pilot's own batch runs
(``measure_batches``: A S X / X S A per benchmark and round) at ``--sizes``:

- ``ar``: the AR engine; ``plan``: the sealed plan as a server runs it;
- ``plan33``: the plan with the size-1 system's budget 32 at every load (the old sizing: 33 rows a request);
- ``plan_ngram``: the plan with the size-1 system's drafter swapped for the n-gram drafter (no target features);
- ``plan_ar``: the plan with AR at every size (the load plan's own machinery, no drafter); ``--systems`` picks.

Then one cProfile of a timed batch run of ``ar`` and of ``plan`` at the largest size (top functions by own time).

    python probes/plan_tax_gpu.py TARGET_DIR PILOT_DIR OUT_DIR [--sizes 16,32] [--rounds 2] [--new 64] [--systems ar,plan,...]
"""

import argparse
import cProfile
import io
import json
import pstats
import random
import time
from pathlib import Path

import torch

from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.engine.load_plan import LoadPlan
from specpilot.pilot import controller as ctl
from specpilot.pilot.batch_runs import compare, measure_batches, timed_batch, variant_set
from specpilot.pilot.paired import _salter
from specpilot.pilot.setup import build_requests
from specpilot.provenance import git_commit, versions
from specpilot.serve.system_file import load_sealed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("pilot_dir")
    ap.add_argument("out")
    ap.add_argument("--sizes", default="16,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--systems", default="ar,plan,plan33,plan_ngram,plan_ar")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = [int(x) for x in args.sizes.split(",")]
    sealed = load_sealed(Path(args.pilot_dir), Path(args.target), args.device != "cuda", None, args.device)
    plan = sealed.config
    first = plan.configs[0]
    dep = Deployment(Path(args.target), None, dtype=first.dtype, device=args.device)
    wide = first.apply({"shared_budget": (32,) * 32}) if first.row_selection == "shared_budget" else first
    ngram = first.apply({"drafter": "ngram", "drafter_path": None})
    systems = {"ar": SystemConfig.ar(dtype=first.dtype), "plan": plan,
               "plan33": LoadPlan(plan.sizes, (wide,) + plan.configs[1:]),
               "plan_ngram": LoadPlan(plan.sizes, (ngram,) + plan.configs[1:]),
               "plan_ar": LoadPlan(plan.sizes, (SystemConfig.ar(dtype=first.dtype),) + plan.configs[1:])}
    systems = {k: v for k, v in systems.items() if k in args.systems.split(",")}
    rows = {k: (v.tree_rows(max(sizes)) if isinstance(v, LoadPlan) else 0) for k, v in systems.items()}
    print("tree rows per request:", rows, flush=True)
    context = min(dep.target.args.max_position_embeddings, 4096)
    reqs = [r for r in build_requests(dep, 2, args.new) if len(r.prompt_ids) + ctl.SALT_TOKENS + r.max_new_tokens <= context]
    groups: dict = {}
    for r in reqs:
        groups.setdefault(r.benchmark, []).append(r)
    max_len = max(len(r.prompt_ids) + r.max_new_tokens for r in reqs) + ctl.SALT_TOKENS + 1
    makers = {k: (lambda n, c=c: dep.batch_system(c, max_num_seqs=n, max_len=max_len)) for k, c in systems.items()}
    avoid = frozenset(dep.eos_ids()) | frozenset(dep.tokenizer.all_special_ids if dep.tokenizer is not None else ())
    rng = random.Random(0)
    per_size = {}
    t0 = time.perf_counter()
    for n in sizes:
        m = measure_batches(makers, groups, [n], args.rounds, dep.target.args.vocab_size, avoid_ids=avoid, rng=rng)
        per_size[str(n)] = {"tokens_per_s": {k: m.tokens_per_s(k, n) for k in systems},
                            "vs_ar": {k: compare(m, "ar", k).to_dict() for k in systems if k != "ar"},
                            "outputs_equal_ar": {k: m.equal_outputs("ar", k) for k in systems if k != "ar"}}
        f = per_size[str(n)]
        print(n, {k: round(v, 1) for k, v in f["tokens_per_s"].items()},
              {k: (round(v["gain"], 4), round(v["lower_bound"], 4)) for k, v in f["vs_ar"].items()}, flush=True)
    profiles = {}
    n = max(sizes)
    salted = _salter(dep.target.args.vocab_size, avoid, rng)
    prompts = variant_set(groups[sorted(groups)[0]], n, salted)
    for k in [k for k in ("ar", "plan") if k in systems]:
        eng = makers[k](n)
        eng.capture_graphs()
        timed_batch(eng, prompts, args.new)  # warm
        pr = cProfile.Profile()
        pr.enable()
        _, dt, _ = timed_batch(eng, prompts, args.new)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        profiles[k] = {"wall_s_profiled": dt, "steps": eng.exact_passes, "top": s.getvalue()}
        (out / f"profile_{k}.txt").write_text(s.getvalue())
        print(k, "profiled run", round(dt, 3), "s", flush=True)
        del eng
    res = {"probe": "probes/plan_tax_gpu.py", "device": torch.cuda.get_device_name(0) if args.device == "cuda" else args.device, "versions": versions(),
           "commit": git_commit(), "sizes": sizes, "rounds": args.rounds, "max_new_tokens": args.new,
           "systems": {k: (v.describe() if isinstance(v, LoadPlan) else v.label()) for k, v in systems.items()},
           "tree_rows": rows, "per_size": per_size,
           "profiled_wall_s": {k: v["wall_s_profiled"] for k, v in profiles.items()},
           "duration_s": time.perf_counter() - t0}
    (out / "plan_tax.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("tree_rows", "profiled_wall_s")}))


if __name__ == "__main__":
    main()
