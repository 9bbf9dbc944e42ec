"""``specpilot bench --suite tlv``: a TLV cycle's time split beside the best single-pass system (§4.3, §6).

On a random Qwen3-8B-shaped bf16 target, one 512-token prompt, the drafter the ``calibrated`` one: acceptance
SIMULATED from a calibration of the bundled pair's block drafter (recorded here on 8 bundled prompts), drafting cost
a random block network of the target's widths (1 layer, block 16, 3 target layers, a 32k draft vocabulary). Systems:

- AR, bf16 and ``w12`` (the engine's pipelined, graphed AR): the unit of c (the bf16 AR step), and each target's
  greedy output, which its systems' calibrated drafter is told (W12 sums in another order than cuBLAS, and the
  near-ties of random weights then give another output), and the outputs of three warm-up runs of the system itself
  (an exact pass of 33 rows rounds otherwise than a one-row pass: the output moves off AR's at a near-tie, which
  token forcing would judge, and a calibrated drafter that knows no continuation proposes nothing);
- single pass: calibrated best_first N = 32 (depth 16, top-16), bf16 and ``w12``;
- TLV: the same drafter and N with the Q pass over the W12 records' 8-bit view (``w12`` + ``view8``), and over an
  INT8 copy of a bf16 target (``int8``).

Per system: ms per exact pass (decode steps, prefill excluded, median of interleaved rounds), τ, tokens/s, c, and
the GPU time per region from a profiled run (CUDA events: drafter, q_pass, exact_pass, other), plus the TLV chains'
mean length. The Q pass's agreement with the exact pass is measured on the random target too (its argmax along
the AR output, :func:`~specpilot.pilot.replay_tlv.record_q`): random weights make that agreement a property of
random weights, so the TLV figures here time the cycle; their τ is not a real pair's. Written to
``<out>/tlv_bench_<device>_<date>.json``.
"""

from __future__ import annotations

import hashlib
import json
import time

import torch

from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.engine.engine import Engine
from specpilot.model.qview import q_extra_bytes, q_view
from specpilot.pilot.profiler import StepProfiler
from specpilot.pilot.replay import Recording, record
from specpilot.pilot.replay_tlv import record_q
from specpilot.provenance import git_commit, versions
from specpilot.spec.calibrated import CalibratedDrafter
from specpilot.spec.calibration import calibrate, simulation_note
from specpilot.spec.cost_drafter import cost_drafter
from specpilot.w12.convert import to_w12
from specpilot.zoo import bundled_block_dir, bundled_target_dir
from specpilot.zoo.random_ckpt import random_transformer

PROMPT, NEW, ROUNDS, N, DEPTH = 512, 96, 3, 32, 16
COST = {"kind": "block", "layers": 1, "block_size": 16, "markov_rank": 0, "n_target_layers": 3,
        "draft_vocab_size": 32768}


def _calibration(device: str):
    """A calibration of the bundled pair's block drafter (top-16, 16 positions) on 8 bundled prompts x 64 tokens."""
    from specpilot.data.benchmarks import load_mix

    dep = Deployment(bundled_target_dir(), block_dirs=[bundled_block_dir()], device=device)
    reqs = load_mix(2, dep.tokenizer)
    prompts = [dep.tokenizer(r.text, add_special_tokens=False)["input_ids"] for r in reqs]
    ar = [dep.system(SystemConfig.ar(), eos_ids=[]).generate(p, 64).tokens for p in prompts]
    drafter = dep.system(SystemConfig(drafter="block", drafter_path=str(bundled_block_dir()), top_k=16)).drafter
    rec = record(drafter, prompts, ar, DEPTH, 16, target=dep.target)
    return calibrate(rec, cost=COST, source={"drafter": "bundled block", "requests": len(prompts)})


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _decode_ms(engine: Engine, prompt: list[int], new: int):
    """(ms per exact pass of the decode steps, the generation): a 1-token run's time (prefill) subtracted."""
    dev = engine.target.device
    _sync(dev)
    t0 = time.perf_counter()
    engine.generate(prompt, 1)
    _sync(dev)
    t1 = time.perf_counter()
    gen = engine.generate(prompt, 1 + new)
    _sync(dev)
    dt = (time.perf_counter() - t1) - (t1 - t0)
    return dt * 1e3 / max(gen.steps, 1), gen


def run(out_path: str, device: str = "cuda", arch: str = "qwen3-8b", overrides: dict | None = None) -> dict:
    """Run the suite on ``device`` (the current CUDA device by default; the CPU and a small ``arch`` / ``overrides``
    only to test the suite itself); write and return the JSON."""
    dev = torch.device(device)
    cal = _calibration(device)
    target = random_transformer(arch, dev, overrides=overrides)
    w12 = to_w12(target)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 1000, (PROMPT,), generator=g).tolist()
    kw = dict(eos_ids=[], buckets=True, max_len=PROMPT + NEW + 64)
    ars = {"bf16": Engine(target, SystemConfig.ar(dtype="bfloat16"), None, **kw),
           "w12": Engine(w12, SystemConfig.ar(dtype="bfloat16", w12=True), None, **kw)}
    # each target's own greedy output: W12's GEMM sums in another order, and random weights have near-ties
    ar_tokens = {k: e.generate(prompt, 1 + NEW + DEPTH + 2).tokens for k, e in ars.items()}
    base = SystemConfig(drafter="calibrated", drafter_path="(built by the suite)", tree="best_first", nodes=N,
                        depth=DEPTH, top_k=16, dtype="bfloat16")

    def spec(t, cfg):
        d = CalibratedDrafter(cal, t.args.vocab_size, top_k=16, cost=cost_drafter(COST, t, 16), max_slots=1)
        d.expect(prompt, ar_tokens["w12" if cfg.w12 else "bf16"])
        return Engine(t, cfg, d, **kw)

    engines = {"ar": ars["bf16"], "ar_w12": ars["w12"],
               "single": spec(target, base), "single_w12": spec(w12, base.apply({"w12": True})),
               "tlv_w12_view8": spec(w12, base.apply({"w12": True, "tlv": True})),
               "tlv_int8": spec(target, base.apply({"tlv": True, "q_weights": "int8"}))}
    for e in engines.values():  # warm-up: graphs captured, first-use costs paid
        e.generate(prompt, 8)
    for k, e in engines.items():  # a pass of R rows rounds bf16 otherwise than AR's one row, and the near-ties of
        for _ in range(3 if e.drafter is not None else 0):  # random weights then change the output: the drafter
            e.drafter.expect(prompt, e.generate(prompt, 1 + NEW).tokens)  # is told each output it meets as well
    ms: dict = {k: [] for k in engines}
    gens = {}
    for _ in range(ROUNDS):
        for k, e in engines.items():
            t, gens[k] = _decode_ms(e, prompt, NEW)
            ms[k].append(t)
    med = {k: sorted(v)[len(v) // 2] for k, v in ms.items()}
    systems = {}
    for k, e in engines.items():
        gen = gens[k]
        row = {"label": e.config.label(), "ms_per_exact_pass": med[k], "ms_runs": ms[k], "steps": gen.steps,
               "tau": gen.tau, "c": med[k] / med["ar"], "tokens_per_s": 1e3 * gen.tau / med[k],
               "speedup_vs_ar": (1e3 * gen.tau / med[k]) / (1e3 / med["ar"]),
               "tokens_equal_ar": gen.tokens == ar_tokens["w12" if e.config.w12 else "bf16"][: len(gen.tokens)],
               "tokens_sha256": hashlib.sha256(str(gen.tokens).encode()).hexdigest()[:16]}
        if k.startswith(("single", "tlv")):
            prof = StepProfiler(dev)
            pg = e.generate(prompt, 1 + NEW, prof=prof)
            row["gpu_ms_per_exact_pass"] = {r: v / max(pg.steps, 1) for r, v in prof.totals_ms().items()}
            row["simulated"] = simulation_note(e.config)
        if gen.chains:
            row["mean_chain"] = sum(gen.chains) / len(gen.chains)
            row["q_extra_bytes"] = q_extra_bytes(e.tlv.q)
        systems[k] = row
    agree = {}
    for w, t, k in (("view8", w12, "w12"), ("int8", target, "bf16")):
        rec = Recording([prompt], [ar_tokens[k][:64]], depth=DEPTH)
        agree[w] = record_q(t, q_view(t, w), rec, 4, w).agreement(rec)
    res = {"suite": "tlv", "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "commit": git_commit(), "versions": versions(), "target": f"random {arch} shape, bf16", "overrides": overrides, "prompt_tokens": PROMPT, "new_tokens": NEW, "rounds": ROUNDS,
           "drafter": f"calibrated (SIMULATED acceptance: the bundled block drafter's, {cal.source}); cost: {COST}",
           "q_agreement_random_target": agree, "ar_ms_per_step": med["ar"], "systems": systems}
    with open(out_path, "w") as f:
        json.dump(res, f, indent=2)
    return res
