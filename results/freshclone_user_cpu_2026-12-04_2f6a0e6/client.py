"""Hit a SpecPilot server with the openai client; print outputs as JSON."""
import json, sys, time, concurrent.futures as cf
from openai import OpenAI
port = int(sys.argv[1]); tag = sys.argv[2]
c = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
model = c.models.list().data[0].id
prompts = ["def fib(n):", "import os\n", "Natalia sold clips to 48 of her friends", "class Stack:",
           "Write a function to find the", "for i in range(", "The capital of", "def add(a, b):",
           "# sort a list\n", "x = [", "Janet's ducks lay 16 eggs", "def is_prime(n):",
           "while True:", "return ", "print(", "Explain recursion"]
res = {}
def comp(p): return c.completions.create(model=model, prompt=p, max_tokens=24).choices[0].text
def comp_stream(p):
    return "".join(ch.choices[0].text for ch in c.completions.create(model=model, prompt=p, max_tokens=24, stream=True) if ch.choices)
def chat(p): return c.chat.completions.create(model=model, messages=[{"role": "user", "content": p}], max_tokens=24).choices[0].message.content
def chat_stream(p):
    out = []
    for ch in c.chat.completions.create(model=model, messages=[{"role": "user", "content": p}], max_tokens=24, stream=True):
        if ch.choices and ch.choices[0].delta.content: out.append(ch.choices[0].delta.content)
    return "".join(out)
for name, f, conc in [("comp", comp, 4), ("comp_stream", comp_stream, 8), ("chat", chat, 16), ("chat_stream", chat_stream, 16)]:
    t = time.time()
    with cf.ThreadPoolExecutor(conc) as ex:
        res[name] = list(ex.map(f, prompts))
    print(f"{tag} {name} conc={conc} {time.time()-t:.1f}s", file=sys.stderr)
json.dump({"model": model, **res}, open(f"/tmp/sp_client/{tag}.json", "w"), indent=1)
