import json, sys, time, threading
from openai import OpenAI
from transformers import AutoTokenizer
from specpilot.data.benchmarks import PROMPTS_DIR
lines = (PROMPTS_DIR / "gsm8k_test.jsonl").read_text().splitlines()
qs = [json.loads(lines[i])["question"] for i in range(8)]
c = OpenAI(base_url="http://127.0.0.1:8011/v1", api_key="x")
def one(q, out, i):
    r = c.chat.completions.create(model=c.models.list().data[0].id, messages=[{"role": "user", "content": q}], max_tokens=128, temperature=0)
    out[i] = r.usage.completion_tokens
for conc in [1, 8, 8]:
    out = {}
    t = time.perf_counter()
    if conc == 1:
        for i, q in enumerate(qs): one(q, out, i)
    else:
        th = [threading.Thread(target=one, args=(q, out, i)) for i, q in enumerate(qs)]
        [x.start() for x in th]; [x.join() for x in th]
    w = time.perf_counter() - t
    print(conc, "tokens", sum(out.values()), "wall", round(w, 2), "tok/s", round(sum(out.values()) / w, 1), "t0", t, flush=True)
