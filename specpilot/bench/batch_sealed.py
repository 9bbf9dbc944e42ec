"""``specpilot bench --batch SIZES --system PILOT_DIR``: the systems a batched pilot sealed, as a server runs them
(one :class:`~specpilot.engine.load_plan.LoadPlan`: each step the system sealed nearest its load), beside AR and
stock at every asked size, with paired lower bounds (§5.1, §5.2).

At every size n, batch runs (:func:`specpilot.pilot.batch_runs.measure_batches`: the pilot's bundled benchmark
prompts, each a freshly salted variant, cycled to n and queued at once; per benchmark and round two variant sets,
run in the order A S X then X S A; a system's figure in a cell is the higher of its two runs) of AR, stock
(``SystemConfig.stock`` of the pilot's drafter, depth 6: the pilot's) and the plan. Per size: each system's
tokens/s (geometric mean over benchmarks and rounds), the plan's gain over AR and over stock with its one-sided 95%
lower bound (paired bootstrap, each benchmark a stratum, :func:`~specpilot.pilot.batch_runs.compare`), and whether
its outputs equal AR's on every variant (float32: they must). Sizes between two sealed sizes run the plan's rule,
which nothing measured: this bench is where such a size is measured.

Writes ``<out>/batch_sealed_<target name>_<device type>_<date>.json`` (device, versions, commit, the plan, every
figure).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import time
from pathlib import Path

import torch

from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.engine.load_plan import LoadPlan
from specpilot.errors import SpecPilotError
from specpilot.pilot import controller as ctl
from specpilot.pilot.batch_runs import compare, measure_batches
from specpilot.pilot.setup import build_requests
from specpilot.provenance import git_commit, versions

#: The bar of the batching "done when": every size's lower bound against AR and against stock at least this.
BAR = 0.98


def run_sealed_bench(plan: LoadPlan, tdir: Path, ddir: Path | None, sizes: list[int], device: str, out_dir: Path,
                     rounds: int = 3, per_benchmark: int = 2, max_new_tokens: int = 64, rng=None,
                     compile_cpu: bool = False) -> dict:
    """Measure ``plan`` against AR and stock at every size of ``sizes`` (module doc); write the JSON and return it.

    Args:
        plan: the sealed systems (``serve --system PILOT_DIR`` reads the same). tdir / ddir: target and draft-model
            directories. sizes: batch sizes (slots; all prompts queued at once). device: torch device string.
        rounds: A B B A rounds per (benchmark, size), at least 2. per_benchmark: prompts of each bundled benchmark
            (cycled, each salted afresh, to fill a size). max_new_tokens: per request. rng: salts and order (None: OS
            entropy; seeded in tests). Stock is the pilot's: the draft model's chain where ``ddir`` holds one, else
            the n-gram chain, depth 6. compile_cpu: every engine runs the target's compiled CPU stack (one compile).
    Raises:
        SpecPilotError: fewer than 2 rounds, no size, no prompt that fits the target's context.
    """
    if rounds < 2 or not sizes or min(sizes) < 1:
        raise SpecPilotError(f"the sealed bench needs sizes >= 1 and at least 2 rounds, got {sizes}, {rounds}")
    t0 = time.perf_counter()
    dtype = plan.configs[0].dtype
    dep = Deployment(tdir, ddir, dtype=dtype, device=device)
    context = min(dep.target.args.max_position_embeddings, 4096)
    reqs = [r for r in build_requests(dep, per_benchmark, max_new_tokens)
            if len(r.prompt_ids) + ctl.SALT_TOKENS + r.max_new_tokens <= context]  # room for the salt
    if not reqs:
        raise SpecPilotError("no benchmark prompt fits this target's context: nothing to measure")
    groups: dict = {}
    for r in reqs:
        groups.setdefault(r.benchmark, []).append(r)
    stock = SystemConfig.stock("draft_model" if dep.draft_model is not None else "ngram", depth=6, dtype=dtype)
    systems = {"ar": SystemConfig.ar(dtype=dtype), "stock": stock, "sealed": plan}
    max_len = max(len(r.prompt_ids) + r.max_new_tokens for r in reqs) + ctl.SALT_TOKENS + 1  # slots sized to need
    makers = {k: (lambda n, c=c: dep.batch_system(c, max_num_seqs=n, max_len=max_len, compile_cpu=compile_cpu))
              for k, c in systems.items()}
    avoid = frozenset(dep.eos_ids()) | frozenset(dep.tokenizer.all_special_ids if dep.tokenizer is not None else ())
    per_size = {}
    for n in sizes:  # one size at a time: engines of one size live at once
        m = measure_batches(makers, groups, [n], rounds, dep.target.args.vocab_size, avoid_ids=avoid, rng=rng)
        vs_ar, vs_stock, stock_ar = compare(m, "ar", "sealed"), compare(m, "stock", "sealed"), compare(m, "ar", "stock")
        per_size[str(n)] = {
            "system": plan.config_for(n).label(), "tokens_per_s": {k: m.tokens_per_s(k, n) for k in systems},
            "vs_ar": _fig(vs_ar), "vs_stock": _fig(vs_stock), "stock_vs_ar": _fig(stock_ar),
            "outputs_equal_ar": {k: m.equal_outputs("ar", k) for k in ("stock", "sealed")},
            "threads_left_running": {k: list(m.outside[k]) for k in systems},
            "nondeterministic": {k: bool(m.nondeterministic[k]) for k in systems}}
        f = per_size[str(n)]
        print(f"batch {n:3d}: sealed ({f['system']}) {f['tokens_per_s']['sealed']:8.1f} tok/s, "
              f"{f['vs_ar']['gain']:.3f}x AR (lower bound {_s(f['vs_ar']['lower_bound'])}), "
              f"{f['vs_stock']['gain']:.3f}x stock ({_s(f['vs_stock']['lower_bound'])}); AR "
              f"{f['tokens_per_s']['ar']:.1f}, stock {f['tokens_per_s']['stock']:.1f} tok/s; outputs equal AR: "
              f"{f['outputs_equal_ar']['sealed']}", flush=True)
    meets = all(_ok(f["vs_ar"]["lower_bound"]) and _ok(f["vs_stock"]["lower_bound"]) for f in per_size.values())
    res = {"device": torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu",
           "versions": versions(), "commit": git_commit(), "date": _dt.datetime.now().isoformat(timespec="seconds"),
           "target": str(tdir), "dtype": dtype, "threads": torch.get_num_threads(), "compiled": compile_cpu,
           "sizes": sizes, "rounds": rounds,
           "benchmarks": {b: len(g) for b, g in groups.items()}, "max_new_tokens": max_new_tokens,
           "plan": {str(n): c.label() for n, c in zip(plan.sizes, plan.configs)}, "stock": stock.label(),
           "method": "measure_batches: A S X / X S A per benchmark and round, fresh salted variants; gain = geometric "
                     "mean over benchmarks of the geometric mean over rounds; one-sided 95% paired bootstrap bound",
           "bar": BAR, "meets_bar_at_every_size": meets, "per_size": per_size,
           "duration_s": time.perf_counter() - t0}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"batch_sealed_{Path(tdir).name}_{torch.device(device).type}_{_dt.date.today().isoformat()}"
    path, i = out / f"{stem}.json", 1
    while path.exists():
        path, i = out / f"{stem}_run{i}.json", i + 1
    path.write_text(json.dumps(res, indent=1))
    res["path"] = str(path)
    return res


def _fig(paired) -> dict:
    d = paired.to_dict()
    return {"gain": d["gain"], "lower_bound": d["lower_bound"], "ci_method": d["ci_method"]}


def _ok(low) -> bool:
    return low is not None and math.isfinite(low) and low >= BAR


def _s(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


__all__ = ["BAR", "run_sealed_bench"]
