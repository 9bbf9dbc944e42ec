import torch, time
import torch.nn.functional as F
torch.set_num_threads(2)
torch.manual_seed(0)
S, L, P, KVH, D, H = 33, 30, 1025, 3, 64, 9
k = torch.randn(S, L, P, KVH, D); v = torch.randn(S, L, P, KVH, D)
B, span = 8, 220
lens = torch.randint(150, span, (B,)); lens[0] = span
g = H // KVH
q = torch.randn(B, KVH, g, D)
mask = (torch.arange(span)[None, :] < lens[:, None])  # [B, span]
bmask = mask[:, None, None, :].expand(B, 1, g, span)
fmask = torch.zeros(B, 1, g, span).masked_fill(~bmask, float("-inf"))
def run(layer, m):
    keys, vals = k[0:B, layer, :span].transpose(1, 2), v[0:B, layer, :span].transpose(1, 2)
    return F.scaled_dot_product_attention(q, keys, vals, attn_mask=m)
def run_c(layer, m):
    keys, vals = k[0:B, layer, :span].transpose(1, 2).contiguous(), v[0:B, layer, :span].transpose(1, 2).contiguous()
    return F.scaled_dot_product_attention(q, keys, vals, attn_mask=m)
def run_mm(layer, m):
    keys, vals = k[0:B, layer, :span].transpose(1, 2), v[0:B, layer, :span].transpose(1, 2)
    s = (q @ keys.transpose(-1, -2)) * D ** -0.5 + m
    return torch.softmax(s, -1) @ vals
def bench(f, m, n=40):
    for l in range(L): f(l, m)
    t = time.perf_counter()
    for _ in range(n):
        for l in range(L): f(l, m)
    return (time.perf_counter() - t) / n / L * 1e6
a, b = run(3, bmask), run(3, fmask)
print("bool vs float mask equal:", torch.equal(a, b), (a - b).abs().max().item())
for _ in range(2):
    print("bool us", round(bench(run, bmask), 1), "float us", round(bench(run, fmask), 1), "contig+float", round(bench(run_c, fmask), 1), "matmul", round(bench(run_mm, fmask), 1))
