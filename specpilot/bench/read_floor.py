"""Measured read floor of one kernel launch: how fast can *any* kernel that reads a projection's weight bytes
once, in one launch inside a CUDA graph of back-to-back launches, finish on this GPU? The byte floors of the
cost model, measured rather than taken from the datasheet's bandwidth.

    specpilot bench --suite read-floor --out DIR     # DIR/read_floor_bench_<device>_<date>.json

The W12 GEMM's goal is 1.25x cuBLAS at 1-32 rows on every Qwen3-8B projection. A W12 kernel must at least read
its 12-bit records (0.75 of the bf16 bytes); this suite times a plain streaming read of exactly that many bytes
(16-byte loads, several in flight a thread, an int32 XOR per program so nothing is optimised away), best over a
few launch shapes, beside cuBLAS and the W12 GEMM in the same run:

1. Check: the read kernel's per-program XORs equal numpy's on fresh random words (it reads every word once).
2. Launch floor: µs per call of a kernel that reads nothing (1024 programs of 2 warps), back to back in one graph.
3. Read floor vs size: µs to read 4 MB .. 256 MB (distinct buffers cycled: ≥ 1 GiB, no L2 reuse), best config
   per size, and the fit ``t = fixed + bytes / bandwidth`` over sizes up to 64 MB.
4. Per Qwen3-8B / Qwen3-32B projection and row count (``rows``, default 1, 8, 16, 32): cuBLAS bf16 and W12
   (defaults) µs, the read floor of the W12 bytes and of the bf16 bytes (same kernel, same run), and the derived
   figures (:func:`budget`): ``w12_of_floor`` = floor / W12 µs (how close the W12 kernel is to a plain read),
   ``cap_vs_cublas`` = cuBLAS µs / read floor of the W12 bytes (the most any single-launch W12 kernel could beat
   this cuBLAS by), ``needed_us`` = cuBLAS µs / 1.25, ``excess_w12_us`` / ``excess_cublas_us`` = each kernel's
   time above a plain read of its own bytes, ``budget_us`` = the excess a W12 kernel may carry and still be
   1.25x, ``budget_of_cublas_excess`` = that budget over cuBLAS's own excess.

Writes the JSON after each section (device, versions, commit, every figure).
"""

from __future__ import annotations

import json
import math
import time

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU install without Triton still imports the module
    triton = None

if triton is not None:

    @triton.jit
    def _xor(a, b):
        return a ^ b

    @triton.jit
    def _read_kernel(X, Out, n_words, BLOCK: tl.constexpr, UNROLL: tl.constexpr, ITERS: tl.constexpr):
        """Program ``p`` XORs the int32 words ``[p·C, (p+1)·C)`` of ``X`` (C = BLOCK·UNROLL·ITERS) into
        ``Out[p]``: ITERS rounds of UNROLL independent BLOCK-word loads (4 words = 16 bytes a thread)."""
        pid = tl.program_id(0).to(tl.int64)
        base = pid * (BLOCK * UNROLL * ITERS)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for i in tl.static_range(ITERS):
            for u in tl.static_range(UNROLL):
                offs = base + (i * UNROLL + u) * BLOCK + tl.arange(0, BLOCK)
                acc ^= tl.load(X + offs, mask=offs < n_words, other=0)
        tl.store(Out + pid, tl.reduce(acc, 0, _xor))

    @triton.jit
    def _empty_kernel(Out):
        """Reads nothing; program 0 writes one word (a launch, ramp and drain only)."""
        if tl.program_id(0) == 0:
            tl.store(Out, 1)

#: (num_warps, UNROLL, ITERS) of the read kernel; BLOCK = 128 · num_warps words (16 bytes a thread a load)
CONFIGS = ((4, 4, 1), (4, 4, 2), (4, 8, 1), (8, 4, 1), (8, 2, 2), (8, 4, 2), (2, 8, 1), (4, 2, 4), (16, 2, 1))
SIZES_MB = (4, 8, 16, 25, 32, 38, 50, 64, 100, 128, 256)


def read_words(x: torch.Tensor, cfg) -> torch.Tensor:
    """Per-program XOR of the int32 words ``x [n]`` read by :func:`_read_kernel` with ``cfg`` =
    (num_warps, UNROLL, ITERS). Returns ``int32 [programs]``."""
    nw, unroll, iters = cfg
    block = 128 * nw
    programs = triton.cdiv(x.numel(), block * unroll * iters)
    out = torch.empty(programs, dtype=torch.int32, device=x.device)
    _read_kernel[(programs,)](x, out, x.numel(), BLOCK=block, UNROLL=unroll, ITERS=iters, num_warps=nw)
    return out


def read_reference(x: torch.Tensor, cfg) -> torch.Tensor:
    """What :func:`read_words` must return: the XOR of each program's chunk of ``x`` (numpy on the host)."""
    import numpy as np

    nw, unroll, iters = cfg
    chunk = 128 * nw * unroll * iters
    words = np.concatenate([x.cpu().numpy(), np.zeros(-x.numel() % chunk, dtype=np.int32)])
    return torch.from_numpy(np.bitwise_xor.reduce(words.reshape(-1, chunk), axis=1)).to(x.device)


def budget(cublas_us: float, w12_us: float, floor_w12_us: float, floor_bf16_us: float, goal: float = 1.25) -> dict:
    """The derived figures of one (projection, rows) cell, all times in µs (see the module docstring, section 4).

    ``excess_w12_us`` / ``excess_cublas_us``: what each kernel takes above a plain read of its own bytes;
    ``budget_us``: the excess a W12 kernel may take and still be ``goal`` x cuBLAS (cuBLAS / goal − the W12
    floor); ``budget_of_cublas_excess``: that budget over cuBLAS's own excess (below 1: the goal asks the W12
    kernel to carry less overhead above its read than cuBLAS carries above its own; None where cuBLAS is at or
    below its floor, so the JSON stays standard)."""
    xs_b = cublas_us - floor_bf16_us
    bud = cublas_us / goal - floor_w12_us
    return {"speedup": cublas_us / w12_us, "w12_of_floor": floor_w12_us / w12_us, "cublas_of_floor": floor_bf16_us / cublas_us,
            "cap_vs_cublas": cublas_us / floor_w12_us, "needed_us": cublas_us / goal, "floor_ratio": floor_bf16_us / floor_w12_us,
            "excess_w12_us": w12_us - floor_w12_us, "excess_cublas_us": xs_b, "budget_us": bud,
            "budget_of_cublas_excess": bud / xs_b if xs_b > 0 else None}


def main(out_path: str, rows=(1, 8, 16, 32), models=("qwen3-8b", "qwen3-32b")) -> dict:
    """Sections 1-4 (module docstring) for the row counts ``rows`` and the projection-name prefixes ``models``;
    writes ``out_path`` after each. Raises RuntimeError without CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("the read-floor suite needs a CUDA GPU")
    import torch.nn.functional as F

    from specpilot.bench.timing import time_calls, time_graph
    from specpilot.bench.w12 import projection_copies
    from specpilot.provenance import git_commit, versions
    from specpilot.w12.gemm import w12_gemm

    t0 = time.time()
    dev = "cuda"
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(),
           "configs": [list(c) for c in CONFIGS]}

    def save():
        res["runtime_s"] = time.time() - t0
        json.dump(res, open(out_path, "w"), indent=1)

    # 1. the read kernel reads every word once
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randint(-2**31, 2**31 - 1, (3 * 2**20 + 77,), generator=g, device=dev, dtype=torch.int32)
    res["check"] = {str(c): bool(torch.equal(read_words(x, c), read_reference(x, c))) for c in CONFIGS}
    res["check_ok"] = all(res["check"].values())
    print("check", res["check_ok"], flush=True)
    save()

    # one pool of random words (≥ 1 GiB + the largest size) from which distinct buffers are cut
    pool = torch.randint(-2**31, 2**31 - 1, ((1 << 28) + (256 << 18),), device=dev, dtype=torch.int32)

    def floor_us(nbytes: int) -> tuple[float, list]:
        words = -(-nbytes // 64) * 16  # a multiple of 16 words: Triton then knows the mask keeps 16-byte loads whole
        fit = pool.numel() // words
        if fit >= 2:  # distinct slices of the pool, ≥ 1 GiB together where it holds that much
            copies = [pool[i * words:(i + 1) * words] for i in range(min(fit, max(4, math.ceil((1 << 30) / nbytes))))]
        else:  # larger than half the pool: two buffers of their own
            copies = [torch.randint(-2**31, 2**31 - 1, (words,), device=dev, dtype=torch.int32) for _ in range(2)]
        per = []
        for c in CONFIGS:
            us = time_calls(lambda _x, buf, c=c: read_words(buf, c), copies, None, reps=max(2, 40 // len(copies)))
            per.append(us)
        return min(per), per

    # 2. launch floor
    sink = torch.zeros(1, dtype=torch.int32, device=dev)
    res["empty_kernel_us"] = {str(p): time_graph([lambda p=p: _empty_kernel[(p,)](sink, num_warps=2)] * 200)
                              for p in (132, 1024, 4096)}
    print("empty kernel us", res["empty_kernel_us"], flush=True)
    save()

    # 3. read floor by size
    res["by_size"] = []
    for mb in SIZES_MB:
        best, per = floor_us(mb * 10**6)
        res["by_size"].append({"mb": mb, "us": best, "tb_per_s": mb * 1e6 / best / 1e6, "per_config_us": per})
        print(f"read {mb} MB: {best:.2f} us ({mb / best:.2f} TB/s) best of {[round(p, 2) for p in per]}", flush=True)
    pts = [(r["mb"] * 1e6, r["us"]) for r in res["by_size"] if r["mb"] <= 64]
    n = len(pts)
    mx, my = sum(p[0] for p in pts) / n, sum(p[1] for p in pts) / n
    slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / sum((p[0] - mx) ** 2 for p in pts)
    res["fit_to_64mb"] = {"fixed_us": my - slope * mx, "tb_per_s": 1 / slope / 1e6}
    print("fit", res["fit_to_64mb"], flush=True)
    save()

    # 4. per projection and row count: cuBLAS, W12, and the read floors of both byte counts (once a projection:
    # the weights are the bytes; x and y are < 0.4 MB at 32 rows)
    res["rows"] = list(rows)
    res["projections"] = []
    for prefix in models:
        for name, n_, k, w, t, esc, ts, ws in projection_copies(prefix):
            fw, _ = floor_us(t.nbytes)
            fb, _ = floor_us(n_ * k * 2)
            for m in rows:
                xr = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                cub = time_calls(lambda a, w_: F.linear(a, w_), ws, xr)
                ours = time_calls(lambda a, te: w12_gemm(a, te[0], escapes=te[1]), ts, xr)
                row = {"proj": name, "rows": m, "n": n_, "k": k, "w12_bytes": t.nbytes, "bf16_bytes": n_ * k * 2,
                       "cublas_us": cub, "w12_us": ours, "read_floor_w12_bytes_us": fw, "read_floor_bf16_bytes_us": fb,
                       **budget(cub, ours, fw, fb)}
                res["projections"].append(row)
                print(json.dumps({k_: round(v, 3) if isinstance(v, float) else v for k_, v in row.items()}), flush=True)
                save()
            del w, t, esc, ts, ws
            torch.cuda.empty_cache()
    print(f"{'proj':18s} {'rows':>4s} {'cuBLAS':>7s} {'W12':>7s} {'floor12':>7s} {'floor16':>7s} {'need':>6s} "
          f"{'xs12':>5s} {'xsBL':>5s} {'budget':>6s} {'cap':>5s}")
    for r in res["projections"]:
        print(f"{r['proj']:18s} {r['rows']:4d} {r['cublas_us']:7.2f} {r['w12_us']:7.2f} "
              f"{r['read_floor_w12_bytes_us']:7.2f} {r['read_floor_bf16_bytes_us']:7.2f} {r['needed_us']:6.2f} "
              f"{r['excess_w12_us']:5.2f} {r['excess_cublas_us']:5.2f} {r['budget_us']:6.2f} {r['cap_vs_cublas']:5.2f}")
    save()
    return res

