"""Prototype: the batched CPU pass's whole layer stack as one torch.compile graph (one entry a step); the prepacked
oneDNN projections as an opaque custom op, the K/V written in place into the pool. SmolLM2 float32, 2 threads."""
import json, sys, time, statistics
import torch
import torch.nn.functional as F
torch.set_num_threads(2)
from torch.library import custom_op
from transformers import AutoTokenizer
from specpilot.config import SystemConfig
from specpilot.data.benchmarks import PROMPTS_DIR
from specpilot.engine.batch import Request
from specpilot.engine.deployment import Deployment
from specpilot.model import transformer as T

N = int(sys.argv[1]) if len(sys.argv) > 1 else 8
dep = Deployment("/work/smollm2"); tok = AutoTokenizer.from_pretrained("/work/smollm2")
lines = (PROMPTS_DIR / "gsm8k_test.jsonl").read_text().splitlines()
def chat(i): return tok.apply_chat_template([{"role": "user", "content": json.loads(lines[i])["question"]}], add_generation_prompt=True, tokenize=True, return_dict=False)
P = [chat(i % 8) for i in range(N)]
model = dep.target
REG, OUT = [], []
def wid(lin):
    REG.append(lin); OUT.append(lin.out_features); return len(REG) - 1

@custom_op("spx::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, w: int) -> torch.Tensor:
    return REG[w](x)

@packed_linear.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], OUT[w])

L = []
for layer in model.model.layers:
    a = layer.self_attn
    L.append((layer.input_layernorm.weight, wid(a.qkv_proj), wid(a.o_proj), layer.post_attention_layernorm.weight,
              wid(layer.mlp.gate_up_proj), wid(layer.mlp.down_proj)))
args = model.model.layers[0].self_attn.args
EPS = model.model.layers[0].input_layernorm.eps
H, KVH, HD = args.n_heads, args.n_kv_heads, args.head_dim
G, NQ = H // KVH, H + KVH

def norm(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))

def stack(x, cos, sin, pk, pv, slot, pos, lo: int, w: int, span: int, gmask, flat, rm: int, dense: bool):
    r = x.shape[0]
    for i, (n1, wqkv, wo, n2, wgu, wd) in enumerate(L):
        qkv = packed_linear(norm(x, n1), wqkv)
        qk = qkv[:, : NQ * HD].reshape(r, NQ, HD)
        x1, x2 = qk.chunk(2, dim=-1)
        qk = qk * cos[:, None, :] + torch.cat((-x2, x1), dim=-1) * sin[:, None, :]
        q, k = qk[:, :H], qk[:, H:]
        v = qkv[:, NQ * HD:].reshape(r, KVH, HD)
        pk[slot, i, pos] = k
        pv[slot, i, pos] = v
        keys, vals = pk[lo: lo + w, i, :span], pv[lo: lo + w, i, :span]
        qp = q if dense else q.new_zeros(w * rm, H, HD).index_copy(0, flat, q)
        qg = qp.reshape(w, rm, KVH, G, HD).permute(0, 2, 3, 1, 4).reshape(w, KVH, G * rm, HD)
        o = F.scaled_dot_product_attention(qg, keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=gmask)
        o = o.reshape(w, KVH, G, rm, HD).permute(0, 3, 1, 2, 4).reshape(w * rm, H, HD)
        o = o if dense else o.index_select(0, flat)
        x = x + packed_linear(o.reshape(r, H * HD), wo)
        gu = packed_linear(norm(x, n2), wgu)
        g_, u = gu.chunk(2, dim=-1)
        x = x + packed_linear(F.silu(g_) * u, wd)
    return norm(x, model.model.norm.weight)

cstack = torch.compile(stack, dynamic=True)
eager_fp = T.Transformer.forward_prepared
calls = {"compiled": 0, "eager": 0}
def compiled_fp(self, tokens, positions, pool, p, kernel, prof=None, features=None, feature_layers=()):
    if p.window is None or feature_layers or kernel:
        calls["eager"] += 1
        return eager_fp(self, tokens, positions, pool, p, kernel, prof, features, feature_layers)
    calls["compiled"] += 1
    x, cos, sin = self._embed(tokens, positions, prof)
    lo, w = p.window
    return cstack(x, cos, sin, pool.k, pool.v, p.slot, p.pos, lo, w, p.span, p.grouped_mask(G), p.flat, p.r_max, p.dense)

def run(compiled, tag):
    T.Transformer.forward_prepared = compiled_fp if compiled else eager_fp
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
    return {"wall_s": round(time.perf_counter() - t0, 3), "tok_s": round(tot / (time.perf_counter() - t0), 1),
            "full_steps": len(steps), "step_ms_median": round(1e3 * statistics.median(steps), 2)}, outs

t = time.perf_counter(); r, o_c = run(True, "w"); print("compile+warm run", round(time.perf_counter() - t, 1), r, calls, flush=True)
t = time.perf_counter(); r, o_c = run(True, "w2"); print("second compiled run", round(time.perf_counter() - t, 1), r, calls, flush=True)
res = {"eager": [], "compiled": []}; outs = {}
for rnd in range(3):
    for name in (("eager", "compiled") if rnd % 2 == 0 else ("compiled", "eager")):
        r, o = run(name == "compiled", f"{name}{rnd}")
        res[name].append(r); outs[name] = o
        print(name, rnd, r, flush=True)
print("outputs equal:", all(outs["eager"][k] == outs["compiled"][k] for k in outs["eager"]), calls)
print(json.dumps(res))
