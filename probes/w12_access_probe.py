"""Is it the W12 GEMV's access pattern or its arithmetic that keeps it above the read floor? (issue 5)

    python probes/w12_access_probe.py OUT.json

Three kernels over the same W12 records of each Qwen3-8B projection, side by side at 1 row (µs per call, one
CUDA graph, ≥ 512 MiB of record copies, best of 5 replays):

- ``plain``: ``probes/read_floor.py``'s streaming read of as many bytes (the measured read floor);
- ``pattern``: the GEMV's own loads (:func:`~specpilot.w12.tiles._word_offsets` /
  :func:`~specpilot.w12.tiles._load_groups`, its grid, block and split from
  :func:`~specpilot.w12.gemv.gemv_config` or a variant) with the decode and FMAs replaced by an XOR of
  the words (stored per program, so no load is dropped);
- ``gemv``: the W12 GEMV itself with the same launch shape.

``pattern − plain`` is what the record access pattern costs, ``gemv − pattern`` what the decode, the FMAs and
the epilogue cost. First the pattern kernel's XOR is checked against torch on the same words.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import triton
import triton.language as tl

from specpilot.w12.gemm import escape_table, w12_gemm
from specpilot.w12.gemv import gemv_config
from specpilot.w12.tiles import _load_groups, _word_offsets
from specpilot.provenance import git_commit, versions
from specpilot.w12.format import RECORD_COLS, encode

from read_floor import read_words  # noqa: E402  (probes/read_floor.py)
from timing import time_calls  # noqa: E402
from w12_bench import SHAPES, copies_of  # noqa: E402

dev = "cuda"


@triton.jit
def _pattern_kernel(RecV, RecQ, Out, K_PAD, K_PER_SPLIT, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The GEMV's record loads for tile ``program_id(0)``, split ``program_id(1)``; XOR of every word to Out."""
    row_v, row_q, rg, col_v, col_q = _word_offsets(tl.program_id(0) * BLOCK_N, BLOCK_N, K_PAD, BLOCK_K)
    k0 = tl.program_id(1) * K_PER_SPLIT
    k1 = tl.minimum(k0 + K_PER_SPLIT, K_PAD)
    acc = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.int64)
    for kk in range(0, K_PER_SPLIT, BLOCK_K):
        vw, qw = _load_groups(RecV, RecQ, k0 + kk, k1, row_v, row_q, rg, col_v, col_q, False)
        acc ^= vw ^ qw.to(tl.int64)
    red = tl.reduce(tl.reduce(acc, 1, _xor64), 0, _xor64)
    tl.store(Out + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), red)


@triton.jit
def _xor64(a, b):
    return a ^ b


def pattern(rec: torch.Tensor, n: int, cfg: dict) -> torch.Tensor:
    """XOR of the words each (tile, split) program reads; ``int64 [split, tiles]``."""
    bn, bk, split = cfg["block_n"], cfg["block_k"], cfg["split_k"]
    k_pad = rec.shape[1] * RECORD_COLS
    kps = triton.cdiv(triton.cdiv(k_pad, split), bk) * bk
    out = torch.empty(split, triton.cdiv(n, bn), dtype=torch.int64, device=rec.device)
    _pattern_kernel[(triton.cdiv(n, bn), split)](rec.view(torch.int64), rec.view(torch.int32), out, k_pad, kps,
                                                  BLOCK_N=bn, BLOCK_K=bk, num_warps=cfg["num_warps"])
    return out


def pattern_reference(rec: torch.Tensor, n: int, cfg: dict) -> torch.Tensor:
    """The same XORs from the record bytes (``rec [bands, records, 12288]`` uint8) with numpy: each (tile, split)
    program's rows of the views and nibbles of the records in its K range."""
    import numpy as np

    bn, bk, split = cfg["block_n"], cfg["block_k"], cfg["split_k"]
    k_pad = rec.shape[1] * RECORD_COLS
    kps = triton.cdiv(triton.cdiv(k_pad, split), bk) * bk
    r = rec.cpu().numpy()
    out = np.zeros((split, triton.cdiv(n, bn)), dtype=np.int64)
    for s in range(split):
        recs = slice(s * kps // 64, min((s + 1) * kps, k_pad) // 64)
        for t in range(triton.cdiv(n, bn)):
            band, row0 = (t * bn) // 128, (t * bn) % 128
            vw = np.ascontiguousarray(r[band, recs, row0 * 64:(row0 + bn) * 64]).view(np.int64)
            qw = np.ascontiguousarray(r[band, recs, 8192 + row0 * 32:8192 + (row0 + bn) * 32]).view(np.int32)
            out[s, t] = np.bitwise_xor.reduce(vw.ravel()) ^ np.bitwise_xor.reduce(qw.ravel().astype(np.int64))
    return torch.from_numpy(out).to(rec.device)


def main(out_path: str) -> dict:
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(), "rows": []}
    # check on a small weight
    w = (torch.randn(300, 1000, device=dev) * 0.02).to(torch.bfloat16)
    t = encode(w, device=dev)
    cfg = dict(gemv_config(300, 1000), split_k=2)
    res["check_ok"] = bool(torch.equal(pattern(t.records, 300, cfg), pattern_reference(t.records, 300, cfg)))
    print("pattern check", res["check_ok"], flush=True)
    for name in [s for s in SHAPES if s.startswith("qwen3-8b")]:
        n, k = SHAPES[name]
        w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        t = encode(w, device=dev)
        ts = copies_of(t, escape_table(t))
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        base = gemv_config(n, k)
        flat = [te[0].records.view(torch.int32).reshape(-1) for te in ts]  # 12288-byte records: whole words
        plain = min(time_calls(lambda _x, b, c=c: read_words(b, c), flat, None, reps=4)
                    for c in ((4, 4, 1), (8, 4, 1), (4, 8, 1)))
        variants = [{}, {"split_k": 1}, {"block_n": 32}, {"block_n": 64}, {"block_n": 128},
                    {"block_k": 1024}, {"block_n": 8}]
        for v in variants:
            cfg = dict(base) | v
            cfg["num_warps"] = max(1, cfg["block_n"] * cfg["block_k"] // (8 * 32 * 16))
            row = {"proj": name, "variant": v, "config": cfg, "plain_us": plain,
                   "record_bytes": t.records.numel()}
            row["pattern_us"] = time_calls(lambda _x, te, c=cfg: pattern(te[0].records, n, c), ts, None, reps=4)
            over = {key: cfg[key] for key in ("block_n", "block_k", "split_k", "num_warps")}
            try:
                row["gemv_us"] = time_calls(lambda a, te, o=over: w12_gemm(a, te[0], escapes=te[1], gemv=True, **o),
                                            ts, x, reps=4)
            except Exception as exc:
                row["gemv_error"] = str(exc).splitlines()[0][:160]
            res["rows"].append(row)
            print(f"{name:18s} {json.dumps(v):22s} bn {cfg['block_n']:3d} bk {cfg['block_k']:4d} split "
                  f"{cfg['split_k']} warps {cfg['num_warps']:2d}: plain {plain:6.2f} pattern {row['pattern_us']:6.2f} "
                  f"gemv {row.get('gemv_us', float('nan')):6.2f}", flush=True)
            res["runtime_s"] = time.time() - t0
            json.dump(res, open(out_path, "w"), indent=1)
        del w, t, ts, flat
        torch.cuda.empty_cache()
    return res


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python probes/w12_access_probe.py OUT.json")
    main(sys.argv[1])
