"""Where a calibrated drafter's recorded draft time goes on the GPU (Qwen3-8B shape, random bf16)."""
import json, os, sys, time, torch
DEV, DT = os.environ.get("DEV", "cuda"), os.environ.get("DT", "bfloat16")
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.pilot.costinputs import record_calibrated
from specpilot.spec.drafter import propose_one
out = {}
dep = Deployment(sys.argv[1], dtype=DT, device=DEV)
prompts = [list(range(300, 812)), list(range(1000, 1300))]
ar = [dep.system(SystemConfig.ar(dtype=DT), eos_ids=[]).generate(p, 24).tokens for p in prompts]
t0 = time.perf_counter()
key, rec = record_calibrated(dep, sys.argv[2], prompts, ar, [24, 24])
out["record_s"] = time.perf_counter() - t0
out.update(draft_ms=rec.draft_ms, first_ms=rec.first_ms, observe_ms=rec.observe_ms)
print(out, flush=True)
cdr = dep.system(SystemConfig(drafter="calibrated", drafter_path=sys.argv[2], top_k=16, depth=16, nodes=16,
                              dtype=DT)).drafter
cost = cdr.cost
print("cost drafter", type(cost).__name__, getattr(cost, "_step", None), flush=True)
p, a = prompts[0], ar[0]
seq = p + a
feats = []
with torch.inference_mode():
    dep.target.forward(torch.tensor(seq[:-1], device=DEV), torch.arange(len(seq) - 1, device=DEV),
                       dep.target.new_cache(len(seq)), 0, features=feats, feature_layers=cdr.target_layers)
feats = torch.cat(feats, -1)
cdr.reset(0)
cdr.observe(0, feats[: len(p)], 0)
times = {"cost_propose": [], "calibrated_propose": [], "observe": []}
for m in range(1, 20):
    n = len(p) + m
    if m > 1:
        sync(); t = time.perf_counter()
        cdr.observe(0, feats[n - 2 : n - 1], n - 2); sync()
        times["observe"].append(1e3 * (time.perf_counter() - t))
    sync(); t = time.perf_counter()
    propose_one(cdr, p + a[:m], 16); sync()
    times["calibrated_propose"].append(1e3 * (time.perf_counter() - t))
out["times_ms"] = times
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if DEV == "cuda" else [])) as prof:
    for m in range(20, 23):
        n = len(p) + m
        cdr.observe(0, feats[n - 2 : n - 1], n - 2)
        propose_one(cdr, p + a[:m], 16)
    sync()
tab = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
print(tab)
out["profile"] = tab
json.dump(out, open(sys.argv[3], "w"), indent=1)
print({k: [round(x, 2) for x in v] for k, v in times.items()})
