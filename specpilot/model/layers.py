"""The decoder's layers in plain PyTorch: RMSNorm, RoPE, grouped-query attention over the static cache, SwiGLU.

Parameter names follow Hugging Face's so a checkpoint's state dict loads as it is. Each layer has two paths:

- ``forward`` (the eager reference): any rows at an int prefix ``start`` with an explicit mask
  ``[R, start + R]``, masked SDPA over the cache; a pass of kind ``EXACT`` writes its rows' K/V at
  ``[start, start + R)``, one of kind ``INSPECT`` writes nothing (:class:`~specpilot.model.cache.PassKind`);
- ``forward_static`` (CUDA graphs): shapes depend on the row count only, ``start`` is a 0-d device tensor and
  the mask the ``[R, R]`` tree mask among the rows; tree attention reads only the committed slots
  (:mod:`specpilot.kernels.tree_attention`).

The fused Triton path of a whole layer is in :mod:`specpilot.model.fused`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from specpilot.model.args import ModelArgs
from specpilot.model.batch import Prepared
from specpilot.model.cache import KVCache, KVPool, PassKind


def region(prof, name: str):
    """Profiling region ``name`` of a step (a no-op context when ``prof`` is None; the cost model, §3.2)."""
    return prof.region(name) if prof is not None else contextlib.nullcontext()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [R, H, D]`` by ``cos, sin [R, D]`` (HF's rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    rot = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``rot`` dims of ``x [R, H, D]`` by ``cos, sin [R, rot]`` (rotate-half); the rest pass (a hybrid's
    partial RoPE: ``head_dim · partial_rotary_factor`` dims)."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    x1, x2 = xr.chunk(2, dim=-1)
    xr = xr * cos[:, None, :] + torch.cat((-x2, x1), dim=-1) * sin[:, None, :]
    return torch.cat((xr, xp), dim=-1)


def causal_mask(start: int, r: int, device) -> torch.Tensor:
    """``[r, start + r]`` bool: row i sees slots ``[0, start + i]`` (prefill / chain rows)."""
    cols = torch.arange(start + r, device=device)
    rows = torch.arange(r, device=device) + start
    return cols[None, :] <= rows[:, None]


def sdpa_backends(device: torch.device):
    """SDPA backends for every attention whose key length changes from call to call (the target's eager prefill
    and fallback, the block / EAGLE-3 drafters' context attention, the hybrid's attention layers): on CUDA,
    memory-efficient attention or the math kernel, not cuDNN, which builds a plan per new sequence length (a
    fresh prompt length paid ~85 ms on its first request; a calibrated block drafter recorded along AR outputs,
    whose context grows by one each call, timed 163 ms per propose against 6.5 ms once the lengths were seen,
    H200). A no-op context on the CPU."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def grouped_sdpa(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked grouped-query attention without copying K/V per query head: ``q [B, R, H, D]``, ``keys, vals
    [B, S, KVH, D]``, ``mask [B, R, S]`` bool (True = may attend) -> ``[B, R, H, D]``. The ``H / KVH`` query heads
    of one KV head ride as extra rows of one SDPA (the mask repeated for them), so keys are not
    ``repeat_interleave`` d to ``[B, H, S, D]``: on the CPU that copy and its reads cost as much as the attention
    (float32 SmolLM2, 32 requests, 1 thread: 555 -> 341 ms of CPU per decode step, docs/peer-vllm-cpu.md).
    The same math as repeating the keys (query head ``h`` reads KV head ``h // (H / KVH)``); tested against it
    and the batched-attention reference (``tests/test_grouped_sdpa.py``)."""
    b, r, h, d = q.shape
    kvh = keys.shape[2]
    g = h // kvh
    qg = q.reshape(b, r, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * r, d)
    m = mask[:, None, None].expand(b, 1, g, r, mask.shape[-1]).reshape(b, 1, g * r, mask.shape[-1])
    with sdpa_backends(q.device):
        o = F.scaled_dot_product_attention(qg, keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=m)
    return o.reshape(b, kvh, g, r, d).permute(0, 3, 1, 2, 4).reshape(b, r, h, d)


def batch_sdpa(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, p: Prepared) -> torch.Tensor:
    """:func:`grouped_sdpa` on a batched pass's packed rows: ``q [R, H, D]`` (request 0's rows, then request 1's,
    ...), ``keys, vals [B, span, KVH, D]`` gathered per request, or ``[W, span, KVH, D]``, the pool's slots
    ``[lo, lo + W)`` of ``p.window = (lo, W)`` -> ``[R, H, D]``, through :func:`padded_attention`. The SDPA sees the
    same inputs as :func:`grouped_sdpa` on the padded rows, so the outputs are equal bit for bit
    (``tests/test_grouped_sdpa.py``)."""

    def sdpa(qg, mask):
        with sdpa_backends(q.device):
            return F.scaled_dot_product_attention(qg, keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=mask)

    return padded_attention(q, p, keys.shape[0], keys.shape[2], sdpa)


def padded_attention(q: torch.Tensor, p: Prepared, b: int, kvh: int, attend) -> torch.Tensor:
    """A batched pass's packed rows ``q [R, H, D]`` through ``attend(qg [b, KVH, G * r_max, D], mask [b, 1, G * r_max,
    span] bool) -> [b, KVH, G * r_max, D]``, the attention of each request's (padded) rows grouped per KV head (G =
    H / KVH query heads a KV head), ``b`` requests at their SDPA batch index (:attr:`Prepared.window`) -> ``[R, H, D]``.
    The rows go to their padded places by one ``index_copy_`` over ``p.flat`` (a reshape when ``p.dense``, as in an AR
    step over consecutive slots) and come back by one ``index_select``; the grouped mask is built once per pass
    (:meth:`~specpilot.model.batch.Prepared.grouped_mask`)."""
    (_, h, d), rm = q.shape, p.r_max
    g = h // kvh
    qp = q if p.dense else q.new_zeros(b * rm, h, d).index_copy_(0, p.flat, q)
    qg = qp.reshape(b, rm, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * rm, d)
    o = attend(qg, p.grouped_mask(g))
    o = o.reshape(b, kvh, g, rm, d).permute(0, 3, 1, 2, 4).reshape(b * rm, h, d)
    return o if p.dense else o.index_select(0, p.flat)


class RMSNorm(nn.Module):
    """RMS norm computed in float32, cast back to the input dtype (HF's LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., dim]`` -> same shape and dtype."""
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` whose weight (and bias) are ``parts``' concatenated on the output dim."""
    p0 = parts[0]
    with torch.device("meta"):  # no initialisation: it would only be overwritten (and draw from torch's RNG)
        fused = nn.Linear(p0.in_features, sum(p.out_features for p in parts), bias=p0.bias is not None)
    fused = fused.to_empty(device=p0.weight.device).to(p0.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused.requires_grad_(False)


class Attention(nn.Module):
    """Grouped-query attention with RoPE (and Qwen3's per-head q/k RMS norm) over the static cache."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        h, d = args.hidden_size, args.head_dim
        b = args.attention_bias
        self.q_proj = nn.Linear(h, args.n_heads * d, bias=b)
        self.k_proj = nn.Linear(h, args.n_kv_heads * d, bias=b)
        self.v_proj = nn.Linear(h, args.n_kv_heads * d, bias=b)
        self.o_proj = nn.Linear(args.n_heads * d, h, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(d, args.rms_norm_eps)
            self.k_norm = RMSNorm(d, args.rms_norm_eps)
        self.args = args

    def fuse(self) -> None:
        """Replace q/k/v_proj by one ``qkv_proj`` (weights concatenated on the output dim): one GEMM instead
        of three, same results up to GEMM blocking. Idempotent."""
        if hasattr(self, "qkv_proj"):
            return
        parts = [self.q_proj, self.k_proj, self.v_proj]
        self.qkv_split = [p.out_features for p in parts]
        self.qkv_proj = fused_linear(parts)
        del self.q_proj, self.k_proj, self.v_proj

    def _qkv(self, x, cos, sin, prof):
        """Projections, Qwen3's q/k norm and RoPE: ``q [R, H, D]``, ``k, v [R, KVH, D]`` (q and k may be views of
        one rotated tensor: last dim contiguous, rows strided)."""
        a, r = self.args, x.shape[0]
        if hasattr(self, "qkv_proj") and not a.qk_norm:
            return self._qkv_fused(x, cos, sin, prof)
        with region(prof, "projections"):
            if hasattr(self, "qkv_proj"):
                q, k, v = self.qkv_proj(x).split(self.qkv_split, dim=-1)
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q = q.reshape(r, a.n_heads, a.head_dim)
            k = k.reshape(r, a.n_kv_heads, a.head_dim)
            v = v.reshape(r, a.n_kv_heads, a.head_dim)
        with region(prof, "norms_elementwise"):
            if a.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _qkv_fused(self, x, cos, sin, prof):
        """:meth:`_qkv` for the fused projection without q/k norm: q's and k's heads sit side by side in its output,
        so RoPE rotates ``[R, H + KVH, D]`` at once (the same elementwise ops as rotating q and k apart, half the
        calls: on the CPU each small op costs its dispatch)."""
        a, r = self.args, x.shape[0]
        nq = a.n_heads + a.n_kv_heads
        with region(prof, "projections"):
            qkv = self.qkv_proj(x)
        with region(prof, "norms_elementwise"):
            qk = apply_rope(qkv[:, : nq * a.head_dim].reshape(r, nq, a.head_dim), cos, sin)
        v = qkv[:, nq * a.head_dim:].reshape(r, a.n_kv_heads, a.head_dim)
        return qk[:, : a.n_heads], qk[:, a.n_heads:], v

    def forward(self, x, cos, sin, cache: KVCache, layer: int, start: int, mask, kind: PassKind, prof=None):
        """Eager path: ``x [R, hidden]`` at prefix ``start`` (int); ``mask [R, start + R]`` bool (True = may
        attend) or None for causal rows. ``EXACT`` writes this layer's K/V at slots ``[start, start + R)``;
        ``INSPECT`` reads the cache prefix and keeps the rows' K/V in a temporary. Returns ``[R, hidden]``."""
        a, r = self.args, x.shape[0]
        q, k, v = self._qkv(x, cos, sin, prof)
        with region(prof, "attention"):
            if kind is PassKind.EXACT:
                cache.k[layer, start : start + r] = k
                cache.v[layer, start : start + r] = v
                keys, vals = cache.k[layer, : start + r], cache.v[layer, : start + r]
            else:
                keys = torch.cat((cache.k[layer, :start], k.to(cache.k.dtype)))
                vals = torch.cat((cache.v[layer, :start], v.to(cache.v.dtype)))
            keys, vals = keys.transpose(0, 1)[None], vals.transpose(0, 1)[None]  # [1, KVH, S, D]
            rep = a.n_heads // a.n_kv_heads
            if rep > 1:
                keys = keys.repeat_interleave(rep, dim=1)
                vals = vals.repeat_interleave(rep, dim=1)
            if mask is None:
                mask = causal_mask(start, r, x.device)
            with sdpa_backends(x.device):
                o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, vals, attn_mask=mask)
            o = o[0].transpose(0, 1).reshape(r, a.n_heads * a.head_dim)
        with region(prof, "projections"):
            return self.o_proj(o)

    def forward_static(self, x, cos, sin, cache: KVCache, layer: int, start: torch.Tensor, tree_mask, prof=None):
        """Static path (CUDA graphs): ``start`` a 0-d long device tensor, ``tree_mask [R, R]`` bool among the
        rows (every row sees the whole prefix). K/V written by ``index_copy_`` at ``start + arange(R)``; no host
        sync. Returns ``[R, hidden]``."""
        from specpilot.kernels.tree_attention import attention

        a, r = self.args, x.shape[0]
        q, k, v = self._qkv(x, cos, sin, prof)
        with region(prof, "attention"):
            slots = start + torch.arange(r, device=q.device)
            cache.k[layer].index_copy_(0, slots, k)
            cache.v[layer].index_copy_(0, slots, v)
            o = attention(q, cache.k[layer], cache.v[layer], start, tree_mask, a.head_dim**-0.5)
            o = o.reshape(r, a.n_heads * a.head_dim)
        with region(prof, "projections"):
            return self.o_proj(o)


    def forward_batch(self, x, cos, sin, pool: KVPool, layer: int, p: Prepared, prof=None, kernel: bool = False):
        """Batched exact pass (:mod:`specpilot.model.batch`): ``x [R, hidden]`` rows of several requests; each row's
        K/V is written to its request's pool slot, then every request's rows attend to that slot's committed
        prefix and, among its own rows, to what its mask allows: rows padded to ``[B, R_max]``, keys gathered to
        ``[B, span]``, one masked SDPA with the query heads grouped per KV head (:func:`batch_sdpa`); with
        ``kernel`` the Triton batched tree attention (:mod:`specpilot.kernels.batch_attention`). Returns
        ``[R, hidden]``."""
        a = self.args
        q, k, v = self._qkv(x, cos, sin, prof)
        with region(prof, "attention"):
            pool.k[p.slot, layer, p.pos] = k.to(pool.k.dtype)
            pool.v[p.slot, layer, p.pos] = v.to(pool.v.dtype)
            if kernel:
                from specpilot.kernels.batch_attention import batch_tree_attention

                o = batch_tree_attention(q.to(pool.k.dtype), pool.k[:, layer], pool.v[:, layer], p.slots, p.starts,
                                         p.counts, p.row_off, p.words, p.r_max, a.head_dim**-0.5)
                with region(prof, "projections"):
                    return self.o_proj(o.reshape(x.shape[0], a.n_heads * a.head_dim).to(x.dtype))
            if p.window is not None:  # the requests' slots in a short range: a view of the pool, nothing copied
                w = slice(p.window[0], p.window[0] + p.window[1])
                keys, vals = pool.k[w, layer, : p.span], pool.v[w, layer, : p.span]  # [W, span, KVH, D]
            else:
                keys = pool.k[:, layer, : p.span].index_select(0, p.slots)
                vals = pool.v[:, layer, : p.span].index_select(0, p.slots)
            o = batch_sdpa(q, keys, vals, p).reshape(x.shape[0], a.n_heads * a.head_dim)
        with region(prof, "projections"):
            return self.o_proj(o)


class MLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``, of width ``intermediate_size`` (default the config's; an expert
    of a mixture of experts passes its own, :mod:`specpilot.model.moe`)."""

    def __init__(self, args: ModelArgs, intermediate_size: int | None = None):
        super().__init__()
        h, b = args.hidden_size, args.mlp_bias
        i = args.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)

    def fuse(self) -> None:
        """Replace gate/up_proj by one ``gate_up_proj`` (one GEMM instead of two). Idempotent."""
        if hasattr(self, "gate_up_proj"):
            return
        self.gate_up_proj = fused_linear([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x, prof=None):
        """``x [R, hidden]`` -> ``[R, hidden]``."""
        with region(prof, "projections"):
            if hasattr(self, "gate_up_proj"):
                g, u = self.gate_up_proj(x).chunk(2, dim=-1)
            else:
                g, u = self.gate_proj(x), self.up_proj(x)
        with region(prof, "norms_elementwise"):
            y = F.silu(g) * u
        with region(prof, "projections"):
            return self.down_proj(y)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: attention and MLP, each with a residual."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, cache, layer, start: int, mask, kind: PassKind, prof=None):
        """Eager path (see :meth:`Attention.forward`): ``x [R, hidden]`` -> ``[R, hidden]``."""
        return self._residual(x, lambda h: self.self_attn(h, cos, sin, cache, layer, start, mask, kind, prof), prof)

    def forward_static(self, x, cos, sin, cache, layer, start: torch.Tensor, tree_mask, prof=None):
        """Static path (see :meth:`Attention.forward_static`): ``x [R, hidden]`` -> ``[R, hidden]``."""
        return self._residual(
            x, lambda h: self.self_attn.forward_static(h, cos, sin, cache, layer, start, tree_mask, prof), prof)

    def forward_batch(self, x, cos, sin, pool, layer, p, prof=None, kernel: bool = False):
        """Batched exact pass (see :meth:`Attention.forward_batch`): ``x [R, hidden]`` -> ``[R, hidden]``."""
        return self._residual(
            x, lambda h: self.self_attn.forward_batch(h, cos, sin, pool, layer, p, prof, kernel), prof)

    def _residual(self, x, attend, prof):
        """The pre-norm layer around ``attend(normed x)`` (one of the attention paths): two residual adds."""
        with region(prof, "norms_elementwise"):
            h = self.input_layernorm(x)
        x = x + attend(h)
        with region(prof, "norms_elementwise"):
            h = self.post_attention_layernorm(x)
        return x + self.mlp(h, prof)


class Backbone(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.*``)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
