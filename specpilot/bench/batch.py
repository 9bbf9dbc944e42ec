"""``specpilot bench --batch 1,2,4,...``: the batched engine under load, AR beside a speculative system (§2.2, §5.2).

For every batch size B and both systems, on one checkpoint:

- **open loop**: B requests (a ``prefix``-token prompt each, ``new_tokens`` to generate) submitted at once to an
  engine of B slots: aggregate tokens/s (all new tokens over the wall time, prefills included), decode tokens/s
  (tokens of the steps that ran no prefill over their time: the batch's steady state), per-request tokens/s, time
  to first token and inter-token latency (per request, from the host clock after each step), and every decode
  step's wall time with its rows (``[root] + tree`` of every request);
- **closed loop**: B clients, each submitting its next request as soon as its last one finished, 2B requests in
  all (requests join a running batch and queue for slots).

The single-request engine's tokens/s (pipelined AR, graphed on CUDA) is recorded beside batch 1 of the batched
engine, and every size's aggregate is quoted against both. Correctness beside speed: every prompt is also run
through the batched engine one request at a time (batch 1), and each batched output is compared with it and with
the single-request engine's output of the same system. The outputs at the largest B are token-forced (§3.4)
against batch-1 AR of the batched engine, as the pilot judges a candidate against stock, with Phase 0's δ (the
largest scorer margin where the batch-1 speculative system first parts from batch-1 AR, rounded up to 1/8; fixed
before any batched output is seen). With batch-invariant GEMMs (the default) a batched output is its batch-1
output bit for bit, in bf16 too; the single-request engine runs other kernels (split-KV attention, cuBLAS), and
its bf16 outputs differ from the batched engine's by rounding, which a second forcing audit (the batched engine's
batch-1 AR against the single-request engine's) measures.
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from pathlib import Path

import torch

from specpilot.config import SystemConfig
from specpilot.engine.batch import Request
from specpilot.engine.deployment import Deployment
from specpilot.pilot.forcing import Scorer, audit, delta_from_phase0, forcing_verdict
from specpilot.provenance import git_commit, versions
from specpilot.spec.calibration import simulation_note


def _sync(dev) -> None:
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize(dev)


def prompts_for(vocab: int, n: int, prefix: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``prefix`` ids, each a random block repeated (so prompt lookup has something to find)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        base = torch.randint(0, vocab, (max(prefix // 4, 1),), generator=g).tolist()
        out.append((base * 4 + base)[:prefix])
    return out


def run_load(engine, prompts: list[list[int]], new_tokens: int, clients: int | None = None) -> dict:
    """Drive ``engine`` (a :class:`~specpilot.engine.batch.BatchEngine`) through ``prompts``: all at once
    (``clients`` None: open loop) or ``clients`` at a time, each next request submitted when one finishes (closed
    loop). Returns aggregate and per-request figures (seconds and tokens/s) and the decode steps (ms, rows)."""
    dev = engine.target.device
    pending = list(enumerate(prompts))
    t_sub, t_first, t_last, tokens, gaps = {}, {}, {}, {}, {}
    steps = []

    def submit():
        i, p = pending.pop(0)
        engine.add_request(Request(f"q{i}", p, new_tokens))
        t_sub[f"q{i}"] = time.perf_counter()

    for _ in range(len(prompts) if clients is None else min(clients, len(prompts))):
        submit()
    _sync(dev)
    t0 = time.perf_counter()
    while engine.has_work():
        before, prefills = engine.exact_passes, engine.prefill_passes
        s0 = time.perf_counter()
        outs = engine.step()
        _sync(dev)
        now = time.perf_counter()
        if engine.exact_passes > before:
            steps.append({"ms": 1e3 * (now - s0), "requests": sum(1 for o in outs),
                          "rows": sum(o.drafted + 1 for o in outs), "prefill": engine.prefill_passes > prefills,
                          "tokens": sum(len(o.new_tokens) for o in outs)})
        for o in outs:
            if o.new_tokens:
                if o.request_id not in t_first:
                    t_first[o.request_id] = now
                else:
                    gaps.setdefault(o.request_id, []).append((now - t_last[o.request_id]) / len(o.new_tokens))
                t_last[o.request_id] = now
                tokens.setdefault(o.request_id, []).extend(o.new_tokens)
            if o.finished and pending:
                submit()
    wall = time.perf_counter() - t0
    ids = sorted(tokens, key=lambda k: int(k[1:]))
    n_tok = sum(len(tokens[k]) for k in ids)
    ttft = [t_first[k] - t_sub[k] for k in ids]
    itl = [g for k in ids for g in gaps.get(k, [])]
    decode = [s for s in steps if not s["prefill"]]  # steps that only decoded: the batch's steady state
    decode_s = sum(s["ms"] for s in decode) / 1e3
    return {"requests": len(ids), "wall_s": wall, "tokens": n_tok, "aggregate_tokens_per_s": n_tok / wall,
            "decode_tokens_per_s": sum(s["tokens"] for s in decode) / decode_s if decode_s else None,
            "per_request_tokens_per_s": sum(len(tokens[k]) / (t_last[k] - t_sub[k]) for k in ids) / len(ids),
            "ttft_ms_mean": 1e3 * sum(ttft) / len(ttft), "ttft_ms_max": 1e3 * max(ttft),
            "itl_ms_mean": 1e3 * sum(itl) / len(itl) if itl else None,
            "step_ms_mean": sum(s["ms"] for s in steps) / len(steps) if steps else None,
            "rows_per_step_mean": sum(s["rows"] for s in steps) / len(steps) if steps else None,
            "steps": steps, "outputs": [tokens[k] for k in ids]}


def run_batch_bench(target, sizes: list[int], spec: SystemConfig, device: str = "cuda", dtype: str = "bfloat16",
                    prefix: int = 512, new_tokens: int = 128, out_dir: str | Path = "results",
                    delta: float | None = None,
                    drafter: str | Path | None = None) -> dict:
    """Run the batch bench (module doc) for AR and ``spec`` at every size of ``sizes``; write
    ``out_dir/batch_bench_<target name>_<device type>_<date>.json`` (+ PNG). Returns the result dict.

    Raises:
        CheckpointError / DrafterError: bad checkpoint or drafter; ValueError: empty or non-positive sizes.
    """
    if not sizes or min(sizes) < 1:
        raise ValueError(f"batch sizes must be positive, got {sizes}")
    dep = Deployment(target, drafter, dtype=dtype, device=device)
    vocab = dep.target.args.vocab_size
    prompts = prompts_for(min(vocab, 1000), 2 * max(sizes), prefix)
    systems = {"ar": SystemConfig.ar(dtype=dtype), "spec": spec.model_copy(update={"dtype": dtype})}
    max_len = prefix + new_tokens + 8
    res: dict = {"device": torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu",
                 "versions": versions(), "commit": git_commit(), "date": _dt.datetime.now().isoformat(timespec="seconds"),
                 "target": str(target), "dtype": dtype, "prefix": prefix, "new_tokens": new_tokens, "sizes": sizes,
                 "systems": {k: v.label() for k, v in systems.items()}, "runs": {}}
    n = 2 * max(sizes)
    single, batch1, res["single_engine"] = {}, {}, {}
    for name, cfg in systems.items():  # the single-request engine (batch 1, graphed and pipelined on CUDA)
        one = dep.system(cfg)
        gens = [one.generate(p, new_tokens) for p in prompts[:n]]
        single[name] = [g.tokens for g in gens]
        rates = sorted(len(g.tokens) / g.time_s for g in gens[1:] or gens)  # the first pays graph captures
        res["single_engine"][name] = {"tokens_per_s_median": rates[len(rates) // 2], "requests": len(rates)}
        eng = dep.batch_system(cfg, max_num_seqs=1, max_len=max_len)  # the batched engine, one request at a time
        eng.capture_graphs()
        batch1[name] = run_load(eng, prompts[:n], new_tokens, clients=1)["outputs"]
        del eng
        if name == "ar" and spec.drafter == "calibrated":  # SIMULATED acceptance: the drafter is told AR's outputs
            for p, a, b in zip(prompts[:n], single["ar"], batch1["ar"]):  # (both engines': bf16 may part at ties)
                for store in (dep.continuations, dep.batch_continuations):
                    store.add(p, a)
                    store.add(p, b)
            res["simulated"] = simulation_note(systems["spec"])
    res["batch_invariant"] = dep.target.kernels.batch_invariant
    for name, cfg in systems.items():
        for b in sizes:
            eng = dep.batch_system(cfg, max_num_seqs=b, max_len=max_len)
            graphs = eng.capture_graphs()  # every bucket's graph before anything is timed
            run_load(eng, prompts[:b], 4)  # warm-up
            open_ = run_load(eng, prompts[:b], new_tokens)
            closed = run_load(eng, prompts[: 2 * b], new_tokens, clients=b)
            same = sum(o == r for o, r in zip(closed["outputs"], batch1[name])) / len(closed["outputs"])
            same_single = sum(o == r for o, r in zip(closed["outputs"], single[name])) / len(closed["outputs"])
            res["runs"][f"{name}@{b}"] = {"open": {k: v for k, v in open_.items() if k != "outputs"},
                                          "closed": {k: v for k, v in closed.items() if k != "outputs"},
                                          "outputs_equal_batch1": same, "outputs_equal_single_engine": same_single,
                                          "graphs": graphs,
                                          "padded_passes": eng.runner.passes if eng.runner is not None else 0,
                                          "_outputs": closed["outputs"]}
            if name == "spec" and spec.drafter == "calibrated":  # how much of each request the drafter knew
                res["runs"][f"{name}@{b}"]["drafter_counts"] = dict(eng.drafter.counts)
            print(f"{name} batch {b}: {open_['aggregate_tokens_per_s']:.1f} tok/s open, "
                  f"{closed['aggregate_tokens_per_s']:.1f} closed; outputs equal to batch 1: {same:.2f}", flush=True)
            del eng
    scorer = Scorer(dep.target)
    if delta is None:  # Phase 0's near-tie threshold (§3.4): where batch-1 speculation first parts from batch-1 AR
        delta = delta_from_phase0(scorer, prompts[:n], batch1["ar"], batch1["spec"])
        res["delta_source"] = "Phase 0: first divergences of the batch-1 speculative system from batch-1 AR"
    else:
        res["delta_source"] = "given"
    res["delta"] = delta
    def forced(outs, ref_stats):
        st = audit(scorer, [(p, o, "batch") for p, o in zip(prompts[:n], outs)], delta)
        if ref_stats is None:
            return st, st.to_dict()
        passed, reasons = forcing_verdict(st, ref_stats, "the reference")
        return st, {**st.to_dict(), "passed": passed, "reasons": reasons}

    ref, _ = forced(batch1["ar"], None)
    res["forcing_reference"] = f"AR at batch 1 ({len(batch1['ar'])} requests one at a time, the batched engine)"
    for name in systems:
        res[f"forcing_{name}_at_{max(sizes)}"] = forced(res["runs"][f"{name}@{max(sizes)}"]["_outputs"], ref)[1]
    single_ref, res["forcing_single_engine_ar"] = forced(single["ar"], None)
    res["forcing_batch1_ar_vs_single_engine_ar"] = forced(batch1["ar"], single_ref)[1]
    for r in res["runs"].values():
        r.pop("_outputs")
    res["speedup_vs_batch1_ar"] = {k: r["open"]["aggregate_tokens_per_s"] / res["runs"][f"ar@{min(sizes)}"]["open"][
        "aggregate_tokens_per_s"] for k, r in res["runs"].items()}
    single_ar = res["single_engine"]["ar"]["tokens_per_s_median"]  # the stricter base: pipelined, graphed AR
    res["speedup_vs_single_engine_ar"] = {k: {"aggregate": r["open"]["aggregate_tokens_per_s"] / single_ar,
                                              "decode": (r["open"]["decode_tokens_per_s"] or 0.0) / single_ar}
                                          for k, r in res["runs"].items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"batch_bench_{Path(target).name}_{torch.device(device).type}_{_dt.date.today().isoformat()}"
    i = 1
    while (out / f"{stem}.json").exists():
        stem, i = f"{stem.rsplit('_run', 1)[0]}_run{i}", i + 1
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    _plot(res, out / f"{stem}.png")
    res["path"] = str(out / f"{stem}.json")
    return res


def _plot(res: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5))
    ax = fig.add_subplot(1, 1, 1)
    for (name, label), color in zip(res["systems"].items(), ("C0", "C1")):
        xs = res["sizes"]
        opened = [res["runs"][f"{name}@{b}"]["open"] for b in xs]
        ax.plot(xs, [o["aggregate_tokens_per_s"] for o in opened], "o-", color=color, label=f"{label}, whole run")
        ax.plot(xs, [o.get("decode_tokens_per_s") or 0.0 for o in opened], "s--", color=color,
                label=f"{label}, decode steps")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in the batch")
    ax.set_ylabel("aggregate tokens/s (open loop)")
    if "single_engine" in res:
        ax.axhline(res["single_engine"]["ar"]["tokens_per_s_median"], color="gray", lw=0.8, ls=":",
                   label="single-request engine, AR")
    ax.set_title(f"{Path(res['target']).name}, {res['device']}, {res['dtype']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
