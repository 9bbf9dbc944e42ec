"""Prototype: the batched CPU AR step with torch.compile'd elementwise pieces (norm, add+norm, RoPE, silu*mul)
against the eager layer. SmolLM2 float32, 2 threads, 8 (or N) GSM8K chat prompts, 128 new tokens."""
import json, sys, time, statistics
import torch
import torch.nn.functional as F
torch.set_num_threads(2)
from transformers import AutoTokenizer
from specpilot.config import SystemConfig
from specpilot.data.benchmarks import PROMPTS_DIR
from specpilot.engine.batch import Request
from specpilot.engine.deployment import Deployment
from specpilot.model import layers as L
from specpilot.model.layers import batch_sdpa

N = int(sys.argv[1]) if len(sys.argv) > 1 else 8
dep = Deployment("/work/smollm2"); tok = AutoTokenizer.from_pretrained("/work/smollm2")
lines = (PROMPTS_DIR / "gsm8k_test.jsonl").read_text().splitlines()
def chat(i): return tok.apply_chat_template([{"role": "user", "content": json.loads(lines[i])["question"]}], add_generation_prompt=True, tokenize=True, return_dict=False)
P = [chat(i % 8) for i in range(N)]

@torch.compile(dynamic=True, fullgraph=True)
def rmsnorm_c(x, w, eps: float):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

@torch.compile(dynamic=True, fullgraph=True)
def add_rmsnorm_c(x, d, w, eps: float):
    x = x + d
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)), x

@torch.compile(dynamic=True, fullgraph=True)
def rope_c(qkv, cos, sin, nq: int, hd: int):
    r = qkv.shape[0]
    qk = qkv[:, : nq * hd].reshape(r, nq, hd)
    x1, x2 = qk.chunk(2, dim=-1)
    return qk * cos[:, None, :] + torch.cat((-x2, x1), dim=-1) * sin[:, None, :]

@torch.compile(dynamic=True, fullgraph=True)
def silu_mul_c(gu):
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u

def fused_forward_batch(self, x, cos, sin, pool, layer, p, prof=None, kernel=False):
    attn, a, mlp = self.self_attn, self.self_attn.args, self.mlp
    ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
    r = x.shape[0]
    h = rmsnorm_c(x, ln1.weight, ln1.eps)
    qkv = attn.qkv_proj(h)
    nq = a.n_heads + a.n_kv_heads
    qk = rope_c(qkv, cos, sin, nq, a.head_dim)
    q, k = qk[:, : a.n_heads], qk[:, a.n_heads:]
    v = qkv[:, nq * a.head_dim:].reshape(r, a.n_kv_heads, a.head_dim)
    pool.k[p.slot, layer, p.pos] = k
    pool.v[p.slot, layer, p.pos] = v
    if p.window is not None:
        w = slice(p.window[0], p.window[0] + p.window[1])
        keys, vals = pool.k[w, layer, : p.span], pool.v[w, layer, : p.span]
    else:
        keys = pool.k[:, layer, : p.span].index_select(0, p.slots)
        vals = pool.v[:, layer, : p.span].index_select(0, p.slots)
    o = attn.o_proj(batch_sdpa(q, keys, vals, p).reshape(r, a.n_heads * a.head_dim))
    h, x = add_rmsnorm_c(x, o, ln2.weight, ln2.eps)
    return x + mlp.down_proj(silu_mul_c(mlp.gate_up_proj(h)))

eager = L.DecoderLayer.forward_batch
def run(fused, tag):
    L.DecoderLayer.forward_batch = fused_forward_batch if fused else eager
    eng = dep.batch_system(SystemConfig.ar(), max_num_seqs=N, max_len=1024, prefix_caching=False)
    for i, p in enumerate(P): eng.add_request(Request(f"{tag}{i}", list(p), 128))
    steps, outs, t0 = [], {}, time.perf_counter()
    while eng.has_work():
        s0, b = time.perf_counter(), eng.prefill_passes
        for o in eng.step():
            outs.setdefault(o.request_id[len(tag):], []).extend(o.new_tokens)
        if eng.prefill_passes == b and len(eng._running) == N:
            steps.append(time.perf_counter() - s0)
    tot = sum(len(v) for v in outs.values())
    return {"wall_s": time.perf_counter() - t0, "tok_s": tot / (time.perf_counter() - t0),
            "full_steps": len(steps), "step_ms_median": 1e3 * statistics.median(steps)}, outs

res = {"eager": [], "fused": []}
t = time.perf_counter(); _, o_ref = run(True, "w"); print("compile+warm", time.perf_counter() - t, flush=True)
outs = {}
for rnd in range(3):
    for name in (("eager", "fused") if rnd % 2 == 0 else ("fused", "eager")):
        r, o = run(name == "fused", f"{name}{rnd}")
        res[name].append(r); outs[name] = o
        print(name, rnd, r, flush=True)
same = all(outs["eager"][k] == outs["fused"][k] for k in outs["eager"])
print("outputs equal:", same, "| token diffs:", sum(a != b for k in outs["eager"] for a, b in zip(outs["eager"][k], outs["fused"][k])))
print(json.dumps(res))
