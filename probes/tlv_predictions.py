"""Does the cost model price a TLV cycle right? Predicted against live c for TLV candidates (§3.2, §4.3).

The pilot screens only the candidates its cost model predicts to beat the incumbent, so on a target where TLV loses
(the CPU's float32 reference of the 8-bit view, or a launch-bound GPU target) its TLV price is never checked
against a live run. This probe runs the pilot's own phases up to its cost-model inputs (setup, Phase 0, the
recordings, the Q pass recorded and timed by rows), then for each TLV candidate below and its single-pass twin
does what screening does: the planner's prediction over the screened requests' replayed steps beside a live
measurement interleaved with AR on the same recorded prompts (``rounds.screen``'s pair, without its filter).

    python probes/tlv_predictions.py OUT.json [--device cpu --dtype float32 --quick]

Writes JSON: per candidate replay τ / live τ, model c / live c and their ratio, plus the Q pass's agreement and
time by rows; device, versions and commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from specpilot.config import SystemConfig
from specpilot.pilot.costinputs import cost_inputs
from specpilot.pilot.phase0 import prepare, run_phase0
from specpilot.pilot.rounds import SCREEN_REQUESTS
from specpilot.pilot.state import Pilot, PilotOptions
from specpilot.provenance import git_commit, versions
from specpilot.zoo import bundled_block_dir, bundled_drafter_dir, bundled_target_dir


def candidates(blocks: tuple) -> list[SystemConfig]:
    """Single-pass configs and their TLV twins: the draft model and the block drafter, best-first at 8 and 16."""
    base = [SystemConfig(drafter="draft_model", tree="best_first", nodes=n, depth=6, top_k=4) for n in (8, 16)]
    base += [SystemConfig(drafter="block", drafter_path=str(b), tree="best_first", nodes=n, depth=8, top_k=16)
             for b in blocks for n in (8, 16)]
    return [c for b in base for c in (b, b.model_copy(update={"tlv": True, "q_weights": "view8"}))]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    blocks = (bundled_block_dir(),)
    with tempfile.TemporaryDirectory() as tmp:
        opts = PilotOptions(target=bundled_target_dir(), drafter=bundled_drafter_dir(), out=Path(tmp) / "report",
                            quick=args.quick, device=args.device, dtype=args.dtype, blocks=blocks, executor="local")
        pilot = Pilot(opts)
        try:
            torch.manual_seed(0)
            prepare(pilot)
            p0 = run_phase0(pilot)
            inputs = cost_inputs(pilot, p0)
            idx = pilot.spread_indices(SCREEN_REQUESTS)
            reqs = [pilot.replay_reqs[i] for i in idx]
            rows = []
            for cfg in candidates(blocks):
                pred = pilot.planner.predict(cfg, requests=idx)
                if pred is None:
                    rows.append({"name": cfg.label(), "tlv": cfg.tlv, "prediction": None})
                    continue
                m = pilot.measure(cfg, reqs=reqs)
                rows.append({"name": cfg.label(), "tlv": cfg.tlv, "tau_replay": pred.tau, "tau_live": m["tau"],
                             "c_predicted": pred.c, "c_live": m["c"], "c_ratio": pred.c / m["c"],
                             "step_ms_live": m["step_ms"], "ar_step_ms": m["ar_step_ms"]})
                print(f"{cfg.label():50s} τ {pred.tau:.3f}/{m['tau']:.3f}  c {pred.c:.3f}/{m['c']:.3f}", flush=True)
        finally:
            pilot.dispatch.close()
    errs = {k: [abs(r["c_ratio"] - 1) for r in rows if "c_ratio" in r and r["tlv"] == k] for k in (True, False)}
    res = {"probe": "tlv_predictions", "device": args.device, "dtype": args.dtype, "quick": args.quick,
           "commit": git_commit(), "versions": versions(), "requests": idx,
           "tlv_inputs": inputs.report.get("tlv"), "candidates": rows,
           "median_abs_c_error": {"tlv": statistics.median(errs[True]) if errs[True] else None,
                                  "single": statistics.median(errs[False]) if errs[False] else None}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res["median_abs_c_error"]))
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
