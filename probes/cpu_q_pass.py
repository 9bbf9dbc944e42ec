"""The CPU Q pass against the exact pass, by rows: the Q view's projections prepacked (as the plain target's are)
against ``F.linear`` over the same approximate weights (MKL's path, which repacks the weight on every call).

One thread; ``measure_verify_ms`` (a pass + LM head + argmax + host read, rows attending to 200 committed slots) of
the exact target, the ``view8`` Q view packed, the same Q view with its packs switched off, in two orders (A B C,
C B A; the mean of each pair is reported, both kept). Also the largest |logit| difference between packed and plain
Q passes at 5 rows (float32 sums in another order) and whether their argmax agrees.

    python probes/cpu_q_pass.py --target /work/smollm2 --out results/cpu_q_pass_cpu_<date>_<commit>.json
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

ROWS = (1, 2, 3, 4, 5, 7, 9, 13, 17, 33)


def unpacked(q) -> None:
    """Switch ``q``'s prepacked Q-view GEMMs off (the plain ``F.linear`` path the view used before)."""
    from specpilot.w12.linear import W12Linear

    for m in q.modules():
        if isinstance(m, W12Linear):
            m._kept[("packed", True)] = None  # after a first call: the reference then takes F.linear (_reference)


def main() -> None:
    from specpilot.model.checkpoint import load_model
    from specpilot.model.qview import q_view
    from specpilot.pilot.setup import measure_verify_ms
    from specpilot.provenance import git_commit, versions

    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    target = load_model(args.target, "float32", "cpu")
    packed, plain = q_view(target, "view8"), q_view(target, "view8")
    toks, pos = torch.arange(5), torch.arange(5)
    lp = packed.logits(packed.forward(toks, pos, target.new_cache(64), 0))
    plain.forward(toks, pos, target.new_cache(64), 0)  # keeps each layer's view weight: then switch its packs off
    unpacked(plain)
    lq = plain.logits(plain.forward(toks, pos, target.new_cache(64), 0))
    models = {"exact": target, "q_view8_packed": packed, "q_view8_plain": plain}
    runs = []
    for order in (list(models), list(models)[::-1]):
        runs.append({k: measure_verify_ms(models[k], 200, rows=ROWS, repeats=args.repeats) for k in order})
        print(json.dumps({k: {r: round(v, 1) for r, v in t.items()} for k, t in runs[-1].items()}), flush=True)
    mean = {k: {r: sum(run[k][r] for run in runs) / len(runs) for r in ROWS} for k in models}
    res = {"device": f"cpu {platform.processor() or platform.machine()}, 1 thread", "versions": versions(),
           "commit": git_commit(), "target": args.target, "rows": list(ROWS), "ms": mean, "runs": runs,
           "q_over_exact": {k: {r: mean[k][r] / mean["exact"][r] for r in ROWS} for k in models if k != "exact"},
           "packed_vs_plain_max_abs_logit_diff": float((lp - lq).abs().max()),
           "packed_vs_plain_argmax_equal": bool(torch.equal(lp.argmax(-1), lq.argmax(-1))),
           "method": "measure_verify_ms per model (interleaved rows, median of repeats), orders A B C and C B A"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
