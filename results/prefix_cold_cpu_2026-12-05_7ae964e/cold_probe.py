import json, time, torch
torch.set_num_threads(2)
from transformers import AutoTokenizer
from specpilot.config import SystemConfig
from specpilot.data.benchmarks import PROMPTS_DIR
from specpilot.engine.batch import Request
from specpilot.engine.deployment import Deployment
dep = Deployment("/work/smollm2"); tok = AutoTokenizer.from_pretrained("/work/smollm2")
lines = (PROMPTS_DIR / "gsm8k_test.jsonl").read_text().splitlines()
def chat(i): return tok.apply_chat_template([{"role": "user", "content": json.loads(lines[i])["question"]}], add_generation_prompt=True, tokenize=True, return_dict=False)
P = [chat(i) for i in range(8)] * 4
Q = [chat(i) for i in range(8, 16)] * 4
def run(eng, prompts, tag):
    for i, p in enumerate(prompts): eng.add_request(Request(f"{tag}{i}", list(p), 128))
    t0, pre = time.perf_counter(), 0.0
    while eng.has_work():
        s0, b = time.perf_counter(), eng.prefill_passes
        eng.step()
        if eng.prefill_passes != b: pre += time.perf_counter() - s0
    return round(time.perf_counter() - t0, 2), round(pre, 2)
for trial in range(2):
    e1 = dep.batch_system(SystemConfig.ar(), max_num_seqs=32, max_len=1024)
    print("fresh engine, P:", run(e1, P, "a"), " then P again:", run(e1, P, "b"), flush=True)
    e2 = dep.batch_system(SystemConfig.ar(), max_num_seqs=32, max_len=1024)
    print("fresh engine, Q:", run(e2, Q, "c"), " then P (shapes warm, no reuse):", run(e2, P, "d"), " then P again:", run(e2, P, "e"), flush=True)
    e3 = dep.batch_system(SystemConfig.ar(), max_num_seqs=32, max_len=1024, prefix_caching=False)
    print("no prefix reuse: P:", run(e3, P, "f"), " then P again:", run(e3, P, "g"), flush=True)
