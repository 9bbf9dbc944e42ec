"""Where a speculative step's time goes on a GPU: the bundled pair (or ``--target``) in bf16, AR
(pipelined) against n-gram / draft-model / block-drafter systems, with each step split into drafter, tree,
exact pass (the tree mask, the host buffer fill, the launch and the wait for the device), cache compaction
(``keep_path``) and the rest (acceptance, the host read of the argmax, bookkeeping); and the GPU time of one
graph replay per row bucket. JSON to argv[1].

    python probes/spec_step_breakdown.py OUT.json [--target DIR] [--tokens 96] [--requests 2 (per benchmark)]

``equals_ar`` compares each system's tokens with AR's; in bf16 on a GPU it is expected to be false at times
(a pass of another row bucket rounds differently), so it is not a losslessness check: the float32 CPU tests
and the pilot's token forcing are.

Why: on an H200 the bundled 6M target's AR step is ~0.18 ms and no speculative system beat AR in the
session-7 pilot (outside factor 0.71–0.74). This says whether the gap is the device pass or the host.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch

import specpilot.engine.engine as engine_mod
from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.pilot.setup import build_requests
from specpilot.provenance import git_commit, versions
from specpilot.zoo import bundled_block_dir, bundled_drafter_dir, bundled_target_dir


def sync() -> None:
    """Wait for the GPU (no-op on the CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, acc: dict, key: str, wait: bool = False):
    """``fn`` wrapped to add its wall time (s) to ``acc[key]`` (after a device sync when ``wait``)."""
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        if wait:
            sync()
        acc[key] = acc.get(key, 0.0) + time.perf_counter() - t0
        return out
    return wrapper


def replay_us(runner, b: int, reps: int = 200) -> float:
    """GPU µs of one back-to-back replay of bucket ``b``'s graph (CUDA events over ``reps`` replays)."""
    g = runner._graphs[b]
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1e3 / reps


def run_system(dep, cfg, prompts, tokens) -> dict:
    """Tokens/s, τ and the per-step split (ms) of ``cfg`` over ``prompts`` (after one warm-up request each)."""
    eng = dep.system(cfg)
    acc: dict[str, float] = {}
    for p in prompts:
        eng.generate(p, tokens)
    if eng.drafter is not None:
        eng.drafter.propose = timed(eng.drafter.propose, acc, "drafter")
        eng._verify = timed(eng._verify, acc, "exact_pass", wait=True)
        eng.cache.keep_path = timed(eng.cache.keep_path, acc, "keep_path")
    build = engine_mod.build_tree
    engine_mod.build_tree = timed(build, acc, "tree")
    try:
        n_tok = steps = 0
        wall = 0.0
        outs = []
        for p in prompts:
            sync()
            t0 = time.perf_counter()
            g = eng.generate(p, tokens)
            sync()
            wall += time.perf_counter() - t0 - g.prefill_s
            n_tok += len(g.tokens) - 1
            steps += g.steps
            outs.append(g.tokens)
    finally:
        engine_mod.build_tree = build
    res = {"label": cfg.label(), "tokens_per_s": n_tok / wall, "ms_per_token": 1e3 * wall / n_tok,
           "steps": steps, "tau": n_tok / max(steps, 1), "ms_per_step": 1e3 * wall / max(steps, 1)}
    res["split_ms_per_step"] = {k: 1e3 * v / max(steps, 1) for k, v in acc.items()}
    res["split_ms_per_step"]["rest"] = res["ms_per_step"] - sum(res["split_ms_per_step"].values())
    if eng.runner is not None and eng.runner.graphs:
        res["replay_us"] = {b: replay_us(eng.runner, b) for b in (1, 2, 4, 8, 16) if b in eng.runner._graphs}
    res["_tokens"] = outs
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--target", default=None)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=2, help="prompts per benchmark")
    a = ap.parse_args()
    bundled = a.target is None
    dep = Deployment(a.target or bundled_target_dir(), bundled_drafter_dir() if bundled else None,
                     dtype="bfloat16", device=a.device, block_dirs=[bundled_block_dir()] if bundled else ())
    prompts = [list(r.prompt_ids) for r in build_requests(dep, a.requests, a.tokens)]
    kw = dict(dtype="bfloat16")
    systems = [SystemConfig.ar(**kw), SystemConfig.stock("ngram", 4, **kw),
               SystemConfig(drafter="ngram", tree="best_first", nodes=6, depth=6, top_k=4, **kw)]
    if bundled:
        systems += [SystemConfig.stock("draft_model", 4, **kw),
                    SystemConfig(drafter="block", tree="chain", nodes=6, depth=6, top_k=1, **kw),
                    SystemConfig(drafter="block", tree="best_first", nodes=8, depth=6, top_k=4, **kw)]
    res = {"device": torch.cuda.get_device_name(0) if a.device != "cpu" else "cpu", "versions": versions(), "commit": git_commit(),
           "method": __doc__.strip().splitlines()[0], "prompts": len(prompts), "max_new_tokens": a.tokens,
           "systems": []}
    ar_tokens = None
    for cfg in systems:
        r = run_system(dep, cfg, prompts, a.tokens)
        toks = r.pop("_tokens")
        ar_tokens = toks if ar_tokens is None else ar_tokens
        r["equals_ar"] = toks == ar_tokens
        res["systems"].append(r)
        print(json.dumps(r), flush=True)
    # where the host time of a speculative step goes, by function (cProfile slows Python calls: relative only)
    eng = dep.system(systems[2])
    prof = cProfile.Profile()
    prof.enable()
    for p in prompts:
        eng.generate(p, a.tokens)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    res["cprofile_" + systems[2].label()] = buf.getvalue()
    json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
