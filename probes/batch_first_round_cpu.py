import json, sys, time, torch
from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.engine.batch import Request
torch.set_num_threads(2)
dep = Deployment('/work/smollm2')
lines = open('/work/main/specpilot/data/prompts/gsm8k_test.jsonl').read().splitlines()[:8]
qs = [json.loads(x)["question"] for x in lines]
prompts = [dep.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True) for q in qs]
prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
plan = [int(x) for x in sys.argv[1].split(',')]; compile_cpu = len(sys.argv) > 2
eng = dep.batch_system(SystemConfig.ar(), max_num_seqs=32, max_len=1024, compile_cpu=compile_cpu)
if compile_cpu: eng.compile_shapes()
for rnd, conc in enumerate(plan):
    reqs = [Request(f"r{rnd}_{i}", prompts[i % 8], 128) for i in range(conc)]
    for q in reqs: eng.add_request(q)
    pre = dec = 0.0; npre = ndec = 0; toks = 0
    t0 = time.perf_counter()
    while eng.has_work():
        p0 = eng.prefill_passes; t = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
        toks += sum(len(o.new_tokens) for o in outs)
        if eng.prefill_passes > p0: pre += dt; npre += 1
        else: dec += dt; ndec += 1
    wall = time.perf_counter() - t0
    print(f"conc {conc} round {rnd}: {toks/wall:.1f} tok/s wall {wall:.2f}s; prefill steps {npre} {pre:.2f}s; decode steps {ndec} {dec:.2f}s ({dec/ndec*1e3:.1f} ms/step)", flush=True)
