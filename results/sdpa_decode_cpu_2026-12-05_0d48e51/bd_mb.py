import torch, time
import torch.nn.functional as F
torch.set_num_threads(2)
torch.manual_seed(0)
S, L, P, KVH, D, H = 33, 30, 1025, 3, 64, 9
k = torch.randn(S, L, P, KVH, D); v = torch.randn(S, L, P, KVH, D)
import sys
B, span = int(sys.argv[1]), int(sys.argv[2])
g = H // KVH
lens = torch.randint(span - 70, span, (B,)); lens[0] = span
q = torch.randn(B, H, D)  # one row per request
mask = (torch.arange(span)[None, :] < lens[:, None])  # [B, span]
bmask = mask[:, None, None, :].expand(B, 1, g, span)
addm = torch.zeros(B, span, 1).masked_fill(~mask[:, :, None], float("-inf"))  # [B, span, 1]
sel = torch.arange(H) // g  # kv head of each query head
def sdpa(layer):
    keys, vals = k[0:B, layer, :span].transpose(1, 2), v[0:B, layer, :span].transpose(1, 2)
    qg = q.reshape(B, KVH, g, D)
    return F.scaled_dot_product_attention(qg, keys, vals, attn_mask=bmask).reshape(B, H, D)
# block-diagonal: Qbd [B, KVH*D, H]: query head h's vector at rows of its kv head
def bd(layer):
    keys = k[0:B, layer, :span].reshape(B, span, KVH * D)   # a view: rows contiguous
    vals = v[0:B, layer, :span].reshape(B, span, KVH * D)
    qbd = q.new_zeros(B, H, KVH, D)
    qbd[:, torch.arange(H), sel] = q * D ** -0.5   # [B, H, D] placed
    s = torch.bmm(keys, qbd.reshape(B, H, KVH * D).transpose(1, 2))   # [B, span, H]
    s = s + addm
    p = torch.softmax(s, dim=1)
    o = torch.bmm(p.transpose(1, 2), vals)             # [B, H, KVH*D]
    return o.reshape(B, H, KVH, D)[:, torch.arange(H), sel]   # [B, H, D]
a, b = sdpa(3), bd(3)
print("max diff", (a - b).abs().max().item())
def bench(f, n=30):
    for l in range(L): f(l)
    t = time.perf_counter()
    for _ in range(n):
        for l in range(L): f(l)
    return (time.perf_counter() - t) / n / L * 1e6
for _ in range(3):
    print(B, span, "sdpa us", round(bench(sdpa), 1), "bd us", round(bench(bd), 1), flush=True)
