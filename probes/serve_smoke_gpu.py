"""The server on a GPU, end to end: start `specpilot serve --device cuda --dtype bfloat16` on the bundled target (the
loader thread loads it and captures the CUDA graphs), wait for /v1/models, send a completion and a chat, a bad
request (max_tokens -1: expects a 400), the first completion again (expects the same text: the engine stayed usable),
then SIGINT; records ready time, responses, status and exit code (130: uvicorn re-raises the Ctrl-C after a clean
shutdown) in OUT_DIR/serve_smoke.json, the server's log in OUT_DIR/serve.log.

Usage: ``python probes/serve_smoke_gpu.py OUT_DIR`` on a machine with CUDA (about 30 s on an H200)."""
import json, os, signal, subprocess, sys, time, urllib.request
out = sys.argv[1]; port = 8011
cmd = [sys.executable, "-m", "specpilot", "serve", "--device", "cuda", "--dtype", "bfloat16", "--port", str(port)]
log = open(os.path.join(out, "serve.log"), "w")
t0 = time.time(); p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
rec = {"cmd": cmd}
def get(path, body=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=None if body is None else json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r: return json.loads(r.read())
for _ in range(240):
    try: rec["models"] = get("/v1/models"); break
    except Exception: time.sleep(0.5)
rec["ready_s"] = time.time() - t0
try:
    mid = rec["models"]["data"][0]["id"]
    rec["completion"] = get("/v1/completions", {"model": mid, "prompt": "The quick brown fox", "max_tokens": 48})
    rec["chat"] = get("/v1/chat/completions", {"model": mid, "messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 48})
    rec["bad"] = None
    try: get("/v1/completions", {"model": mid, "prompt": "x", "max_tokens": -1})
    except urllib.error.HTTPError as e: rec["bad"] = e.code
    rec["after_bad"] = get("/v1/completions", {"model": mid, "prompt": "The quick brown fox", "max_tokens": 48})
    rec["same_after_bad"] = rec["after_bad"]["choices"][0]["text"] == rec["completion"]["choices"][0]["text"]
except Exception as e:
    rec["error"] = repr(e)
p.send_signal(signal.SIGINT)
try: rec["exit"] = p.wait(60)
except subprocess.TimeoutExpired: p.kill(); rec["exit"] = "killed"
json.dump(rec, open(os.path.join(out, "serve_smoke.json"), "w"), indent=1)
print({k: rec.get(k) for k in ("ready_s", "bad", "same_after_bad", "exit", "error")})
