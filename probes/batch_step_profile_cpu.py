import json, time, torch
from torch.profiler import profile, ProfilerActivity
from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.engine.batch import Request
torch.set_num_threads(2)
dep = Deployment('/work/smollm2')
lines = open('/work/main/specpilot/data/prompts/gsm8k_test.jsonl').read().splitlines()[:8]
qs = [json.loads(x)["question"] for x in lines]
prompts = [dep.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True) for q in qs]
prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
eng = dep.batch_system(SystemConfig.ar(), max_num_seqs=32, max_len=1024)
for i in range(32): eng.add_request(Request(f"r{i}", prompts[i % 8], 128))
for _ in range(60): eng.step()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    t = time.perf_counter()
    for _ in range(10): eng.step()
    print("ms/step", (time.perf_counter() - t) * 100)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
