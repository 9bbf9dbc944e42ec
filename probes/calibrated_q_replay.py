"""TLV τ on the bundled pair by exact replay: the real block drafter with the real view8 Q pass, the calibrated drafter
of CAL with the real Q pass, and the calibrated drafter with the SIMULATED Q agreement stored in CAL (what a
random-weight target of a real shape would get). On the real pair the real Q recording exists, so the last two
columns show what the simulation of the Q pass (independent draws per chain row) changes.

    python probes/calibrated_q_replay.py CAL.json OUT.json [--per-benchmark 4] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specpilot.config import SystemConfig
from specpilot.data.benchmarks import load_mix
from specpilot.engine.deployment import Deployment
from specpilot.model.qview import q_view
from specpilot.pilot.replay import record, replay
from specpilot.pilot.replay_tlv import QRecording, record_q, replay_tlv
from specpilot.provenance import git_commit, versions
from specpilot.spec.calibrated import SEED, CalibratedDrafter
from specpilot.spec.calibrated_q import QSimulation, simulated_chains
from specpilot.spec.calibration import load_calibration
from specpilot.zoo import bundled_block_dir, bundled_target_dir

ap = argparse.ArgumentParser()
ap.add_argument("cal")
ap.add_argument("out")
ap.add_argument("--per-benchmark", type=int, default=4)
ap.add_argument("--tokens", type=int, default=64)
a = ap.parse_args()
t0 = time.time()
cal = load_calibration(a.cal)
dep = Deployment(bundled_target_dir(), block_dirs=[bundled_block_dir()])
prompts = [dep.tokenizer(r.text, add_special_tokens=False)["input_ids"] for r in load_mix(a.per_benchmark, dep.tokenizer)]
with torch.inference_mode():
    ar = [dep.system(SystemConfig.ar(), eos_ids=[]).generate(p, a.tokens).tokens for p in prompts]
D, K = cal.depth, cal.top_k
block = dep.system(SystemConfig(drafter="block", drafter_path=str(bundled_block_dir()), top_k=K)).drafter
rec_block = record(block, prompts, ar, D, K, target=dep.target)
sim_drafter = CalibratedDrafter(cal, dep.target.args.vocab_size, seed=SEED)
for p, o in zip(prompts, ar):
    sim_drafter.expect(p, o)
rec_cal = record(sim_drafter, prompts, ar, D, K)
q_real = record_q(dep.target, q_view(dep.target, "view8"), rec_block, D, "view8")
sim = QSimulation(cal.q_agreement, dep.target.args.vocab_size, SEED)
q_sim = QRecording(simulated_chains(prompts, ar, sim, D), D, "view8")
rows = []
for tree, n, k in (("best_first", 32, 16), ("chain", 16, 1), ("best_first", 12, 8)):
    cfg = SystemConfig(drafter="block", tree=tree, nodes=n, depth=min(D, n), top_k=k)
    rows.append({"tree": tree, "nodes": n, "depth": cfg.depth, "top_k": k,
                 "single_block": replay(rec_block, cfg)[0], "single_calibrated": replay(rec_cal, cfg)[0],
                 "tlv_block_real_q": replay_tlv(rec_block, q_real, cfg)["tau"],
                 "tlv_calibrated_real_q": replay_tlv(rec_cal, q_real, cfg)["tau"],
                 "tlv_calibrated_simulated_q": replay_tlv(rec_cal, q_sim, cfg)["tau"]})
    print(rows[-1])
res = {"probe": "calibrated_q_replay", "device": "cpu", "dtype": "float32", "commit": git_commit(),
       "versions": versions(), "calibration": a.cal, "q_agreement": cal.q_agreement,
       "requests": len(prompts), "tokens": a.tokens, "seed": SEED,
       "agreement_real": q_real.agreement(rec_block), "agreement_simulated": q_sim.agreement(rec_block),
       "rows": rows, "seconds": round(time.time() - t0, 1),
       "note": "tau = tokens per exact pass by exact replay (TLV: replay_tlv); 'calibrated' = the SIMULATED drafter"}
with open(a.out, "w") as f:
    json.dump(res, f, indent=1)
print(json.dumps({k: res[k] for k in ("agreement_real", "agreement_simulated", "seconds")}))
