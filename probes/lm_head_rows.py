"""CPU time of one ``F.linear`` by row count, for SmolLM2-135M's shapes in float32 (the LM head, ``[49152, 576]``,
and each decoder layer's fused projections): why the batched engine pads a 2- or 3-row LM head to 4 rows on the
CPU (``Transformer.batch_greedy``; docs/peer-vllm-cpu.md). Best of ``--rounds`` rounds, process time, 1 thread;
also whether the padded head's argmax equals the unpadded one on random rows.

    OMP_NUM_THREADS=1 python probes/lm_head_rows.py --out results/.../lm_head_rows.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

SHAPES = {"lm_head": (49152, 576), "qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576),
          "down_proj": (576, 1536)}


def best_ms(w: torch.Tensor, m: int, reps: int, rounds: int) -> float:
    """Best over ``rounds`` of the mean CPU ms of ``F.linear`` on ``m`` random rows."""
    x = torch.randn(m, w.shape[1])
    F.linear(x, w)
    best = float("inf")
    for _ in range(rounds):
        c = time.process_time()
        for _ in range(reps):
            F.linear(x, w)
        best = min(best, 1e3 * (time.process_time() - c) / reps)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = [int(m) for m in args.rows.split(",")]
    out = {"torch": torch.__version__, "threads": 1, "unit": "cpu ms per call", "loadavg": os.getloadavg(), "ms": {}}
    for name, shape in SHAPES.items():
        w = torch.randn(shape) * 0.05
        reps = 3 if name == "lm_head" else 60
        out["ms"][name] = {m: round(best_ms(w, m, reps, args.rounds), 3) for m in rows}
        print(name, out["ms"][name], flush=True)
    w = torch.randn(SHAPES["lm_head"]) * 0.05
    same = []
    for m in (2, 3):
        x = torch.randn(m, w.shape[1])
        pad = torch.cat((x, x.new_zeros(4 - m, x.shape[1])))
        same.append(torch.equal(F.linear(pad, w)[:m].argmax(-1), F.linear(x, w).argmax(-1)))
    out["padded_argmax_equal"] = all(same)
    out["loadavg_end"] = os.getloadavg()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
