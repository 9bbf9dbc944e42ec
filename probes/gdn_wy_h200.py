"""GDN tree verification on a GPU: the path kernel (gdn_tree) against the WY-form kernel (gdn_tree_wy), 48 GDN layers
of a Qwen3.5-27B-like shape (48 value heads, d_k = d_v = 128, float32 states; §4.2).

Inputs as gdn.py feeds its steps (q, k L2-normalised, q scaled by d_k^-½, g < 0, β in (0, 1)), committed states
``randn`` (entries ~1, harsher on the S0 products than a real state's). Trees: best-first-like ``bf16`` (depth 6),
``bf32`` (depth 8, the path kernel's headline tree), ``bf64`` (depth 10) and ``chain16``.

Per tree, on all 48 layers: errors (max abs, max abs / max |reference|, share of outputs within one bf16 ulp of the
reference) of the path kernel (default tile / warps) and of every WY variant against :func:`gdn_tree_reference`
(float32, on the GPU); times with CUDA events (warm-up, median of ``REPS``): the path kernel (48 launches, the root
paths computed once beforehand as a pass would, and timed alone) from one CUDA graph and eager; the WY kernel at
its default (one launch for all layers) eager and from a graph, 48 per-layer launches from a graph, then a sweep of
(d_v tile, d_k chunk, warps) at tf32x3 and of the tl.dot precisions at the default tiles (each one launch for all
layers, from a graph). The sweep stops when ``BUDGET_S`` seconds have passed (later entries say so).

Usage: ``SPECPILOT_COMMIT=$(git rev-parse --short HEAD) PYTHONPATH=. python probes/gdn_wy_h200.py OUT.json`` on a
CUDA GPU; ``--smoke``: tiny shapes in Triton's interpreter on the CPU (its times mean nothing; bf16x* precisions
skipped, the interpreter has none); ``--ptxas``: registers and spills of the WY kernel compiled offline for sm_90a
at the full shape, every swept config (no GPU; TRITON_INTERPRET unset).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import

import torch  # noqa: E402

from specpilot.kernels import gdn_wy  # noqa: E402
from specpilot.kernels.gdn_tree import BLOCK_V, NUM_WARPS, gdn_tree, gdn_tree_reference, root_paths  # noqa: E402
from specpilot.kernels.gdn_wy import CONFIGS, PRECISION, gdn_tree_wy  # noqa: E402
from specpilot.provenance import git_commit, versions  # noqa: E402

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEV = "cuda" if CUDA else "cpu"
LAYERS, H, DK, DV = (2, 2, 32, 32) if SMOKE else (48, 48, 128, 128)
WARMUP, REPS = (0, 1) if SMOKE else (10, 60)
BUDGET_S = 150.0
#: (d_v tile, d_k chunk, warps) swept at tf32x3, by padded rows, around the default (registers, spills: --ptxas)
SWEEP = {16: [(32, 32, 4), (64, 32, 4), (128, 32, 4), (32, 32, 2), (64, 64, 4), (64, 32, 8)],
         32: [(32, 32, 4), (64, 32, 4), (32, 32, 8), (64, 32, 8), (128, 32, 8), (32, 16, 4)],
         64: [(32, 16, 8), (64, 16, 8), (16, 32, 8), (32, 16, 4), (128, 16, 8)]}
PRECISIONS = ("tf32x3", "ieee", "tf32") if SMOKE else ("tf32x3", "bf16x6", "bf16x3", "tf32", "ieee")


def bf_tree(n, depth, seed=0) -> list[int]:
    """A best-first-like tree: a spine of ``depth`` rows, the other nodes hung below random nodes of depth < ``depth``,
    favouring shallow ones. Parents before children (as probes/gdn_kernels_h200.py builds its bf32)."""
    gen = torch.Generator().manual_seed(seed)
    parents, depths = list(range(-1, depth - 1)), list(range(1, depth + 1))
    while len(parents) < n:
        ok = [j for j in range(len(parents)) if depths[j] < depth]
        w = torch.tensor([0.6 ** depths[j] for j in ok])
        p = ok[int(torch.multinomial(w, 1, generator=gen))]
        parents.append(p)
        depths.append(depths[p] + 1)
    return parents


TREES = {"bf16": bf_tree(16, 6), "bf32": bf_tree(32, 8), "bf64": bf_tree(64, 10), "chain16": list(range(-1, 15))}


def depth_of(parents, j):
    d = 0
    while j >= 0:
        d, j = d + 1, parents[j]
    return d


def make_inputs(gen, r):
    """Per-layer step inputs ``[L, r, H, ...]`` float32 on DEV."""
    q = torch.nn.functional.normalize(torch.randn(LAYERS, r, H, DK, generator=gen), dim=-1) * DK**-0.5
    k = torch.nn.functional.normalize(torch.randn(LAYERS, r, H, DK, generator=gen), dim=-1)
    v = torch.randn(LAYERS, r, H, DV, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(LAYERS, r, H, generator=gen))
    beta = torch.rand(LAYERS, r, H, generator=gen)
    return [t.to(DEV) for t in (q, k, v, g, beta)]


def sync():
    if CUDA:
        torch.cuda.synchronize()


def time_ms(fn) -> dict:
    """Median / min ms of ``fn()`` over REPS after WARMUP (CUDA events; wall clock in the interpreter)."""
    for _ in range(WARMUP):
        fn()
    sync()
    ts = []
    for _ in range(REPS):
        if CUDA:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            ts.append(1e3 * (time.perf_counter() - t0))
    return {"median_ms": statistics.median(ts), "min_ms": min(ts), "reps": REPS}


def time_graph(fn) -> dict:
    """:func:`time_ms` of one CUDA graph replaying ``fn()`` (captured after a warm-up call); skipped without CUDA."""
    if not CUDA:
        return {"skipped": "no CUDA (interpreter run)"}
    fn()
    sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay)


def errors(out, ref) -> dict:
    """Max abs, max abs / max |ref|, and the share of outputs within one bf16 ulp of the reference."""
    diff = (out - ref).abs()
    ulp = torch.ldexp(torch.ones_like(ref), torch.frexp(ref)[1] - 8)  # bf16 ulp of |ref| (8 significant bits)
    return {"max_abs": diff.max().item(), "max_rel_to_absmax": (diff.max() / ref.abs().max()).item(),
            "share_within_1_bf16_ulp": (diff <= ulp).float().mean().item()}


def run_tree(name, parents, s0, gen, t_start) -> dict:
    r = len(parents)
    n = max(16, 1 << (r - 1).bit_length())
    inp = make_inputs(gen, r)
    par = torch.tensor(parents, dtype=torch.int32, device=DEV)
    ref = torch.stack([gdn_tree_reference(s0[i], *(t[i] for t in inp), parents) for i in range(LAYERS)])
    entry = {"parents": parents, "rows": r, "padded_rows": n, "depth": max(depth_of(parents, j) for j in range(r)),
             "steps_summed_over_rows": sum(depth_of(parents, j) for j in range(r)),
             "reference_output_max_abs": ref.abs().max().item()}

    paths = root_paths(par)  # once a pass, shared by the layers (timed on its own)

    def path():
        return [gdn_tree(s0[i], *(t[i] for t in inp), paths=paths) for i in range(LAYERS)]

    entry["path"] = {"block_v": BLOCK_V, "num_warps": NUM_WARPS,
                     "error_vs_reference": errors(torch.stack(path()), ref), "all_layers_graph": time_graph(path),
                     "all_layers_eager": time_ms(path), "root_paths": time_ms(lambda: root_paths(par))}
    print(name, "path", entry["path"], flush=True)

    def wy(**kw):
        return gdn_tree_wy(s0, *inp, par, **kw)

    def wy_per_layer():
        for i in range(LAYERS):
            gdn_tree_wy(s0[i], *(t[i] for t in inp), par)

    bv, bk, nw = CONFIGS[n]
    entry["wy_default"] = {"block_v": bv, "block_k": bk, "num_warps": nw, "input_precision": PRECISION,
                           "error_vs_reference": errors(wy(), ref), "all_layers_one_launch_graph": time_graph(wy),
                           "all_layers_one_launch_eager": time_ms(wy),
                           "per_layer_launches_graph": time_graph(wy_per_layer)}
    print(name, "wy_default", entry["wy_default"], flush=True)
    variants = [dict(block_v=a, block_k=b, num_warps=c, input_precision=PRECISION) for a, b, c in SWEEP[n]]
    variants += [dict(block_v=bv, block_k=bk, num_warps=nw, input_precision=p) for p in PRECISIONS if p != PRECISION]
    entry["wy_variants"] = []
    for kw in variants:
        row = dict(kw)
        if time.time() - t_start > BUDGET_S:
            row["skipped"] = f"probe past its {BUDGET_S:.0f} s budget"
        else:
            try:
                row["error_vs_reference"] = errors(wy(**kw), ref)
                row["all_layers_one_launch_graph"] = time_graph(lambda kw=kw: wy(**kw))
            except Exception as e:  # a config that does not compile is a result, not the end of the probe
                row["failed"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200] if str(e) else ''}"
        entry["wy_variants"].append(row)
        print(name, "wy", row, flush=True)
    return entry


def summary(res) -> dict:
    out = {}
    for name, t in res["trees"].items():
        key = "all_layers_graph" if CUDA else "all_layers_eager"
        path_ms = t["path"][key].get("median_ms")
        wkey = "all_layers_one_launch_graph" if CUDA else "all_layers_one_launch_eager"
        wy_ms = t["wy_default"][wkey].get("median_ms")
        timed = [v for v in t["wy_variants"] if v.get("all_layers_one_launch_graph", {}).get("median_ms")]
        best = min(timed, key=lambda v: v["all_layers_one_launch_graph"]["median_ms"]) if timed else None
        out[name] = {"path_ms": path_ms, "wy_default_ms": wy_ms, "speedup_default": path_ms / wy_ms if wy_ms else None,
                     "wy_best_variant": best and {k: best[k] for k in ("block_v", "block_k", "num_warps",
                                                                       "input_precision")},
                     "wy_best_ms": best and best["all_layers_one_launch_graph"]["median_ms"],
                     "path_error": t["path"]["error_vs_reference"], "wy_default_error": t["wy_default"]
                     ["error_vs_reference"]}
    return out


def main(path_out: str) -> None:
    t_start = time.time()
    gen = torch.Generator().manual_seed(0)
    s0 = torch.randn(LAYERS, H, DK, DV, generator=gen).to(DEV)
    res = {"device": torch.cuda.get_device_name() if CUDA else "cpu (Triton interpreter)", "versions": versions(),
           "commit": git_commit(), "smoke": SMOKE, "timing": "CUDA graph" if CUDA else "wall clock, interpreter",
           "shape": {"gdn_layers": LAYERS, "value_heads": H, "d_k": DK, "d_v": DV, "state": "float32 randn"},
           "warmup": WARMUP, "reps": REPS, "budget_s": BUDGET_S, "trees": {}}
    for name, parents in TREES.items():
        res["trees"][name] = run_tree(name, parents, s0, gen, t_start)
    res["summary"] = summary(res)
    res["wall_s"] = time.time() - t_start
    print("summary", json.dumps(res["summary"]), flush=True)
    with open(path_out, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", path_out, f"({res['wall_s']:.0f} s)")


def ptxas(path_out: str) -> None:
    """Registers and spills of the WY kernel compiled offline for sm_90a, d_k = d_v = 128, every swept config (3
    pipeline stages, Triton's default on CUDA, as the kernel is launched)."""
    from specpilot.kernels.resources import kernel_resources

    f = "*fp32"
    sig = dict(s0_ptr=f, q_ptr=f, k_ptr=f, v_ptr=f, g_ptr=f, b_ptr=f, par_ptr="*i32", o_ptr=f, R="i32", H="i32")
    rows = []
    for n, cfgs in SWEEP.items():
        cfgs = [(*c, PRECISION) for c in cfgs] + [(*CONFIGS[n], p) for p in PRECISIONS if p != PRECISION]
        for bv, bk, nw, prec in cfgs:
            k = kernel_resources(gdn_wy._gdn_wy_kernel, sig, dict(N=n, DK=128, DV=128, BV=bv, BK=bk, PREC=prec), nw,
                                 3, divisible_by_16=("s0_ptr", "q_ptr", "k_ptr", "v_ptr", "o_ptr"))
            rows.append({"padded_rows": n, "block_v": bv, "block_k": bk, "num_warps": nw, "input_precision": prec,
                         "registers": k.registers, "spill_bytes": k.spill_bytes, "shared_bytes": k.shared_bytes,
                         "default": (bv, bk, nw) == CONFIGS[n] and prec == PRECISION})
            print(rows[-1], flush=True)
    out = {"what": "offline sm_90a compile (Triton, then ptxas -v) of the GDN WY kernel, d_k = d_v = 128, "
                   "num_stages 3; no GPU, no timing", "command": "python probes/gdn_wy_h200.py OUT.json --ptxas",
           "device": "none (offline compile for sm_90a)", "versions": versions(), "commit": git_commit(),
           "configs": rows}
    with open(path_out, "w") as fh:
        json.dump(out, fh, indent=1)
    print("wrote", path_out)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) != 1:
        sys.exit("usage: python probes/gdn_wy_h200.py OUT.json [--smoke | --ptxas]")
    if "--ptxas" in sys.argv:
        ptxas(args[0])
    elif not SMOKE and not CUDA:
        sys.exit("needs a CUDA GPU (or --smoke for the interpreter run, --ptxas for offline compiles)")
    else:
        main(args[0])
