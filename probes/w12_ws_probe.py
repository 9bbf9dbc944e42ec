"""``python probes/w12_ws_probe.py OUT.json [PREFIX ...]``: the warp-specialised stream-K W12 GEMM
(``probes/w12_ws.py``, Gluon) against cuBLAS bf16 and the default W12 GEMM, side by side in one run.

Per projection (default: the Qwen3-8B ones) and 8 / 16 / 32 rows: cuBLAS, the default ``w12_gemm``, and
``w12_ws`` with one or two consumer partitions and several ring depths, each checked against the reference (bound of
:mod:`specpilot.w12.gemm`) and for run-to-run bitwise equality before it is timed (``time_calls``:
one CUDA graph over ≥ 512 MiB of weight copies, best of 5 replays).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from specpilot.w12.gemm import w12_gemm
from w12_ws import w12_ws, ws_prepare
from specpilot.provenance import git_commit, versions

from timing import time_calls  # noqa: E402  (probes/timing.py)
from w12_bench import bits_equal, checked_time, codes, prefix_cli, projection_copies, write_result  # noqa: E402

VARIANTS = {"p132": dict(), "p132_s4": dict(stages=4), "p264_s4": dict(programs=264, stages=4),
            "split_rows_sync": dict(split_rows=True, overlap=False)}
DRY = {"dry_p132": dict(dry=True), "dry_p264_s4": dict(programs=264, stages=4, dry=True)}  # the TMA ring alone


def main(out_path: str, prefixes: tuple = ("qwen3-8b",)) -> dict:
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(),
           "sms": torch.cuda.get_device_properties(0).multi_processor_count, "rows": []}
    for prefix in prefixes:
        for name, n, k, w, t, esc, ts, ws in projection_copies(prefix, seed=0):
            g = torch.Generator(device="cuda").manual_seed(n + 5 * k)
            aw = w.float().abs() + codes(t).abs()
            for tc, _ in ts:  # the kernel's record layout of every copy, before any graph capture
                ws_prepare(tc)
            for m in (8, 16, 32):
                x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
                cub = time_calls(lambda a, w_: F.linear(a, w_), ws, x)
                row = {"proj": name, "rows": m, "cublas_us": cub,
                       "default": checked_time(lambda a, t_, e_: w12_gemm(a, t_, escapes=e_), x, t, esc, aw, ts, cub)}
                for key, kw in VARIANTS.items():
                    call = (lambda a, t_, e_, kw=kw: w12_ws(a, t_, e_, **kw))
                    r = checked_time(call, x, t, esc, aw, ts, cub)
                    if "error" not in r:
                        r["deterministic"] = bits_equal(call(x, t, esc), call(x, t, esc))
                    row[key] = r
                for key, kw in DRY.items():  # wrong output by design: timed, not checked
                    row[key] = {"us": time_calls(lambda a, tw, kw=kw: w12_ws(a, tw[0], tw[1], **kw), ts, x)}
                res["rows"].append(row)
                print(name, m, f"cublas {cub:.2f} default {row['default'].get('us', float('nan')):.2f}",
                      " ".join(f"{key} {row[key].get('us', float('nan')):.2f}"
                               f"{'' if row[key].get('within_bound') and row[key].get('deterministic') else ' BAD ' + str(row[key])[:300]}"
                               for key in VARIANTS),
                      " ".join(f"{key} {row[key]['us']:.2f}" for key in DRY), flush=True)
                write_result(res, t0, out_path)
            del w, t, esc, aw, ts, ws
            torch.cuda.empty_cache()
    return write_result(res, t0, out_path)


if __name__ == "__main__":
    main(*prefix_cli(sys.argv, "w12_ws_probe.py", ("qwen3-8b",)))
