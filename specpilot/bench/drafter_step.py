"""``specpilot bench --suite drafter-step``: what a learned drafter's step costs beside an AR step (§1.1, §2.2).

On a random Qwen3-8B-shaped bf16 target with a random block drafter of the target's widths (one layer, block 16,
reading three target layers; the acceptance of random weights is ~0, so every step accepts its bonus token only,
while the pass shapes are those of a trained drafter), each system decodes one 512-token prompt:

- AR: the engine's pipelined, graphed AR (tokens/s of the decode steps, prefill excluded): the AR step;
- block and block_markov drafters, over the whole vocabulary and over a 32k draft vocabulary (dv32k), at chain
  N = 16 and best_first N = 32 (depth 16, top-16): per step, the drafter's work, the 32-node exact pass and the
  host's tree work, with the drafter's step as one CUDA graph
  (:class:`~specpilot.spec.block_step.StaticBlockStep`, target features captured in the exact pass's graph) and once
  eager (the drafter's launches one by one), and for the draft-vocabulary drafters also compiled (``torch.compile``
  of the static pass, then the graph: ``BlockDrafter(compile_step=True)``).

Per system: ms per step (``(t(1 + n) − t(1)) / steps``, median of interleaved rounds), the ratio to the AR step, the
GPU time per region from a profiled run (CUDA events: drafter, exact_pass, other), and whether the graphed and
eager drafters gave the same tokens. Written to ``<out>/drafter_step_bench_<device>_<date>.json``.
"""

from __future__ import annotations

import hashlib
import time

import torch

from specpilot.config import SystemConfig
from specpilot.engine.engine import Engine
from specpilot.pilot.profiler import StepProfiler
from specpilot.provenance import git_commit, versions
from specpilot.spec.block import BlockDrafter
from specpilot.spec.cost_drafter import cost_drafter
from specpilot.zoo.random_ckpt import random_transformer

PROMPT, NEW, ROUNDS = 512, 96, 3
SYSTEMS = [("chain", 16), ("best_first", 32)]
#: (name, Markov rank, draft vocabulary size (0: the target's 151,936 ids), modes)
DRAFTERS = [("block", 0, 0, ("graph", "eager")), ("block_dv32k", 0, 32768, ("graph", "compiled")),
            ("block_markov", 16, 0, ("graph", "eager")), ("block_markov_dv32k", 16, 32768, ("graph", "compiled"))]


def _decode_ms(engine: Engine, prompt: list[int], new: int) -> tuple[float, list[int], int]:
    """(ms per decode step, tokens, steps) of one request: a 1-token run's time (prefill) subtracted."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.generate(prompt, 1)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    gen = engine.generate(prompt, 1 + new)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t1) - (t1 - t0)
    return dt * 1e3 / max(gen.steps, 1), gen.tokens, gen.steps


def _split(engine: Engine, prompt: list[int], new: int) -> dict:
    """GPU ms per step of each profiled region (drafter, exact_pass, other) over one request."""
    prof = StepProfiler("cuda")
    gen = engine.generate(prompt, 1 + new, prof=prof)
    return {k: v / max(gen.steps, 1) for k, v in prof.totals_ms().items()}


def run(out_path: str) -> dict:
    """Run the suite on the current CUDA device; write and return the JSON."""
    dev = torch.device("cuda")
    target = random_transformer("qwen3-8b", dev)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 1000, (PROMPT,), generator=g).tolist()
    engines = {"ar": Engine(target, SystemConfig.ar(dtype="bfloat16"), None, eos_ids=[], buckets=True,
                            max_len=PROMPT + NEW + 64)}
    compile_s = {}
    for kind, rank, vocab, modes in DRAFTERS:
        spec = {"kind": "block", "layers": 1, "block_size": 16, "markov_rank": rank, "n_target_layers": 3,
                "draft_vocab_size": vocab}
        net = cost_drafter(spec, target, 16).net
        for tree, nodes in SYSTEMS:
            cfg = SystemConfig(drafter="block", tree=tree, nodes=nodes, depth=16, top_k=16, dtype="bfloat16")
            for mode in modes:
                t_build = time.perf_counter()  # a compiled step compiles and captures every width here
                drafter = BlockDrafter(net, target, top_k=16, static_step=mode != "eager",
                                       compile_step=mode == "compiled")
                engines[f"{kind}/{tree}_N{nodes}/{mode}"] = Engine(target, cfg, drafter, eos_ids=[], buckets=True,
                                                                   max_len=PROMPT + NEW + 64)
                compile_s[f"{kind}/{tree}_N{nodes}/{mode}"] = time.perf_counter() - t_build
    for e in engines.values():  # warm-up: graphs captured, first-use costs paid
        e.generate(prompt, 8)
    ms: dict = {k: [] for k in engines}
    tokens, steps = {}, {}
    for _ in range(ROUNDS):
        for k, e in engines.items():
            t, tokens[k], steps[k] = _decode_ms(e, prompt, NEW)
            ms[k].append(t)
    med = {k: sorted(v)[len(v) // 2] for k, v in ms.items()}
    ar = med["ar"]
    systems = {}
    for k, e in engines.items():
        row = {"ms_per_step": med[k], "ms_runs": ms[k], "steps": steps[k], "ratio_to_ar_step": med[k] / ar,
               "tokens_sha256": hashlib.sha256(str(tokens[k]).encode()).hexdigest()[:16],
               "tokens_equal_ar": tokens[k] == tokens["ar"]}
        if k != "ar":
            row["gpu_ms_per_step"] = _split(e, prompt, NEW)
            twin = k.rsplit("/", 1)[0] + ("/eager" if k.endswith("/graph") else "/graph")
            if twin in tokens:
                row["tokens_equal_other_mode"] = tokens[k] == tokens[twin]
            if k.endswith("/compiled"):
                row["compile_s"] = compile_s[k]
        systems[k] = row
    res = {"suite": "drafter-step", "device": torch.cuda.get_device_name(), "commit": git_commit(),
           "versions": versions(), "target": "random qwen3-8b shape, bf16", "prompt_tokens": PROMPT,
           "new_tokens": NEW, "rounds": ROUNDS, "ar_ms_per_step": ar, "ar_tokens_per_s": 1e3 / ar,
           "drafter": "random block net: 1 layer of the target's widths, block 16, 3 target layers; top-16; "
                      "dv32k: a draft vocabulary of the first 32,768 ids",
           "systems": systems,
           "bar": {f"{k} ratio_to_ar_step <= 1.15": systems[k]["ratio_to_ar_step"] <= 1.15
                   for k in ("block/best_first_N32/graph", "block_dv32k/best_first_N32/graph",
                             "block_dv32k/best_first_N32/compiled")}}
    import json

    with open(out_path, "w") as f:
        json.dump(res, f, indent=2)
    return res
