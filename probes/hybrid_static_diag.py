import sys, json, torch
import tests.test_hybrid_static as T
import specpilot.model.hybrid_static as HS
dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
torch.backends.cuda.matmul.allow_tf32 = False
model = T.load("qwen3_5", linear_key_head_dim=16, linear_value_head_dim=16).to(dev)
print("head_dim", model.args.head_dim, "n_heads", model.args.n_heads, "kv", model.args.n_kv_heads, flush=True)
P = T.P
res = {}
real_triton = HS._triton
for name, parents, bucket in (("chain", T.CHAIN, 8), ("tree", T.TREE, 8), ("padded", T.TREE, 12)):
    for kernels in (False, True):
        for tri in (False, True):
            HS._triton = real_triton if tri else None
            r, v = len(parents), model.args.vocab_size
            g = torch.Generator().manual_seed(r + bucket)
            prompt, toks = torch.randint(0, v, (P,), generator=g), torch.randint(0, v, (r,), generator=g)
            anc = T.ancestors(parents, bucket)
            pos = P + anc[:r, :r].sum(1) - 1
            with torch.inference_mode():
                e_c, s_c = T.prefilled(model, prompt.to(dev)), T.prefilled(model, prompt.to(dev))
                mask = torch.cat((torch.ones(r, P, dtype=torch.bool), anc[:r, :r]), 1).to(dev)
                eager = model.logits(model.forward(toks.to(dev), pos.to(dev), e_c, P, mask))
                tk, ps = torch.zeros(bucket, dtype=torch.long), torch.full((bucket,), P)
                tk[:r], ps[:r] = toks, pos
                s_c.gdn_kernels = kernels
                s_c.begin_pass(P, r, bucket)
                st = model.logits(model.forward_static(tk.to(dev), ps.to(dev), s_c, torch.tensor(P, device=dev), anc.to(dev)))
            d = (st[:r] - eager).abs().amax(-1)
            key = f"{name} gdn_kernels={kernels} triton_attn={tri}"
            res[key] = [round(float(x), 6) for x in d]
            print(key, res[key], "argmax equal", (st[:r].argmax(-1) == eager.argmax(-1)).tolist(), flush=True)
HS._triton = real_triton
if len(sys.argv) > 2:
    json.dump(res, open(sys.argv[2], "w"), indent=1)
if dev == "cuda":  # the GPU test's scenario: accepted counts of the eager and the graphed engine
    from specpilot.config import SystemConfig
    from specpilot.engine.engine import Engine
    from tests.conftest import random_prompts
    from tests.hybridutil import tree_config
    from tests.test_engine import ScriptedDrafter
    prompt = random_prompts(1, model.args.vocab_size, seed=7)[0]
    ar = Engine(model, SystemConfig.ar(), None, eos_ids=[]).generate(prompt, 24).tokens
    model.verify = "replay"
    for tree in ("chain", "best_first"):
        for buckets in (False, True):
            eng = Engine(model, tree_config(tree, 5), ScriptedDrafter(len(prompt), ar, "both", every=3), eos_ids=[],
                         buckets=buckets, max_len=128)
            gen = eng.generate(prompt, 24)
            print(tree, "buckets", buckets, "graphs", eng.runner.graphs if eng.runner else None, "equal AR",
                  gen.tokens == ar, "accepted", gen.accepted, flush=True)
