"""A hybrid target (qwen3_5 text model or qwen3_next): Gated DeltaNet layers interleaved with gated full attention
(§4.2). This file holds the layers and the eager reference pass; the row-bucket static pass (CUDA graphs, the GDN
path and commit kernels) is :mod:`specpilot.model.hybrid_static`, the batched pass :mod:`specpilot.model.hybrid_batch`.

Against the dense decoder of :mod:`specpilot.model.layers`: every RMSNorm but the GDN output norm is zero-centred
(``x̂ · (1 + w)``, computed in float32); full attention has per-head q/k norms, RoPE on the first
``head_dim · partial_rotary_factor`` dims only, and its output gated by ``sigmoid(gate)``, the gate a second half of
``q_proj``'s output per head; ``linear_attention`` layers are :class:`~specpilot.model.gdn.GatedDeltaNet`. The state
lives in a :class:`~specpilot.model.hybrid_cache.HybridCache`. A qwen3_next layer's MLP is a mixture of experts
(:class:`~specpilot.model.moe.SparseMoE`) unless its config keeps that layer dense; its checkpoint's grouped GDN
projections are split into qwen3_5's layout on loading (:func:`~specpilot.model.gdn.split_grouped_projections`), so
the token mixers are the same modules. Parameter names are Hugging Face's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specpilot.errors import SpecPilotError
from specpilot.model.args import ModelArgs
from specpilot.model.cache import PassKind
from specpilot.model.gdn import GatedDeltaNet, parents_from_mask
from specpilot.model.hybrid_cache import HybridCache
from specpilot.model.hybrid_pool import HybridPool
from specpilot.model.layers import MLP, apply_partial_rope, causal_mask, fused_linear, sdpa_backends
from specpilot.model.moe import SparseMoE
from specpilot.model.transformer import KernelConfig, Transformer


class ZeroCentredRMSNorm(nn.Module):
    """RMS norm with weight ``1 + w`` (stored ``w`` starts at 0), computed in float32, cast back at the end."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., dim]`` -> same shape and dtype."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedAttention(nn.Module):
    """Full attention of a hybrid model: GQA with q/k norms, partial RoPE and a sigmoid output gate."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        h, d, b = args.hidden_size, args.head_dim, args.attention_bias
        self.q_proj = nn.Linear(h, args.n_heads * d * 2, bias=b)
        self.k_proj = nn.Linear(h, args.n_kv_heads * d, bias=b)
        self.v_proj = nn.Linear(h, args.n_kv_heads * d, bias=b)
        self.o_proj = nn.Linear(args.n_heads * d, h, bias=b)
        self.q_norm = ZeroCentredRMSNorm(d, args.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(d, args.rms_norm_eps)
        self.args = args

    def fuse(self) -> None:
        """Replace q/k/v_proj by one ``qkv_proj`` (one GEMM instead of three). Idempotent."""
        if "qkv_proj" in self._modules:
            return
        self.qkv_proj = fused_linear([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def project(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, ...]:
        """The rows' ``q [R, heads, D]`` and ``k [R, kv_heads, D]`` (normed, partial RoPE), ``v [R, kv_heads, D]``
        and the output gate ``[R, heads, D]`` (before its sigmoid), from ``x [R, hidden]``; every pass (eager,
        static, batched) takes them from here."""
        a, r = self.args, x.shape[0]
        qd, kd = a.n_heads * a.head_dim * 2, a.n_kv_heads * a.head_dim
        if "qkv_proj" in self._modules:
            qg, k, v = self.qkv_proj(x).split([qd, kd, kd], dim=-1)
        else:
            qg, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, gate = qg.reshape(r, a.n_heads, 2 * a.head_dim).chunk(2, dim=-1)
        q = apply_partial_rope(self.q_norm(q), cos, sin)
        k = apply_partial_rope(self.k_norm(k.reshape(r, a.n_kv_heads, a.head_dim)), cos, sin)
        return q, k, v.reshape(r, a.n_kv_heads, a.head_dim), gate

    def forward(self, x, cos, sin, cache: HybridCache, slot: int, start: int, mask, kind: PassKind):
        """``x [R, hidden]`` at prefix ``start``; ``mask [R, start + R]`` bool or None (causal); ``slot`` this
        layer's index in the cache's K/V. ``EXACT`` writes K/V at ``[start, start + R)``. Returns ``[R, hidden]``."""
        a, r = self.args, x.shape[0]
        q, k, v, gate = self.project(x, cos, sin)
        if kind is PassKind.EXACT:
            cache.k[slot, start : start + r] = k
            cache.v[slot, start : start + r] = v
            keys, vals = cache.k[slot, : start + r], cache.v[slot, : start + r]
        else:
            keys, vals = torch.cat((cache.k[slot, :start], k)), torch.cat((cache.v[slot, :start], v))
        rep = a.n_heads // a.n_kv_heads
        keys = keys.transpose(0, 1)[None].repeat_interleave(rep, dim=1)
        vals = vals.transpose(0, 1)[None].repeat_interleave(rep, dim=1)
        if mask is None:
            mask = causal_mask(start, r, x.device)
        with sdpa_backends(x.device):
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, vals, attn_mask=mask)
        o = o[0].transpose(0, 1).reshape(r, a.n_heads * a.head_dim)
        return self.o_proj(o * torch.sigmoid(gate.reshape(r, -1)))


class HybridLayer(nn.Module):
    """Pre-norm decoder layer whose token mixer is GDN (``linear_attn``) or gated attention (``self_attn``).

    Args:
        args: the model's :class:`ModelArgs`; kind: ``linear_attention`` | ``full_attention``; slot: the layer's
            index among the layers of its kind (its place in the cache); index: the layer's index in the model
            (whether its MLP is a mixture of experts, :meth:`ModelArgs.is_moe_layer`).
    """

    def __init__(self, args: ModelArgs, kind: str, slot: int, index: int):
        super().__init__()
        self.kind, self.slot = kind, slot
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(args)
        else:
            self.self_attn = GatedAttention(args)
        self.mlp = SparseMoE(args) if args.is_moe_layer(index) else MLP(args)
        self.input_layernorm = ZeroCentredRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, cache: HybridCache, start: int, mask, parents: list[int], kind: PassKind,
                prof=None):
        """``x [R, hidden]`` -> ``[R, hidden]`` (see :meth:`HybridTransformer.forward`)."""
        h = self.input_layernorm(x)
        if self.kind == "linear_attention":
            exact = kind is PassKind.EXACT
            rec, keep = (cache.recorder(self.slot), cache.keep_rows(x.shape[0])) if exact else (None, ())
            h = self.linear_attn(h, cache.state[self.slot], cache.window[self.slot], parents, rec, keep)
        else:
            h = self.self_attn(h, cos, sin, cache, self.slot, start, mask, kind)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x), prof)


class HybridBackbone(nn.Module):
    """Embedding, hybrid decoder layers and final (zero-centred) norm (HF's ``model.*``)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        seen = {"linear_attention": 0, "full_attention": 0}
        layers = []
        for i, kind in enumerate(args.layer_types):
            layers.append(HybridLayer(args, kind, seen[kind], i))
            seen[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCentredRMSNorm(args.hidden_size, args.rms_norm_eps)


class HybridTransformer(Transformer):
    """A qwen3_5 text / qwen3_next target over a :class:`HybridCache`: the eager :meth:`forward`, the static
    :meth:`forward_static` (row buckets, CUDA graphs) and the batched :meth:`forward_prepared` over a ``HybridPool``.

    Verification mode (:attr:`verify`): ``snapshot`` (every row's GDN state kept by the pass: stock chain
    verification) or ``replay`` (only the last row's; commit replays the accepted path: trees without per-node
    snapshots). Either serves any tree; they differ in what the cache holds between pass and commit.
    """

    backbone_class = HybridBackbone

    def __init__(self, args: ModelArgs, verify: str = "snapshot"):
        super().__init__(args)
        self.kernels = KernelConfig(fused=False)  # no fused dense-layer kernels: the static pass has its own
        self.verify = verify

    def fused_on(self, x: torch.Tensor) -> bool:
        """Always False: the hybrid target has no fused kernels yet."""
        return False

    def fuse_projections(self) -> "HybridTransformer":
        """Fuse each GDN layer's four input projections, each attention layer's q/k/v and every SwiGLU MLP's
        gate/up (MoE experts and shared expert included) into one GEMM each. At the Qwen3.5-27B-like shape a pass
        ran ~500 GEMMs, 8 a GDN layer; fused, 4. Returns self."""
        for layer in self.model.layers:
            (layer.linear_attn if layer.kind == "linear_attention" else layer.self_attn).fuse()
            mlps = [*layer.mlp.experts, layer.mlp.shared_expert] if isinstance(layer.mlp, SparseMoE) else [layer.mlp]
            for mlp in mlps:
                mlp.fuse()
        return self

    def new_cache(self, max_len: int) -> HybridCache:
        """A zeroed :class:`HybridCache` of ``max_len`` K/V slots in the model's dtype and device."""
        return HybridCache(self.args, max_len, self.dtype, self.device, self.verify)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: HybridCache, start: int,
                mask: torch.Tensor | None = None, kind: PassKind = PassKind.EXACT, prof=None,
                features: list | None = None, feature_layers: tuple[int, ...] = ()) -> torch.Tensor:
        """Final-norm hidden states ``[R, hidden_size]`` of a set of rows: the eager reference pass.

        As :meth:`Transformer.forward`; in addition the rows' mask (None = causal) gives each row's root path
        through the GDN layers (its parent: the nearest ancestor row). A pass starts at the committed length (the
        GDN state is that of the committed tokens) and leaves the committed GDN state alone: an ``EXACT`` pass
        records what :meth:`HybridCache.commit` needs to move it.

        Raises:
            ValueError: the rows do not fit the cache, ``start`` is not an int or not the committed length.
        """
        if isinstance(start, torch.Tensor):
            raise ValueError("forward takes an int prefix length")
        r = tokens.shape[0]
        if start + r > cache.max_len:
            raise ValueError(f"{start + r} slots needed, cache holds {cache.max_len}")
        if start != cache.length:  # the GDN layers hold the state after exactly the committed tokens
            raise ValueError(f"a hybrid pass must start at the committed length {cache.length}, got {start}")
        if kind is PassKind.EXACT:
            cache.begin_pass(start, r)
        parents = parents_from_mask(mask, start, r)
        x, cos, sin = self._embed(tokens, positions, prof)
        return self._layers(x, lambda i, layer, h: layer(h, cos, sin, cache, start, mask, parents, kind, prof),
                            prof, features, feature_layers)

    def forward_static(self, tokens, positions, cache, start, tree_mask, prof=None, features=None,
                       feature_layers=()):
        """The static (CUDA-graph capturable) exact pass: :func:`specpilot.model.hybrid_static.forward_static`."""
        from specpilot.model.hybrid_static import forward_static

        return forward_static(self, tokens, positions, cache, start, tree_mask, prof, features, feature_layers)

    def new_pool(self, num_slots: int, slot_len: int) -> HybridPool:
        """A zeroed :class:`~specpilot.model.hybrid_pool.HybridPool` (K/V, GDN states and conv windows per slot) in
        the model's dtype and device, its caches in the model's :attr:`verify` mode."""
        return HybridPool(self.args, num_slots, slot_len, self.dtype, self.device, self.verify)

    def forward_prepared(self, tokens, positions, pool: HybridPool, p, kernel: bool, prof=None, features=None,
                         feature_layers: tuple[int, ...] = ()) -> torch.Tensor:
        """The eager batched exact pass over a :class:`HybridPool`
        (:func:`specpilot.model.hybrid_batch.forward_prepared`; ``kernel`` must be False). Returns ``[R, hidden]``."""
        from specpilot.model.hybrid_batch import forward_prepared  # it imports this module

        return forward_prepared(self, tokens, positions, pool, p, kernel, prof, features, feature_layers)
