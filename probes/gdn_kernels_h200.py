"""GDN tree verification kernels on a GPU: the path kernel and the commit kernel at a Qwen3.5-27B-like GDN shape.

Shape: 48 GDN layers, 48 value heads (16 key heads, repeated as gdn.py feeds its steps), d_k = d_v = 128, float32
state per value head; random inputs made as gdn.py makes them (q, k L2-normalised, q scaled by d_k^-½, g < 0,
β in (0, 1)). Trees: ``chain16`` (16 rows, each the previous one's child) and ``bf32`` (32 nodes, depth 8, a
best-first-like shape: a spine of 8 and side branches, more of them near the root; fixed seed).

Checked first, per tree on all 48 layers: the path kernel against :func:`gdn_tree_reference` on the GPU (max abs
difference), the committed state untouched; per accepted length 1..8: the commit kernel (all layers, one launch)
against :func:`gdn_commit_reference` (max abs difference) and, bit for bit, against the path kernel's own state
(the next pass's outputs from the committed state vs the same rows hung below the accepted row).

Timed with CUDA events (warm-up, median of reps): ``root_paths`` (once a pass); the path kernel for one layer
(the same layer each rep: its 3 MB state stays in L2) and for 48 layers (each its own state and inputs, 151 MB
of states, so they come from HBM), launched in a Python loop and replayed from one CUDA graph; a sweep of d_v tile
and warps (48 layers, graph); the commit for 1..8 accepted tokens (one launch for all layers, eager and graph); the
PyTorch references on the GPU (path: one layer and 48; commit: 48 layers).

Usage: ``python probes/gdn_kernels_h200.py OUT.json`` on a CUDA GPU (``SPECPILOT_COMMIT`` names the commit);
``python probes/gdn_kernels_h200.py OUT.json --tiny`` runs everything on tiny shapes in Triton's interpreter on the
CPU (a smoke test of the script; its times mean nothing); ``--ptxas`` compiles both kernels offline for sm_90a
(registers and spills of every swept config and of the two that spill; no GPU, TRITON_INTERPRET unset).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

TINY = "--tiny" in sys.argv
if TINY and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import; a no-op where CUDA runs compiled

import torch  # noqa: E402

from specpilot.kernels.gdn_tree import (BLOCK_V, NUM_WARPS, gdn_commit, gdn_commit_reference, gdn_tree,  # noqa: E402
                                        gdn_tree_reference, root_paths)
from specpilot.provenance import git_commit, versions  # noqa: E402

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEV = "cuda" if CUDA else "cpu"
LAYERS, H, DK, DV = (2, 4, 16, 16) if TINY else (48, 48, 128, 128)
WARMUP, REPS = (0, 1) if TINY else (5, 50)
SWEEP = [(16, 2)] if TINY else [(bv, nw) for bv in (16, 32, 64, 128) for nw in (1, 2, 4, 8)
                                 if 16 <= bv * DK // (32 * nw) <= 128]  # 16..128 state floats a thread (256 spill)
ACCEPTED = range(1, 9)


def bf_tree(n=32, depth=8, seed=0) -> list[int]:
    """A best-first-like tree: a spine of ``depth`` rows, the other nodes hung below random nodes of depth < ``depth``,
    favouring shallow ones (a best-first tree's side branches sit mostly near the root). Parents before children."""
    gen = torch.Generator().manual_seed(seed)
    parents, depths = list(range(-1, depth - 1)), list(range(1, depth + 1))
    while len(parents) < n:
        ok = [j for j in range(len(parents)) if depths[j] < depth]
        w = torch.tensor([0.6 ** depths[j] for j in ok])
        p = ok[int(torch.multinomial(w, 1, generator=gen))]
        parents.append(p)
        depths.append(depths[p] + 1)
    return parents


TREES = {"chain16": list(range(-1, 15)), "bf32": bf_tree()}


def make_inputs(gen, r):
    """Per-layer step inputs ``[L, r, H, ...]`` float32 on DEV, as gdn.py feeds its steps."""
    q = torch.nn.functional.normalize(torch.randn(LAYERS, r, H, DK, generator=gen), dim=-1) * DK**-0.5
    k = torch.nn.functional.normalize(torch.randn(LAYERS, r, H, DK, generator=gen), dim=-1)
    v = torch.randn(LAYERS, r, H, DV, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(LAYERS, r, H, generator=gen))
    beta = torch.rand(LAYERS, r, H, generator=gen)
    return [t.to(DEV) for t in (q, k, v, g, beta)]


def sync():
    if CUDA:
        torch.cuda.synchronize()


def time_ms(fn, reps=REPS, warmup=WARMUP) -> dict:
    """Median / min ms of ``fn()`` over ``reps`` (CUDA events; wall clock in the interpreter)."""
    for _ in range(warmup):
        fn()
    sync()
    ts = []
    for _ in range(reps):
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
    return {"median_ms": statistics.median(ts), "min_ms": min(ts), "reps": reps}


def time_graph(fn) -> dict:
    """:func:`time_ms` of one CUDA graph replaying ``fn()`` (captured after a warm-up); eager in the interpreter."""
    if not CUDA:
        return {"skipped": "no CUDA (interpreter run)"}
    fn()
    sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay)


def check_tree(name, parents, s0, inp, paths) -> dict:
    """Path kernel vs reference on every layer; the state untouched."""
    before = s0.clone()
    diff = 0.0
    for layer in range(LAYERS):
        x = [t[layer] for t in inp]
        out = gdn_tree(s0[layer], *x, paths=paths)
        ref = gdn_tree_reference(s0[layer], *x, parents)
        diff = max(diff, (out - ref).abs().max().item())
    return {"path_max_abs_diff_vs_reference": diff, "state_untouched": bool(torch.equal(s0, before)),
            "reference_output_max_abs": ref.abs().max().item()}


def check_commit(parents, s0, inp) -> dict:
    """Per accepted length n (the root path of the deepest row, cut at n): commit kernel vs reference replay, and the
    path kernel's outputs from the committed state vs the same rows below the accepted row (bitwise)."""
    q, k, v, g, beta = inp
    leaf = max(range(len(parents)), key=lambda j: (depth_of(parents, j), -j))
    path = path_of(parents, leaf)
    out = {}
    for n in ACCEPTED:
        if n > len(path):
            break
        rows = torch.tensor(path[:n], dtype=torch.int32, device=DEV)
        s = s0.clone()
        gdn_commit(s, k, v, g, beta, rows)
        want = gdn_commit_reference(s0, k, v, g, beta, path[:n])
        # the next pass: 4 rows below the accepted row (old state) vs the same rows as roots (committed state)
        nxt = [-1, 0, 0, 1]
        both = parents + [path[n - 1] if p < 0 else len(parents) + p for p in nxt]
        extra = [torch.cat((t, t[:, :4]), dim=1) for t in inp]  # the next rows' inputs: copies of rows 0..3
        equal = True
        for layer in (0, LAYERS - 1):
            x = [t[layer] for t in extra]
            long = gdn_tree(s0[layer], *x, torch.tensor(both, dtype=torch.int32, device=DEV))
            again = gdn_tree(s[layer], *(t[len(parents):] for t in x), torch.tensor(nxt, dtype=torch.int32,
                                                                                     device=DEV))
            equal &= bool(torch.equal(again, long[len(parents):]))
        out[n] = {"rows": path[:n], "commit_max_abs_diff_vs_reference": (s - want).abs().max().item(),
                  "next_pass_bit_equal_to_path_kernel": equal}
    return out


def depth_of(parents, j):
    d = 0
    while j >= 0:
        d, j = d + 1, parents[j]
    return d


def path_of(parents, j):
    out = []
    while j >= 0:
        out.append(j)
        j = parents[j]
    return out[::-1]


def summary(res: dict) -> dict:
    """Per tree: 48-layer path time (graph) at the default config and at the sweep's fastest, against the 1.5 ms
    target; commit of 8 tokens; the largest differences and whether every bit-equality check held."""
    out = {}
    for name, t in res["trees"].items():
        timed = [c for c in t["sweep"] if "median_ms" in c["all_layers_graph"]]
        best = min(timed, key=lambda c: c["all_layers_graph"]["median_ms"]) if timed else None
        default = t["path_all_layers_graph"].get("median_ms")
        out[name] = {
            "path_all_layers_graph_ms_default": default,
            "path_all_layers_graph_ms_best": best and best["all_layers_graph"]["median_ms"],
            "best_config": best and {"block_v": best["block_v"], "num_warps": best["num_warps"]},
            "target_ms": 1.5, "meets_target_default": None if default is None else default <= 1.5,
            "commit_8_ms": t["commit"].get(8, {}).get("kernel_all_layers", {}).get("median_ms"),
            "path_max_abs_diff": max([t["check"]["path_max_abs_diff_vs_reference"]]
                                     + [c["max_abs_diff_layer0"] for c in t["sweep"]]),
            "commit_max_abs_diff": max(c["commit_max_abs_diff_vs_reference"] for c in t["commit_check"].values()),
            "all_bit_equal": all(c["next_pass_bit_equal_to_path_kernel"] for c in t["commit_check"].values()),
            "state_untouched": t["check"]["state_untouched"]}
    return out


def main(path_out: str) -> None:
    gen = torch.Generator().manual_seed(0)
    s0 = torch.randn(LAYERS, H, DK, DV, generator=gen).to(DEV)
    res = {"device": torch.cuda.get_device_name() if CUDA else "cpu (Triton interpreter)", "versions": versions(),
           "commit": git_commit(), "tiny": TINY,
           "shape": {"gdn_layers": LAYERS, "value_heads": H, "d_k": DK, "d_v": DV, "state": "float32"},
           "defaults": {"block_v": BLOCK_V, "num_warps": NUM_WARPS}, "warmup": WARMUP, "reps": REPS, "trees": {}}
    bv0 = min(BLOCK_V, DV)
    for name, parents in TREES.items():
        r = len(parents)
        inp = make_inputs(gen, r)
        par = torch.tensor(parents, dtype=torch.int32, device=DEV)
        paths = root_paths(par)
        entry = {"parents": parents, "rows": r, "depth": max(depth_of(parents, j) for j in range(r)),
                 "steps_summed_over_rows": sum(depth_of(parents, j) for j in range(r))}
        entry["check"] = check_tree(name, parents, s0, inp, paths)
        print(name, entry["check"], flush=True)

        def one_layer(bv=bv0, nw=NUM_WARPS):
            gdn_tree(s0[0], *(t[0] for t in inp), paths=paths, block_v=bv, num_warps=nw)

        def all_layers(bv=bv0, nw=NUM_WARPS):
            for layer in range(LAYERS):
                gdn_tree(s0[layer], *(t[layer] for t in inp), paths=paths, block_v=bv, num_warps=nw)

        entry["root_paths"] = time_ms(lambda: root_paths(par))
        entry["path_one_layer"] = time_ms(one_layer)
        entry["path_all_layers_loop"] = time_ms(all_layers)
        entry["path_all_layers_graph"] = time_graph(all_layers)
        sweep = []
        for bv, nw in SWEEP:
            out = gdn_tree(s0[0], *(t[0] for t in inp), paths=paths, block_v=bv, num_warps=nw)
            diff = (out - gdn_tree_reference(s0[0], *(t[0] for t in inp), parents)).abs().max().item()
            sweep.append({"block_v": bv, "num_warps": nw, "max_abs_diff_layer0": diff,
                          "all_layers_graph": time_graph(lambda bv=bv, nw=nw: all_layers(bv, nw))})
            print(name, sweep[-1], flush=True)
        entry["sweep"] = sweep
        entry["reference_one_layer"] = time_ms(lambda: gdn_tree_reference(s0[0], *(t[0] for t in inp), parents),
                                               reps=max(2, REPS // 5))
        entry["reference_all_layers"] = time_ms(
            lambda: [gdn_tree_reference(s0[layer], *(t[layer] for t in inp), parents) for layer in range(LAYERS)],
            reps=max(2, REPS // 10), warmup=1)
        entry["commit_check"] = check_commit(parents, s0, inp)
        print(name, entry["commit_check"], flush=True)
        commit_t = {}
        _, k, v, g, beta = inp
        for n, c in entry["commit_check"].items():
            rows = torch.tensor(c["rows"], dtype=torch.int32, device=DEV)
            padded = torch.tensor(c["rows"] + [-1] * (max(ACCEPTED) - n), dtype=torch.int32, device=DEV)
            s = s0.clone()
            commit_t[n] = {"kernel_all_layers": time_ms(lambda: gdn_commit(s, k, v, g, beta, rows)),
                           "kernel_all_layers_graph": time_graph(lambda: gdn_commit(s, k, v, g, beta, rows)),
                           "kernel_all_layers_padded_to_8": time_ms(lambda: gdn_commit(s, k, v, g, beta, padded)),
                           "reference_all_layers": time_ms(lambda: gdn_commit_reference(s0, k, v, g, beta, c["rows"]),
                                                           reps=max(2, REPS // 10), warmup=1)}
        entry["commit"] = commit_t
        res["trees"][name] = entry
        print(name, {key: entry[key] for key in ("path_one_layer", "path_all_layers_loop", "path_all_layers_graph")},
              flush=True)
    res["summary"] = summary(res)
    print("summary", json.dumps(res["summary"]), flush=True)
    with open(path_out, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", path_out)


def ptxas(path_out: str) -> None:
    """Registers and spills of both kernels compiled offline for sm_90a at the full shape, every swept config."""
    from specpilot.kernels import gdn_tree as G
    from specpilot.kernels.resources import kernel_resources

    f = "*fp32"
    path_sig = dict(s0_ptr=f, q_ptr=f, k_ptr=f, v_ptr=f, a_ptr=f, b_ptr=f, paths_ptr="*i32", o_ptr=f, H="i32")
    commit_sig = dict(s_ptr=f, k_ptr=f, v_ptr=f, a_ptr=f, b_ptr=f, rows_ptr="*i32", R="i32", H="i32")
    rows = []
    for bv, nw in [(bv, nw) for bv in (16, 32, 64, 128) for nw in (1, 2, 4, 8) if 16 <= bv * DK // (32 * nw) <= 256]:
        res = {"block_v": bv, "num_warps": nw}
        for name, kern, sig, const, aligned in (
                ("path", G._gdn_path_kernel, path_sig, dict(DK=DK, DV=DV, BV=bv, W=32), ("s0_ptr", "q_ptr", "k_ptr",
                                                                                         "v_ptr", "o_ptr")),
                ("commit", G._gdn_commit_kernel, commit_sig, dict(N=8, DK=DK, DV=DV, BV=bv),
                 ("s_ptr", "k_ptr", "v_ptr"))):
            k = kernel_resources(kern, sig, const, nw, 3, divisible_by_16=aligned)
            res[name] = {"registers": k.registers, "spill_bytes": k.spill_bytes, "shared_bytes": k.shared_bytes}
        rows.append(res)
        print(res, flush=True)
    out = {"what": "offline sm_90a compile (Triton, then ptxas -v) of the GDN tree kernels (path: W = 32 rows; commit: "
                   "N = 8 rows); no GPU, no timing", "command": "python probes/gdn_kernels_h200.py OUT.json --ptxas",
           "device": "none (offline compile for sm_90a)", "versions": versions(), "commit": git_commit(),
           "shape": {"d_k": DK, "d_v": DV}, "configs": rows}
    with open(path_out, "w") as fh:
        json.dump(out, fh, indent=1)
    print("wrote", path_out)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) != 1:
        sys.exit("usage: python probes/gdn_kernels_h200.py OUT.json [--tiny | --ptxas]")
    if "--ptxas" in sys.argv:
        ptxas(args[0])
    elif not TINY and not CUDA:
        sys.exit("needs a CUDA GPU (or --tiny for the interpreter smoke run, --ptxas for offline compiles)")
    else:
        main(args[0])
