"""Sweep the batch-invariant GEMM's K order (SPLIT_K, BLOCK_K) and tiles at decode row counts, timed inside CUDA
graphs (bf16, one GPU, Qwen3-8B projection shapes).

A row's bits depend only on the K order (``invariant_tiles.json``: every tile shape gave the same rows), so each
shape may take its own (SPLIT_K, BLOCK_K) and each row count its own tile. For every shape, K order, tile and row
count: microseconds per call (20 calls captured in one graph, replayed 20 times, median), cuBLAS beside it, and
whether the rows equal those of the same K order under the first tile. Writes ``OUT/invariant_split.json``.
Usage: python3 probes/invariant_split_probe.py OUT_DIR
"""

import json
import sys

import torch
import torch.nn.functional as F

from specpilot.kernels.gemm import _launch
from specpilot.provenance import git_commit, versions

sys.path.insert(0, "probes")
from invariant_gemm_probe import SHAPES  # noqa: E402

TILES = {"m16n64w4s5": (16, 64, 4, 5), "m32n64w4s5": (32, 64, 4, 5), "m64n64w4s3": (64, 64, 4, 3),
         "m16n32w4s6": (16, 32, 4, 6), "m64n128w4s4": (64, 128, 4, 4), "m128n128w8s3": (128, 128, 8, 3)}
ORDERS = [(1, 128), (2, 128), (4, 128), (8, 128), (1, 64), (4, 64)]
ROWS = [8, 32, 128, 256]


def graph_us(fn, calls=20, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        t.append(1e3 * a.elapsed_time(b) / calls)
    return sorted(t)[len(t) // 2]


def main(out):
    torch.manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "versions": versions(), "commit": git_commit(), "shapes": {}}
    for name, (n, k) in SHAPES.items():
        if name == "lm_head":
            continue  # split 1 already matches cuBLAS there (invariant_gemm.json)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(4)]  # 4 weights: not all in L2
        x = torch.randn(max(ROWS), k, device="cuda", dtype=torch.bfloat16)
        r = {"cublas_us": {m: graph_us(lambda: [F.linear(x[:m], w) for w in ws]) / 4 for m in ROWS}, "orders": {}}
        for split, bk in ORDERS:
            if (k // bk) % split:
                continue
            o = r["orders"][f"split{split}_bk{bk}"] = {}
            first = None
            for tname, (bm, bn, warps, stages) in TILES.items():
                cfg = dict(block_m=bm, block_n=bn, block_k=bk, split_k=split, num_warps=warps, num_stages=stages)
                try:
                    y = _launch(x, ws[0], None, cfg)
                    first = y if first is None else first
                    o[tname] = {"rows_equal": torch.equal(y, first),
                                "us": {m: graph_us(lambda: [_launch(x[:m], w, None, cfg) for w in ws]) / 4
                                       for m in ROWS}}
                except Exception as e:  # noqa: BLE001 (resources): recorded
                    o[tname] = {"error": str(e).splitlines()[0][:80]}
            best = {m: min((v["us"][m], t) for t, v in o.items() if "us" in v) for m in ROWS}
            print(name, split, bk, {m: (round(b[0], 1), b[1]) for m, b in best.items()},
                  "cublas", {m: round(v, 1) for m, v in r["cublas_us"].items()},
                  "equal", all(v.get("rows_equal", True) for v in o.values()), flush=True)
        res["shapes"][name] = r
        del ws, x
    with open(f"{out}/invariant_split.json", "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
