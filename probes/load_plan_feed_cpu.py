import sys, time, json, torch
from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.engine.load_plan import LoadPlan
from specpilot.zoo import bundled_target_dir
torch.set_num_threads(2)
dep = Deployment(bundled_target_dir())
cal = dict(drafter="calibrated", drafter_path="cal/block16.json", tree="best_first", nodes=6, depth=6, top_k=4)
plan = LoadPlan((1, 16), (SystemConfig(**cal), SystemConfig.ar()))
prompts = [[(7 * i + j) % 200 + 300 for j in range(40)] for i in range(16)]
res = {}
for name, cfg in (("ar", SystemConfig.ar()), ("plan", plan), ("ar2", SystemConfig.ar()), ("plan2", plan)):
    eng = dep.batch_system(cfg, max_num_seqs=16, max_len=200, eos_ids=[])
    for d in eng.drafters:
        if hasattr(d, "prepare_all"): d.prepare_all(prompts, 64)
    eng.generate_all(prompts[:2], 4)
    t = time.perf_counter(); g = eng.generate_all(prompts, 64); dt = time.perf_counter() - t
    res[name] = round(sum(len(x.tokens) for x in g) / dt, 1)
print(sys.argv[1], res)
