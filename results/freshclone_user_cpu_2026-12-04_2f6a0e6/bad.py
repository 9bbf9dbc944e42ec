"""Bad inputs against a SpecPilot server; after each, check a good request still works."""
import sys, json, urllib.request, urllib.error
class R:
    def __init__(s, code, text): s.status_code, s.text = code, text
    def json(s): return json.loads(s.text)
def _req(method, url, data=None, headers=None, timeout=120):
    rq = urllib.request.Request(url, data=data, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(rq, timeout=timeout) as r: return R(r.status, r.read().decode())
    except urllib.error.HTTPError as e: return R(e.code, e.read().decode())
class httpx:
    @staticmethod
    def get(url, headers=None, timeout=120): return _req("GET", url, None, headers, timeout)
    @staticmethod
    def post(url, json=None, content=None, headers=None, timeout=120):
        import json as J
        h = dict(headers or {}); h.setdefault("Content-Type", "application/json")
        return _req("POST", url, content if content is not None else J.dumps(json).encode(), h, timeout)
port = int(sys.argv[1]); base = f"http://127.0.0.1:{port}/v1"
h = {"Authorization": "Bearer x"}
model = httpx.get(base + "/models", headers=h).json()["data"][0]["id"]
good = {"model": model, "prompt": "def f(", "max_tokens": 4}
cases = [
 ("wrong model", "/completions", {"model": "gpt-4", "prompt": "hi", "max_tokens": 4}),
 ("temperature 0.7", "/completions", {"model": model, "prompt": "hi", "max_tokens": 4, "temperature": 0.7}),
 ("temperature 0.7 chat", "/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}], "temperature": 0.7}),
 ("n=2", "/completions", {"model": model, "prompt": "hi", "max_tokens": 4, "n": 2}),
 ("empty messages", "/chat/completions", {"model": model, "messages": []}),
 ("huge max_tokens", "/completions", {"model": model, "prompt": "hi", "max_tokens": 10**9}),
 ("huge max_tokens chat", "/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**12}),
 ("non-JSON body", "/completions", b"{not json"),
 ("JSON array body", "/completions", [1, 2]),
 ("empty prompt", "/completions", {"model": model, "prompt": "", "max_tokens": 4}),
 ("negative max_tokens", "/completions", {"model": model, "prompt": "hi", "max_tokens": -5}),
 ("max_tokens string", "/completions", {"model": model, "prompt": "hi", "max_tokens": "ten"}),
 ("max_tokens 0", "/completions", {"model": model, "prompt": "hi", "max_tokens": 0}),
 ("prompt list of ints", "/completions", {"model": model, "prompt": [1, 2, 3], "max_tokens": 4}),
 ("prompt token out of vocab", "/completions", {"model": model, "prompt": [10**9], "max_tokens": 4}),
 ("prompt negative token", "/completions", {"model": model, "prompt": [-1], "max_tokens": 4}),
 ("prompt list of 2 strings", "/completions", {"model": model, "prompt": ["a", "b"], "max_tokens": 4}),
 ("missing prompt", "/completions", {"model": model, "max_tokens": 4}),
 ("messages not a list", "/chat/completions", {"model": model, "messages": "hi"}),
 ("message bad role", "/chat/completions", {"model": model, "messages": [{"role": "wizard", "content": "hi"}]}),
 ("message content null", "/chat/completions", {"model": model, "messages": [{"role": "user", "content": None}]}),
 ("message content parts", "/chat/completions", {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 4}),
 ("top_p 0.5", "/completions", {"model": model, "prompt": "hi", "max_tokens": 4, "top_p": 0.5}),
 ("logprobs 2", "/completions", {"model": model, "prompt": "hi", "max_tokens": 4, "logprobs": 2}),
 ("stop list", "/completions", {"model": model, "prompt": "def f(", "max_tokens": 8, "stop": ["\n"]}),
 ("temperature 0", "/completions", {"model": model, "prompt": "hi", "max_tokens": 4, "temperature": 0}),
 ("temperature -1", "/completions", {"model": model, "prompt": "hi", "max_tokens": 4, "temperature": -1}),
 ("temperature string", "/completions", {"model": model, "prompt": "hi", "max_tokens": 4, "temperature": "hot"}),
 ("long prompt", "/completions", {"model": model, "prompt": "x " * 20000, "max_tokens": 4}),
 ("stream_options", "/completions", {"model": model, "prompt": "hi", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}),
 ("unknown field", "/completions", {"model": model, "prompt": "hi", "max_tokens": 4, "foo": 1}),
 ("GET completions", "GET /completions", None),
 ("no auth", "NOAUTH /completions", {"model": model, "prompt": "hi", "max_tokens": 4}),
]
for name, path, body in cases:
    try:
        if path.startswith("GET "):
            r = httpx.get(base + path[4:], headers=h, timeout=120)
        elif path.startswith("NOAUTH "):
            r = httpx.post(base + path[7:], json=body, timeout=120)
        elif isinstance(body, bytes):
            r = httpx.post(base + path, content=body, headers={**h, "Content-Type": "application/json"}, timeout=120)
        else:
            r = httpx.post(base + path, json=body, headers=h, timeout=120)
        txt = r.text.replace("\n", "\\n")
        print(f"{name:28s} {r.status_code} {txt[:230]}")
    except Exception as e:
        print(f"{name:28s} EXC {type(e).__name__}: {e}")
    g = httpx.post(base + "/completions", json=good, headers=h, timeout=120)
    if g.status_code != 200:
        print(f"   !!! server unusable after {name}: {g.status_code} {g.text[:200]}")
print("health", httpx.get(f"http://127.0.0.1:{port}/health").status_code)
