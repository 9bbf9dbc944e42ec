"""GDN tree verification on a GPU: the path kernel (gdn_tree) against the WY-form kernel (gdn_tree_wy), 48 GDN layers
of a Qwen3.5-27B-like shape (48 value heads, d_k = d_v = 128, float32 states; §4.2).

Inputs as gdn.py feeds its steps (q, k L2-normalised, q scaled by d_k^-½, g < 0, β in (0, 1)), committed states
``randn`` (entries ~1, harsher on the S0 products than a real state's). Trees: best-first-like ``bf16`` (depth 6),
``bf32`` (depth 8, the path kernel's headline tree), ``bf64`` (depth 10) and ``chain16``.

Per tree, on all 48 layers: errors (max abs, max abs / max |reference|, share of outputs within one bf16 ulp of the
reference) of the path kernel (default tile / warps) and of every WY variant against :func:`gdn_tree_reference`
(float32, on the GPU); times with CUDA events (warm-up, median of ``REPS``) of 48 per-layer launches, as a model's
pass makes them (a layer's inputs come from the layer below), from one CUDA graph and eager: the path kernel and the
WY kernel at their defaults (their per-pass inputs, root paths / the tree mask, computed once beforehand as a pass
would, and timed alone); the WY kernel also in one launch for all layers (eager, graph). Then, while ``BUDGET_S``
seconds last (later entries say they were skipped), WY variants per layer from a graph: precisions, d_v splits,
(d_v tile, d_k chunk, warps) at tf32x3; bf32 first, bf64 last.

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
from specpilot.kernels.gdn_wy import CONFIGS, PRECISION, gdn_tree_wy, tree_mask  # noqa: E402
from specpilot.provenance import git_commit, versions  # noqa: E402

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEV = "cuda" if CUDA else "cpu"
LAYERS, H, DK, DV = (2, 2, 32, 32) if SMOKE else (48, 48, 128, 128)
WARMUP, REPS = (0, 1) if SMOKE else (10, 60)
BUDGET_S = float(os.environ.get("GDN_WY_BUDGET_S", "120"))  # the sweep's time budget, seconds
#: (d_v tile, d_k chunk, warps) swept at tf32x3, by padded rows, around the default (registers, spills: --ptxas)
SWEEP = {16: [(16, 32, 4), (32, 32, 4), (64, 32, 4), (128, 32, 4), (32, 32, 2), (64, 64, 4), (64, 32, 8)],
         32: [(16, 32, 4), (32, 32, 4), (64, 32, 4), (32, 32, 8), (64, 32, 8), (128, 32, 8), (32, 16, 4)],
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


def setup_tree(parents, s0, gen) -> dict:
    """Inputs, parents on the device, root paths and the float32 reference outputs ``[L, R, H, d_v]``."""
    inp = make_inputs(gen, len(parents))
    par = torch.tensor(parents, dtype=torch.int32, device=DEV)
    ref = torch.stack([gdn_tree_reference(s0[i], *(t[i] for t in inp), parents) for i in range(LAYERS)])
    return {"inp": inp, "par": par, "paths": root_paths(par), "mask": tree_mask(par), "ref": ref}


def per_layer(s0, x, **kw):
    """The WY kernel launched per layer, as a model's pass calls it (the tree mask computed once beforehand, as
    root_paths for the path kernel); returns the 48 outputs."""
    return [gdn_tree_wy(s0[i], *(t[i] for t in x["inp"]), mask=x["mask"], **kw) for i in range(LAYERS)]


def essentials(name, parents, s0, x) -> dict:
    """Path kernel and WY kernel at their defaults: errors against the reference and times."""
    r = len(parents)
    n = max(16, 1 << (r - 1).bit_length())
    inp, par, ref = x["inp"], x["par"], x["ref"]
    entry = {"parents": parents, "rows": r, "padded_rows": n, "depth": max(depth_of(parents, j) for j in range(r)),
             "steps_summed_over_rows": sum(depth_of(parents, j) for j in range(r)),
             "reference_output_max_abs": ref.abs().max().item()}

    def path():
        return [gdn_tree(s0[i], *(t[i] for t in inp), paths=x["paths"]) for i in range(LAYERS)]

    entry["path"] = {"block_v": BLOCK_V, "num_warps": NUM_WARPS,
                     "error_vs_reference": errors(torch.stack(path()), ref), "per_layer_graph": time_graph(path),
                     "per_layer_eager": time_ms(path), "root_paths": time_ms(lambda: root_paths(par))}
    print(name, "path", entry["path"], flush=True)

    def batched():
        return gdn_tree_wy(s0, *inp, mask=x["mask"])

    bv, bk, nw = CONFIGS[n]
    entry["wy_default"] = {"block_v": bv, "block_k": bk, "num_warps": nw, "input_precision": PRECISION,
                           "error_vs_reference": errors(torch.stack(per_layer(s0, x)), ref),
                           "per_layer_graph": time_graph(lambda: per_layer(s0, x)),
                           "per_layer_eager": time_ms(lambda: per_layer(s0, x)),
                           "all_layers_one_launch_error": errors(batched(), ref),
                           "all_layers_one_launch_graph": time_graph(batched),
                           "all_layers_one_launch_eager": time_ms(batched),
                           "tree_mask": time_ms(lambda: tree_mask(par))}
    print(name, "wy_default", entry["wy_default"], flush=True)
    return entry


def sweep(name, entry, s0, x, t_start) -> list:
    """WY variants launched per layer (graph): tiles and warps at tf32x3, d_v splits, precisions."""
    n = entry["padded_rows"]
    bv, bk, nw = CONFIGS[n]
    variants = [dict(input_precision=p) for p in PRECISIONS if p != PRECISION]  # the errors first
    variants += [dict(v_split=vs) for vs in (1, 2) if vs < DV // min(bv, DV)]  # the default: one tile a program
    variants += [dict(block_v=a, block_k=b, num_warps=c) for a, b, c in SWEEP[n] if (a, b, c) != (bv, bk, nw)]
    rows = []
    for kw in variants:
        row = dict(kw)
        if time.time() - t_start > BUDGET_S:
            row["skipped"] = f"probe past its {BUDGET_S:.0f} s budget"
        else:
            try:
                row["error_vs_reference"] = errors(torch.stack(per_layer(s0, x, **kw)), x["ref"])
                row["per_layer_graph"] = time_graph(lambda kw=kw: per_layer(s0, x, **kw))
            except Exception as e:  # a config that does not compile is a result, not the end of the probe
                row["failed"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1][:200]}"
        rows.append(row)
        print(name, "wy", row, flush=True)
    return rows


def summary(res) -> dict:
    out = {}
    key = "per_layer_graph" if CUDA else "per_layer_eager"
    for name, t in res["trees"].items():
        path_ms = t["path"][key].get("median_ms")
        wy_ms = t["wy_default"][key].get("median_ms")
        timed = [v for v in t.get("wy_variants", []) if v.get("per_layer_graph", {}).get("median_ms")]
        best = min(timed, key=lambda v: v["per_layer_graph"]["median_ms"]) if timed else None
        out[name] = {"path_per_layer_ms": path_ms, "wy_default_per_layer_ms": wy_ms,
                     "speedup_default": path_ms / wy_ms if wy_ms else None,
                     "wy_default_one_launch_ms": t["wy_default"]["all_layers_one_launch_graph" if CUDA else
                                                                 "all_layers_one_launch_eager"].get("median_ms"),
                     "wy_best_variant": best and {k: v for k, v in best.items() if k not in ("error_vs_reference",
                                                                                            "per_layer_graph")},
                     "wy_best_variant_per_layer_ms": best and best["per_layer_graph"]["median_ms"],
                     "path_error": t["path"]["error_vs_reference"],
                     "wy_default_error": t["wy_default"]["error_vs_reference"],
                     "wy_worst_max_abs_tf32x3_variants": max([t["wy_default"]["error_vs_reference"]["max_abs"]] + [
                         v["error_vs_reference"]["max_abs"] for v in t.get("wy_variants", [])
                         if "error_vs_reference" in v and v.get("input_precision", PRECISION) == PRECISION])}
    return out


def main(path_out: str) -> None:
    t_start = time.time()
    gen = torch.Generator().manual_seed(0)
    s0 = torch.randn(LAYERS, H, DK, DV, generator=gen).to(DEV)
    res = {"device": torch.cuda.get_device_name() if CUDA else "cpu (Triton interpreter)", "versions": versions(),
           "commit": git_commit(), "smoke": SMOKE, "timing": "CUDA events" if CUDA else "wall clock, interpreter",
           "shape": {"gdn_layers": LAYERS, "value_heads": H, "d_k": DK, "d_v": DV, "state": "float32 randn"},
           "warmup": WARMUP, "reps": REPS, "budget_s": BUDGET_S, "trees": {}}
    data = {name: setup_tree(parents, s0, gen) for name, parents in TREES.items()}
    for name, parents in TREES.items():  # the headline figures first, then the sweeps while the budget lasts
        res["trees"][name] = essentials(name, parents, s0, data[name])
    res["essentials_s"] = time.time() - t_start
    for name in ("bf32", "bf16", "chain16", "bf64"):  # the headline tree first; chain16 reuses bf16's compiles
        res["trees"][name]["wy_variants"] = sweep(name, res["trees"][name], s0, data[name], t_start)
    res["summary"] = summary(res)
    res["wall_s"] = time.time() - t_start
    print("summary", json.dumps(res["summary"]), flush=True)
    with open(path_out, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", path_out, f"({res['wall_s']:.0f} s)")


def ptxas(path_out: str) -> None:
    """Registers and spills of the WY kernel compiled offline for sm_90a, d_k = d_v = 128, every swept config with one
    d_v tile a program (the per-layer default) and the defaults with all tiles in one program; 3 pipeline stages,
    Triton's default on CUDA, as the kernel is launched."""
    from specpilot.kernels.resources import kernel_resources

    f = "*fp32"
    sig = dict(s0_ptr=f, q_ptr=f, k_ptr=f, v_ptr=f, g_ptr=f, b_ptr=f, mask_ptr="*i8", o_ptr=f, R="i32", H="i32")
    rows = []
    for n, cfgs in SWEEP.items():
        d = CONFIGS[n]
        cfgs = [(*c, PRECISION, 1) for c in cfgs] + [(*d, p, 1) for p in PRECISIONS if p != PRECISION]
        cfgs += [(*d, PRECISION, 128 // d[0])]  # all d_v tiles in one program (the one-launch form's default)
        for bv, bk, nw, prec, tiles in cfgs:
            k = kernel_resources(gdn_wy._gdn_wy_kernel, sig, dict(N=n, DK=128, DV=128, BV=bv, BK=bk, TILES=tiles,
                                                                  PREC=prec),
                                 nw, 3, divisible_by_16=("s0_ptr", "q_ptr", "k_ptr", "v_ptr", "o_ptr"))
            rows.append({"padded_rows": n, "block_v": bv, "block_k": bk, "num_warps": nw, "input_precision": prec,
                         "tiles_a_program": tiles, "registers": k.registers, "spill_bytes": k.spill_bytes,
                         "shared_bytes": k.shared_bytes, "default": (bv, bk, nw) == d and prec == PRECISION})
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
