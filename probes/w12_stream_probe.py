"""A one-row W12 GEMV with the record words streamed by TMA into a multi-stage shared-memory ring, against the
default one-row kernel and cuBLAS bf16 on the Qwen3-8B projections, side by side in one run (issue 5, session 13).

    python probes/w12_stream_probe.py OUT.json [BUDGET_S]

The kernel (here, not in the package: it lost everywhere, ``results/w12_stream_probe_h200_2026-12-01_session13
.json``) reads the lines kernel's tiles (:func:`~specpilot.w12.gemv._w12_gemv_lines_kernel`: ``[R,
BLOCK_N · 8]`` words of R = BLOCK_K / 64 records) through two 3-D tensor descriptors over the records, ``[bands,
records, 1536]`` int64 (views) and ``[bands, records, 3072]`` int32 (nibbles from word 2048), in a ``tl.range`` loop
with ``num_stages = stages``: Triton's pipeliner issues the TMA copies of the next ``stages − 1`` steps while a step
is decoded (offline sm_90a: UTMALDG.3D + mbarrier waits, ~6.7 KB of shared memory a stage). Records past a band's
end read as zero words (TMA bounds) whose x is masked to 0. ``persistent`` > 0: that many programs walk the ``(tile,
split)`` units in one flattened loop (each unit's scaled partial to ``Part``, escapes and bias in the split-sum
kernel; the loop must hold no nested loop to be pipelined). Decode, x and the order of the K sum are the lines
kernel's; the final reductions run in another register layout, so bits can differ within the rounding bound.

Per projection: cuBLAS, the default ``w12_gemm``, then the stream kernel over stages, split K and programs. Every
output is checked against the reference (rounding bound) and compared bit for bit with the lines kernel at the same
split before it is timed; timing as in ``probes/w12_bench.py`` (one CUDA graph, ≥ 512 MiB of weight copies, best of 5
replays). The session-13 figures came from this kernel as a package module (``specpilot/kernels/w12_stream.py``,
committed in 7281a1f once its x loads had moved into the lines kernel's helpers; the timed copy loaded x itself).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F

from specpilot.kernels.gemm import _num_sms
from specpilot.w12.gemm import W12GemmError, _outputs, _sum_splits, split_locks, triton, w12_gemm
from specpilot.w12.gemv import gemv_config
from specpilot.provenance import git_commit, versions
from specpilot.w12.format import RECORD_COLS, W12Tensor

from timing import time_calls  # noqa: E402  (probes/timing.py)
from w12_bench import bits_equal, budget_cli, checked_time, codes, projection_copies, write_result  # noqa: E402

if triton is not None:
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from specpilot.w12.gemm import _add_escapes, _escapes_load, _w12_split_sum_kernel
    from specpilot.w12.gemv import _lines_end, _lines_sum

dev = "cuda"


def record_descriptors(w12: W12Tensor, block_n: int, block_k: int):
    """Tensor descriptors of ``w12.records`` for a ``[BLOCK_K / 64 records, block_n rows]`` tile: views
    ``[bands, records, 1536]`` int64 with blocks ``[1, R, 8 · block_n]`` and nibbles ``[bands, records, 3072]`` int32
    with blocks ``[1, R, 8 · block_n]`` (a row's 8 view words, then at word 2048 its 8 nibble words)."""
    rec = w12.records
    bands, kt = rec.shape[0], rec.shape[1]
    r = block_k // RECORD_COLS
    v = rec.view(torch.int64).view(bands, kt, 1536)
    q = rec.view(torch.int32).view(bands, kt, 3072)
    return (TensorDescriptor(v, [bands, kt, 1536], [kt * 1536, 1536, 1], [1, r, 8 * block_n]),
            TensorDescriptor(q, [bands, kt, 3072], [kt * 3072, 3072, 1], [1, r, 8 * block_n]))


def w12_gemv_stream(x: torch.Tensor, w12: W12Tensor, bias: torch.Tensor | None, escapes, *, block_n: int = 16,
                    block_k: int = 256, split_k: int = 1, stages: int = 3, num_warps: int = 1, persistent: int = 0,
                    fused_split: bool = True) -> torch.Tensor:
    """``x [1, K] @ W12ᵀ (+ bias)`` through :func:`_w12_gemv_stream_kernel`; ``persistent`` > 0: that many programs
    (else one per (tile, split) unit). Returns ``[1, N]`` in x's dtype. Raises: W12GemmError for more than one row,
    a CPU tensor or bad launch parameters."""
    if x.shape[0] != 1:
        raise W12GemmError(f"the TMA GEMV takes one row, got {x.shape[0]}")
    n, k = w12.shape
    rec = w12.records
    k_pad = rec.shape[1] * RECORD_COLS
    if 128 % block_n or block_k % RECORD_COLS or split_k < 1 or stages < 1:
        raise W12GemmError("stream: block_n must divide 128, block_k be a multiple of 64, split_k, stages >= 1")
    k_per_split = triton.cdiv(triton.cdiv(k_pad, split_k), block_k) * block_k
    tiles = triton.cdiv(n, block_n)
    out, part, b = _outputs(x, n, split_k, bias)
    row_ptr, esc_k, esc_d = escapes
    if persistent:  # partials only (the loop must hold no nested loop to be pipelined); the sum kernel adds the rest
        part = torch.empty((split_k, 1, n), dtype=torch.float32, device=x.device)
        fused_split = False
    lock = split_locks(x.device, tiles) if split_k > 1 and fused_split else None
    fused = lock is not None
    lock = row_ptr if lock is None else lock
    dv, dq = record_descriptors(w12, block_n, block_k)
    units = tiles * split_k
    grid = (min(persistent, units),) if persistent else (tiles, split_k)  # the fused split sum locks by program_id(0)
    _w12_gemv_stream_kernel[grid](
        x, dv, dq, w12.base, b, out, part, lock, row_ptr, esc_k, esc_d, 1, n, k, k_pad, k_per_split, x.stride(0),
        units, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, FUSED=fused, X_EVEN=k_per_split * split_k == k,
        HAS_BIAS=bias is not None, STAGES=stages, PERSISTENT=bool(persistent), ASM=x.is_cuda, num_warps=num_warps)
    if persistent:
        _w12_split_sum_kernel[(triton.cdiv(n, 64), 1)](part, b, out, 1, n, SPLIT_K=split_k, BLOCK_M=16, BLOCK_N=64,
                                                       HAS_BIAS=bias is not None, num_warps=4)
        return out
    return _sum_splits(part, out, b, split_k, bias is not None, fused)


if triton is not None:

    @triton.jit
    def _stream_step(acc, DescV, DescQ, X, n0, kb, K, K_PAD, R: tl.constexpr, BLOCK_N: tl.constexpr,
                     X_EVEN: tl.constexpr, ASM: tl.constexpr):
        """One K step of the lines kernel from the descriptors: ``acc [R, BLOCK_N · 8]`` plus the step's products."""
        J: tl.constexpr = BLOCK_N * 8
        band = n0 // 128
        col = (n0 % 128) * 8
        vw = tl.reshape(DescV.load([band, kb // 64, col]), [R, J])
        qw = tl.reshape(DescQ.load([band, kb // 64, 2048 + col]), [R, J])
        cols = kb + tl.arange(0, R)[:, None] * 64 + tl.arange(0, 64)[None, :]
        if X_EVEN:
            xt = tl.load(X + cols).to(tl.float32)
        else:
            xt = tl.load(X + cols, mask=cols < K, other=0.0).to(tl.float32)
        acc = _lines_sum(acc, vw, qw, xt, R, BLOCK_N, ASM)
        return acc

    @triton.jit
    def _w12_gemv_stream_kernel(X, DescV, DescQ, Base, Bias, Out, Part, Lock, RowPtr, EscK, EscD, M, N, K, K_PAD,
                                K_PER_SPLIT, stride_xm, UNITS, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                SPLIT_K: tl.constexpr, FUSED: tl.constexpr, X_EVEN: tl.constexpr,
                                HAS_BIAS: tl.constexpr, STAGES: tl.constexpr, PERSISTENT: tl.constexpr,
                                ASM: tl.constexpr = True):
        """Units ``u = tile · SPLIT_K + split`` of BLOCK_N rows and K_PER_SPLIT columns; one unit a program (grid
        ``(tiles, SPLIT_K)``), or (PERSISTENT, grid ``(P,)``) units ``pid, pid + P, …`` in one loop of their steps,
        each unit's scaled partial to ``Part [SPLIT_K, 1, N]`` (see the module docstring)."""
        R: tl.constexpr = BLOCK_K // 64
        J: tl.constexpr = BLOCK_N * 8
        acc = tl.zeros([R, J], dtype=tl.float32)
        if PERSISTENT:
            P = tl.num_programs(0)
            steps = K_PER_SPLIT // BLOCK_K
            mine = (UNITS - tl.program_id(0) + P - 1) // P
            for it in tl.range(0, mine * steps, num_stages=STAGES):
                u = tl.program_id(0) + (it // steps) * P
                s = it % steps
                n0 = (u // SPLIT_K) * BLOCK_N
                pid_k = u % SPLIT_K
                if s == 0:
                    acc = tl.zeros([R, J], dtype=tl.float32)
                acc = _stream_step(acc, DescV, DescQ, X, n0, pid_k * K_PER_SPLIT + s * BLOCK_K, K, K_PAD, R, BLOCK_N,
                                   X_EVEN, ASM)
                if s == steps - 1:  # the unit's scaled partial sum (split 0's with the escapes); bias in the sum kernel
                    offs_n = n0 + tl.arange(0, BLOCK_N)
                    n_ok = offs_n < N
                    base = tl.load(Base + offs_n, mask=n_ok, other=112).to(tl.int32)
                    scale = ((base + 15) << 23).to(tl.float32, bitcast=True)
                    y = (tl.sum(tl.sum(tl.reshape(acc, [R, BLOCK_N, 8]), axis=2), axis=0) * scale)[None, :]
                    if pid_k == 0:
                        sk, sd, lo, cnt = _escapes_load(RowPtr, EscK, EscD, offs_n, n_ok)
                        y = _add_escapes(y, X, stride_xm, EscK, EscD, sk, sd, lo, cnt, tl.arange(0, 1),
                                         tl.arange(0, 1) < M, False)
                    tl.store(Part + pid_k * N + offs_n[None, :], y, mask=n_ok[None, :])
        else:
            n0 = tl.program_id(0) * BLOCK_N
            pid_k = tl.program_id(1)
            k0 = pid_k * K_PER_SPLIT
            offs_n = n0 + tl.arange(0, BLOCK_N)
            esc = _escapes_load(RowPtr, EscK, EscD, offs_n, (offs_n < N) & (pid_k == 0))
            for kk in tl.range(0, K_PER_SPLIT, BLOCK_K, num_stages=STAGES):
                acc = _stream_step(acc, DescV, DescQ, X, n0, k0 + kk, K, K_PAD, R, BLOCK_N, X_EVEN, ASM)
            _lines_end(acc, X, Base, Bias, Out, Part, Lock, EscK, EscD, esc, M, N, stride_xm, n0, pid_k, R,
                       BLOCK_N, SPLIT_K, FUSED, HAS_BIAS)


def configs(n: int, k: int, sms: int) -> list[dict]:
    d = gemv_config(n, k, sms)["split_k"]
    blocks = k // 256
    splits = sorted({s for s in (max(1, d // 2), d, 2 * d) if blocks % s == 0})
    out = [dict(stages=st, split_k=s) for st in (2, 3, 4) for s in splits]
    out += [dict(stages=st, split_k=s, block_k=512) for st in (2, 3) for s in sorted({max(1, d // 4), max(1, d // 2)})]
    out += [dict(stages=st, split_k=s, persistent=p * sms) for st in (3, 5) for p in (8, 12, 16) for s in (1, 2, 4)
            if blocks % s == 0]
    return out


def main(out_path: str, budget_s: float) -> dict:
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    sms = _num_sms(0)
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(), "sms": sms,
           "rows": []}
    for name, n, k, w, t, esc, ts, ws in projection_copies("qwen3-8b", seed=2):
        g = torch.Generator(device=dev).manual_seed(n + k)
        aw = w.float().abs() + codes(t).abs()
        x = torch.randn(1, k, generator=g, device=dev).to(torch.bfloat16)
        cub = time_calls(lambda a, w_: F.linear(a, w_), ws, x)
        default = time_calls(lambda a, tw: w12_gemm(a, tw[0], escapes=tw[1]), ts, x)
        res["rows"].append({"proj": name, "n": n, "k": k, "kernel": "cublas", "us": cub})
        res["rows"].append({"proj": name, "n": n, "k": k, "kernel": "default", "us": default, "cublas_us": cub,
                            "speedup": cub / default, "config": gemv_config(n, k, sms)})
        print(f"{name}: cublas {cub:.2f} default {default:.2f} µs ({cub / default:.3f}x)", flush=True)
        for v in configs(n, k, sms):
            if time.time() - t0 > budget_s:
                res["stopped"] = f"budget {budget_s} s"
                break
            row = {"proj": name, "n": n, "k": k, "kernel": "stream", "config": v, "cublas_us": cub}
            row |= checked_time(lambda a, t_, e_: w12_gemv_stream(a, t_, None, e_, **v), x, t, esc, aw, ts, cub)
            if "us" in row:
                row["vs_default"] = default / row["us"]
                lines = w12_gemm(x, t, escapes=esc, lines=True, split_k=v["split_k"], block_k=v.get("block_k", 256))
                row["bits_equal_lines"] = bits_equal(w12_gemv_stream(x, t, None, esc, **v), lines)
            res["rows"].append(row)
            print(f"  {v}: {row.get('us', float('nan')):.2f} µs {row.get('speedup', 0):.3f}x "
                  f"bits={row.get('bits_equal_lines')} {row.get('error', '')}", flush=True)
        del ts, ws
        torch.cuda.empty_cache()
    best = {}
    for r in res["rows"]:
        if r["kernel"] == "stream" and "us" in r and r["us"] < best.get(r["proj"], {"us": 1e9})["us"]:
            best[r["proj"]] = r
    res["best"] = {p: {"config": r["config"], "us": r["us"], "speedup": r["speedup"]} for p, r in best.items()}
    write_result(res, t0, out_path)
    print(json.dumps(res["best"], indent=1))
    return res


if __name__ == "__main__":
    main(*budget_cli(sys.argv, "w12_stream_probe.py", 400.0))
