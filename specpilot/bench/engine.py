"""``specpilot bench`` (the systems suite): our AR and speculative systems side by side with transformers ``generate``.

One checkpoint, one device, one run: the exact pass's time by rows (c(N) for N = 1..256, through the
row-bucket static path, CUDA graphs on CUDA), the byte floor of an AR step from the measured copy
bandwidth and matmul rate, our systems' tokens/s and ms per step, and transformers' ``generate`` (AR and
prompt lookup) on the same prompt. Writes JSON (and a PNG of c(N)) under ``out``.
"""

from __future__ import annotations

import copy
import datetime as _dt
import json
import time
from pathlib import Path

import torch

from specpilot.config import SystemConfig
from specpilot.spec.ngram import NgramDrafter
from specpilot.model.checkpoint import DTYPES, load_model
from specpilot.engine.engine import Engine
from specpilot.engine.runner import BUCKETS
from specpilot.pilot.costmodel import floors_ms, pass_counts
from specpilot.pilot.profiler import measure_peaks
from specpilot.pilot.setup import measure_verify_ms
from specpilot.provenance import git_commit, versions


def _sync(dev) -> None:
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


def _ours(model, cfg: SystemConfig, prompt: list[int], new: int, buckets: bool) -> dict:
    drafter = NgramDrafter(cfg.ngram_max, cfg.ngram_min, max_matches=cfg.top_k) if cfg.drafter == "ngram" else None
    eng = Engine(model, cfg, drafter, eos_ids=[], buckets=buckets)
    eng.generate(prompt, 8)  # warm-up (graph capture)
    _sync(model.device)
    g = eng.generate(prompt, new)
    decode_s = g.time_s - g.prefill_s
    return {"system": cfg.label(), "tokens_per_s": g.tokens_per_s, "decode_tokens_per_s": (len(g.tokens) - 1) / decode_s,
            "ms_per_step": 1e3 * decode_s / max(g.steps, 1), "tau": g.tau, "steps": g.steps,
            "prefill_ms": 1e3 * g.prefill_s, "tokens": g.tokens}


def _hf(ckpt, dtype: str, device: str, prompt: list[int], new: int) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=DTYPES[dtype]).to(device).eval()
    ids = torch.tensor([prompt], device=device)
    out = {}
    for name, kw in (("ar", {}), ("prompt_lookup", {"prompt_lookup_num_tokens": 10})):
        # exactly n tokens through any EOS, as our engine runs here (eos_ids=[]): an empty EOS list (None falls back
        # to the model's EOS and stops there), not min_new_tokens, which masks EOS's logit and so changes the argmax
        cfg = copy.deepcopy(hf.generation_config)
        cfg.update(eos_token_id=[], do_sample=False, pad_token_id=0, **kw)
        gen = lambda n: hf.generate(ids, generation_config=cfg, max_new_tokens=n)
        gen(4)
        _sync(device)
        t0 = time.perf_counter()
        res = gen(new)
        _sync(device)
        dt = time.perf_counter() - t0
        toks = res[0, len(prompt):].tolist()
        out[name] = {"tokens_per_s": len(toks) / dt, "time_s": dt, "tokens": toks}
    del hf
    return out


def _decode_ms_per_step(g) -> float:
    """Decode wall ms per step of a :class:`Generation` (its time less the prefill)."""
    return 1e3 * (g.time_s - g.prefill_s) / max(g.steps, 1)


def _ar_step_profile(model, prompt: list[int], dtype: str, steps: int = 32) -> dict:
    """Kernel profile of one AR decode step through the engine (graphs): kernel time = generate
    ``steps + 1`` tokens minus generate 1 token (the prefill), per step; wall time = the engine's decode
    time per step (prefill excluded), median of the profiled calls' unprofiled twins. ``wall_over_kernels``
    is the launch-gap check."""
    from specpilot.pilot.kernel_profile import CLASSES, profile_kernels

    eng = Engine(model, SystemConfig.ar(dtype=dtype), None, eos_ids=[], buckets=True)
    long = profile_kernels(lambda: eng.generate(prompt, steps + 1), calls=3, warmup=1)
    short = profile_kernels(lambda: eng.generate(prompt, 1), calls=3, warmup=1)
    # wall per step from the engine's own clock, prefill excluded (its jitter is not the step's)
    decode_ms = sorted(_decode_ms_per_step(eng.generate(prompt, steps + 1)) for _ in range(3))
    wall = decode_ms[1]
    kern = (long.kernel_ms - short.kernel_ms) / steps  # kernel times have no jitter: a difference is fine
    return {"steps": steps, "wall_ms_per_step": wall, "kernel_ms_per_step": kern, "wall_over_kernels": wall / kern,
            "kernels_per_step": (long.kernels - short.kernels) / steps,
            "by_class_ms": {c: (long.by_class_ms[c] - short.by_class_ms[c]) / steps for c in CLASSES},
            "top_kernels_of_generate": long.top}


def _pass_profiles(model, prefix_len: int, rows=(1, 33, 64)) -> dict:
    """Kernel profiles of the bare exact pass at a few row counts; gives c(N) from summed kernel time
    (``c_kernels``), free of host jitter, next to the wall-clock c."""
    from specpilot.pilot.kernel_profile import profile_passes

    return {r: {k: v for k, v in p.to_dict().items() if k != "top"}
            for r, p in profile_passes(model, rows, prefix_len).items()}


def result_stem(out: Path, ckpt, device: str, label: str | None = None) -> str:
    """File stem of a bench result in ``out``: ``bench_<checkpoint dir name>_<device type>_<date>`` (``label``
    instead of ``bench_<checkpoint dir name>`` when given, e.g. ``w12_bench``), with a ``_HHMMSS`` (then a
    counter) suffix when that JSON exists already: no earlier result is overwritten."""
    stem = f"{label or 'bench_' + Path(ckpt).name}_{torch.device(device).type}_{_dt.date.today().isoformat()}"
    if (out / f"{stem}.json").exists():
        stem += "_" + _dt.datetime.now().strftime("%H%M%S")
        base, i = stem, 1
        while (out / f"{stem}.json").exists():
            stem, i = f"{base}_{i}", i + 1
    return stem


def run_bench(ckpt, device: str = "cuda", dtype: str = "bfloat16", prefix_len: int = 512, new_tokens: int = 128,
              out_dir: str | Path = "results", rows=tuple(sorted({*BUCKETS, 33})), with_transformers: bool = True, seed: int = 0) -> dict:
    """Run the side-by-side benchmark and write ``out_dir/bench_<name>_<device>_<date>.json`` (+ PNG; a
    ``_HHMMSS`` suffix when that file exists already, so no earlier result is overwritten).

    Returns the result dict: ``device``, ``versions``, ``commit``, ``checkpoint``, ``ar_ms_per_step``,
    ``byte_floor_ms`` (AR step, from measured peaks), ``pass_ms`` and ``c`` (rows → ms and ratio to 1 row),
    ``systems`` (ours), ``transformers`` (AR and prompt lookup), ``percent_of_floor``.

    Raises:
        CheckpointError: bad checkpoint directory.
    """
    model = load_model(ckpt, dtype, device)
    peaks = measure_peaks(device, DTYPES[dtype], seconds_budget=2.0)
    counts = pass_counts(model.args, 1, prefix_len, torch.finfo(DTYPES[dtype]).bits // 8)
    floor = sum(floors_ms(counts, peaks).values())
    pass_ms = measure_verify_ms(model, prefix_len, rows, repeats=20, static=True)
    g = torch.Generator().manual_seed(seed)
    # a prompt with repeats, so prompt lookup has something to find (random weights rarely repeat themselves)
    base = torch.randint(0, model.args.vocab_size, (prefix_len // 4,), generator=g).tolist()
    prompt = (base * 4)[:prefix_len]
    systems = [_ours(model, SystemConfig.ar(dtype=dtype), prompt, new_tokens, buckets=True),
               _ours(model, SystemConfig.ar(dtype=dtype), prompt, new_tokens // 4, buckets=False) | {"system": "AR (eager, no graphs)"},
               _ours(model, SystemConfig.stock("ngram", dtype=dtype), prompt, new_tokens, buckets=True),
               _ours(model, SystemConfig(drafter="ngram", tree="best_first", nodes=32, depth=8, top_k=8, dtype=dtype),
                     prompt, new_tokens, buckets=True)]
    ar_ms = systems[0]["ms_per_step"]
    res = {
        "device": peaks.device_name, "versions": versions(), "commit": git_commit(),
        "date": _dt.datetime.now().isoformat(timespec="seconds"), "checkpoint": str(ckpt), "dtype": dtype,
        "prefix_len": prefix_len, "new_tokens": new_tokens, "threads": torch.get_num_threads(), "peaks": peaks.to_dict(),
        "ar_ms_per_step": ar_ms, "ar_tokens_per_s": 1e3 / ar_ms, "byte_floor_ms": floor,
        "percent_of_floor": 100 * floor / ar_ms, "pass_ms": pass_ms,
        "c": {r: ms / pass_ms[min(pass_ms)] for r, ms in pass_ms.items()},
        "systems": systems,
    }
    res["kernels"] = {"fused": model.fused_on(torch.zeros(1, device=device)), "skinny_gemm": model.kernels.skinny_gemm,
                      "buckets": list(BUCKETS)}
    if torch.device(device).type == "cuda":
        res["ar_step_profile"] = _ar_step_profile(model, prompt, dtype)
        res["pass_profiles"] = _pass_profiles(model, prefix_len)
        k1 = res["pass_profiles"][1]["kernel_ms"]
        res["c_kernels"] = {r: p["kernel_ms"] / k1 for r, p in res["pass_profiles"].items()}
    if with_transformers:
        res["transformers"] = _hf(ckpt, dtype, device, prompt, new_tokens)
        res["ar_equals_transformers"] = systems[0]["tokens"] == res["transformers"]["ar"]["tokens"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = result_stem(out, ckpt, device)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=2))
    _plot(res, out / f"{stem}.png")
    return res


def _plot(res: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5))
    ax = fig.add_subplot()
    rows = sorted(res["c"])
    ax.plot(rows, [res["c"][r] for r in rows], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows per exact pass (N + 1)")
    ax.set_ylabel("c = T_pass(rows) / T_pass(1)")
    ax.set_title(f"{Path(res['checkpoint']).name} on {res['device']}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
