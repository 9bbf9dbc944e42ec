"""The target (and draft) model: a dense decoder (llama / qwen2 / qwen3) in plain PyTorch.

One pass takes any set of rows: token ids ``[R]``, explicit position ids ``[R]`` and an attention mask
``[R, start + R]`` over the committed cache plus the rows themselves, so the same call serves prefill
(causal mask), AR decode (one row) and tree verification (ancestor mask, positions prefix_len + depth;
§1.1, §4.2). Parameter names follow Hugging Face's so a checkpoint's state dict loads as it is.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass
class ModelArgs:
    """Architecture of a dense decoder, read from a Hugging Face ``config.json``.

    Raises:
        KeyError: when a required field is missing (the loader turns it into a CheckpointError).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelArgs":
        """Build from a parsed ``config.json`` dict (transformers 4.x or 5.x field names)."""
        mt = cfg["model_type"]
        n_heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or {})
        legacy = cfg.get("rope_scaling") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = {**legacy, **rope}
        if scaling.get("rope_type", scaling.get("type", "default")) in ("default", None):
            scaling = None
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            model_type=mt,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=True if mt == "qwen2" else bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=(mt == "qwen3"),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            eos_token_ids=eos_ids,
        )


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse RoPE frequencies ``[head_dim // 2]`` float32, with llama3 scaling when configured.

    Implements the ``default`` and ``llama3`` rope types of Hugging Face transformers.

    Raises:
        ValueError: for a rope type other than default / llama3.
    """
    d = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = args.rope_scaling
    if sc is None:
        return inv.float()
    kind = sc.get("rope_type", sc.get("type"))
    if kind != "llama3":
        raise ValueError(f"unsupported rope type {kind!r} (supported: default, llama3)")
    factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old = sc["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    lo_wl, hi_wl = old / lo, old / hi
    scaled = torch.where(wavelen > lo_wl, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= hi_wl) & (wavelen <= lo_wl)
    return torch.where(is_mid, mid, scaled).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [R, H, D]`` by ``cos, sin [R, D]`` (HF's rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    rot = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


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


class KVCache:
    """Static KV cache of one request: ``k, v [num_layers, max_len, n_kv_heads, head_dim]``.

    Slot ``i`` holds the keys/values of the token at position ``i`` of the committed sequence. The engine
    keeps ``length`` = number of valid slots; rows of a pass are written at ``[start, start + R)``.
    """

    def __init__(self, args: ModelArgs, max_len: int, dtype: torch.dtype, device: torch.device | str):
        shape = (args.num_layers, max_len, args.n_kv_heads, args.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0

    def nbytes(self) -> int:
        """Bytes held by the cache tensors."""
        return self.k.numel() * self.k.element_size() * 2

    def keep_path(self, start: int, rows: torch.Tensor) -> None:
        """Compact an accepted path: copy the slots ``start + rows[j]`` to ``start + j``.

        Args:
            start: first slot of the verified rows (the root's slot).
            rows: ``[k] long``, increasing row indices of the accepted path (root = row 0 first).
        Sets ``length = start + k``; everything after it is garbage and never read (§1.1, R8).
        """
        k = rows.numel()
        src = rows.to(self.k.device) + start
        self.k[:, start : start + k] = self.k[:, src]
        self.v[:, start : start + k] = self.v[:, src]
        self.length = start + k


def _sdpa_backends(device: torch.device):
    """SDPA backends for the dynamic path (prefill, eager fallback): on CUDA, memory-efficient attention or
    the math kernel, not cuDNN, which builds a plan per new sequence length (a fresh prompt length would pay
    it on its first request). A no-op context on the CPU."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def region(prof, name: str):
    """Profiling region ``name`` of a step (a no-op context when ``prof`` is None)."""
    return prof.region(name) if prof is not None else contextlib.nullcontext()


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

    def forward(self, x, cos, sin, cache: KVCache, layer: int, start, mask, prof=None):
        """``x [R, hidden]``; writes this layer's K/V at slots ``[start, start+R)``; returns ``[R, hidden]``.

        Dynamic path (``start`` an int): ``mask`` is ``[R, start + R]`` bool (True = may attend) or None for
        causal rows; masked SDPA over ``cache[:start + R]``. Static path (``start`` a 0-d long tensor, for
        CUDA graphs): ``mask`` is the ``[R, R]`` tree mask among the rows; every row sees the whole prefix;
        tree attention reads only the valid slots (:mod:`specpilot.kernels.tree_attention`).
        """
        a = self.args
        r = x.shape[0]
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
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(start, torch.Tensor):
            return self._static_attention(q, k, v, cache, layer, start, mask, prof)
        with region(prof, "attention"):
            cache.k[layer, start : start + r] = k
            cache.v[layer, start : start + r] = v
            keys = cache.k[layer, : start + r].transpose(0, 1)[None]  # [1, KVH, S, D]
            vals = cache.v[layer, : start + r].transpose(0, 1)[None]
            rep = a.n_heads // a.n_kv_heads
            if rep > 1:
                keys = keys.repeat_interleave(rep, dim=1)
                vals = vals.repeat_interleave(rep, dim=1)
            if mask is None:
                mask = causal_mask(start, r, x.device)
            with _sdpa_backends(x.device):
                o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, vals, attn_mask=mask)
            o = o[0].transpose(0, 1).reshape(r, a.n_heads * a.head_dim)
        with region(prof, "projections"):
            return self.o_proj(o)


    def fuse(self) -> None:
        """Replace q/k/v_proj by one ``qkv_proj`` (weights concatenated on the output dim): one GEMM instead
        of three, same results up to GEMM blocking. Idempotent."""
        if hasattr(self, "qkv_proj"):
            return
        parts = (self.q_proj, self.k_proj, self.v_proj)
        fused = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=parts[0].bias is not None)
        fused = fused.to(device=parts[0].weight.device, dtype=parts[0].weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([p.weight for p in parts]))
            if fused.bias is not None:
                fused.bias.copy_(torch.cat([p.bias for p in parts]))
        self.qkv_split = [p.out_features for p in parts]
        self.qkv_proj = fused.requires_grad_(False)
        del self.q_proj, self.k_proj, self.v_proj

    def _static_attention(self, q, k, v, cache, layer, start, tree_mask, prof):
        """Static-shape attention: K/V written by ``index_copy_`` at ``start + arange(R)``; no host sync."""
        from specpilot.kernels.tree_attention import attention

        a, r = self.args, q.shape[0]
        with region(prof, "attention"):
            slots = start + torch.arange(r, device=q.device)
            cache.k[layer].index_copy_(0, slots, k)
            cache.v[layer].index_copy_(0, slots, v)
            o = attention(q, cache.k[layer], cache.v[layer], start, tree_mask, a.head_dim**-0.5)
            o = o.reshape(r, a.n_heads * a.head_dim)
        with region(prof, "projections"):
            return self.o_proj(o)


class MLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        h, i, b = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)

    def fuse(self) -> None:
        """Replace gate/up_proj by one ``gate_up_proj`` (one GEMM instead of two). Idempotent."""
        if hasattr(self, "gate_up_proj"):
            return
        g, u = self.gate_proj, self.up_proj
        fused = nn.Linear(g.in_features, 2 * g.out_features, bias=g.bias is not None)
        fused = fused.to(device=g.weight.device, dtype=g.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([g.weight, u.weight]))
            if fused.bias is not None:
                fused.bias.copy_(torch.cat([g.bias, u.bias]))
        self.gate_up_proj = fused.requires_grad_(False)
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

    def forward(self, x, cos, sin, cache, layer, start, mask, prof=None):
        """``x [R, hidden]`` -> ``[R, hidden]``."""
        with region(prof, "norms_elementwise"):
            h = self.input_layernorm(x)
        x = x + self.self_attn(h, cos, sin, cache, layer, start, mask, prof)
        with region(prof, "norms_elementwise"):
            h = self.post_attention_layernorm(x)
        return x + self.mlp(h, prof)


    def forward_fused(self, x, delta, cos, sin, cache, layer, start, tree_words, linear, fuse_swiglu=False, sq=None,
                      fuse_norm=False, next_norm=None):
        """Static path with fused kernels (CUDA; the Triton interpreter in tests), issue 4.

        The residual add is deferred into the next norm: takes the residual stream ``x [R, hidden]`` and
        the previous layer's pending output ``delta`` (None for the first layer) and returns
        ``(x, delta, sq)`` with this layer's MLP output pending. ``start`` is the 0-d long prefix length,
        ``tree_words`` the packed ``[R, ceil(R/32)]`` int32 tree mask, ``linear(x, nn.Linear)`` the projection
        (:func:`~specpilot.kernels.gemm.cublas_linear` or :func:`~specpilot.kernels.gemm.linear`). Same math as :meth:`forward` up to
        rounding (see :mod:`specpilot.kernels.fused`). 8 launches per layer (+1 split-KV combine). ``fuse_swiglu``:
        where :func:`~specpilot.w12.swiglu.swiglu_fusable` holds (one row, a W12 down projection), the down
        projection computes ``silu(gate) · up`` in its load (one launch fewer, the same bits).

        ``fuse_norm`` (one row, W12 projections routed to the one-row GEMV; :mod:`specpilot.w12.norm`): the o
        projection adds the residual and the gate_up projection normalises in its load (no ``add_rmsnorm``); with
        ``next_norm = (qkv_proj, input_layernorm)`` of the next layer the down projection adds the residual too and
        returns ``(x, None, sq)``: ``x`` the residual stream with this layer's output added, ``sq`` its float32 tile
        sums of squares, which the next layer (given ``sq``, ``delta`` None) normalises in its qkv projection's load.
        """
        from specpilot.kernels import fused
        from specpilot.w12 import norm as w12_norm, swiglu as w12_swiglu
        from specpilot.kernels.tree_attention import tree_attention

        attn, a = self.self_attn, self.self_attn.args
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        if sq is not None:
            qkv = w12_norm.w12_norm_in(x, sq, ln1.weight, ln1.eps, attn.qkv_proj)
        else:
            h, x = fused.add_rmsnorm(x, delta, ln1.weight, ln1.eps)
            qkv = linear(h, attn.qkv_proj)
        qn = (attn.q_norm.weight, attn.k_norm.weight) if a.qk_norm else (None, None)
        q = fused.qk_norm_rope_store(qkv, *qn, cos, sin, cache.k[layer], cache.v[layer], start, a.n_heads,
                                     a.n_kv_heads, a.rms_norm_eps)
        o = tree_attention(q, cache.k[layer], cache.v[layer], start, tree_words, a.head_dim**-0.5)
        o = o.reshape(x.shape[0], a.n_heads * a.head_dim)
        gate_up_proj, down = self.mlp.gate_up_proj, self.mlp.down_proj
        if (fuse_norm and w12_norm.add_fusable(o, attn.o_proj, x)
                and w12_norm.norm_fusable(x, gate_up_proj, ln2.weight)):
            x, sq = w12_norm.w12_add_residual(o, attn.o_proj, x)
            gate_up = w12_norm.w12_norm_in(x, sq, ln2.weight, ln2.eps, gate_up_proj)
        else:
            h, x = fused.add_rmsnorm(x, linear(o, attn.o_proj), ln2.weight, ln2.eps)
            gate_up = linear(h, gate_up_proj)
        glu = fuse_swiglu and w12_swiglu.swiglu_fusable(gate_up, down)
        act = gate_up if glu else fused.silu_mul(gate_up)
        if (fuse_norm and next_norm is not None and w12_norm.add_fusable(act, down, x, glu)
                and w12_norm.norm_fusable(x, next_norm[0], next_norm[1].weight)):
            x, sq = w12_norm.w12_add_residual(act, down, x, glu)
            return x, None, sq
        return x, w12_swiglu.w12_swiglu_down(act, down) if glu else linear(act, down), None


class Backbone(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.*``)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


def causal_mask(start: int, r: int, device) -> torch.Tensor:
    """``[r, start + r]`` bool: row i sees slots ``[0, start + i]`` (prefill / chain rows)."""
    cols = torch.arange(start + r, device=device)
    rows = torch.arange(r, device=device) + start
    return cols[None, :] <= rows[:, None]


class Transformer(nn.Module):
    """A dense llama / qwen2 / qwen3 decoder with a static KV cache.

    Use :meth:`forward` for the hidden states of any set of rows and :meth:`logits` for the LM head.
    Built by :func:`specpilot.model.checkpoint.load_model`.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # float32 on purpose and not a buffer, so ``.to(bfloat16)`` leaves it exact
        self.inv_freq = rope_inv_freq(args)
        #: fused Triton kernels on the static path: None = on CUDA when triton is installed; True / False
        #: force it (tests run it on the CPU in the Triton interpreter). Needs fused projections.
        self.use_kernels: bool | None = None
        #: projections of the fused path through :func:`specpilot.kernels.gemm.linear` (the skinny Triton
        #: GEMM for 1-64 rows) instead of cuBLAS. Off: on the H200 cuBLAS is as fast or faster for bf16
        #: (``results/kernels_probe_*.json``); the kernel is the base of the W12 GEMM (issue 5).
        self.skinny_gemm = False
        #: fused path, one row: a W12 down projection computes ``silu(gate) · up`` in its activation load
        #: (:mod:`specpilot.w12.swiglu`; the same bits, one launch a layer fewer). False: silu_mul, then down.
        self.fuse_swiglu = True
        #: fused path, one row, W12 projections on the one-row GEMV: the residual add and RMSNorm split across the
        #: GEMVs around them (:mod:`specpilot.w12.norm`; no ``add_rmsnorm`` launches but the first and the
        #: final norm; the normalised values within float32 reassociation of the norm's scale). False: add_rmsnorm.
        self.fuse_norm = True
        #: the ``lm_head_int8`` mechanism (§4.1): a CertifiedInt8Head that :meth:`greedy` uses (set by
        #: :func:`specpilot.head.certified.with_int8_head`); None = the plain head
        self.int8_head = None

    def kernels_on(self, x: torch.Tensor) -> bool:
        """Whether the static path of a pass over ``x`` runs the fused kernels (see ``use_kernels``)."""
        if not hasattr(self.model.layers[0].self_attn, "qkv_proj"):
            return False
        if self.use_kernels is not None:
            return self.use_kernels
        from specpilot.kernels.fused import triton

        return x.is_cuda and triton is not None and self.args.head_dim in (64, 128)

    @property
    def device(self) -> torch.device:
        """The device of the weights (the embeddings': the LM head may be a W12 layer, §4.1)."""
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The model dtype (the embeddings')."""
        return self.model.embed_tokens.weight.dtype

    def fuse_projections(self) -> "Transformer":
        """Fuse q/k/v and gate/up projections of every layer (fewer, larger GEMMs; issue 4). Returns self."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

    def new_cache(self, max_len: int) -> KVCache:
        """A zeroed static cache of ``max_len`` slots in the model's dtype and device."""
        return KVCache(self.args, max_len, self.dtype, self.device)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """``cos, sin [R, head_dim]`` for ``positions [R] long`` (computed in float32)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = rope_inv_freq(self.args).to(positions.device)
        f = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((f, f), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        start: int,
        mask: torch.Tensor | None = None,
        prof=None,
        features: list | None = None,
        feature_layers: tuple[int, ...] = (),
    ) -> torch.Tensor:
        """Final-norm hidden states of a set of rows.

        Args:
            tokens: ``[R] long`` token ids of the rows.
            positions: ``[R] long`` position ids (prefix_len + depth for tree rows, §4.2).
            cache: the request's cache; rows' K/V are written to slots ``[start, start + R)``.
            start: number of committed slots the rows attend to (the cache prefix); an int, or a 0-d long
                device tensor for the static (CUDA-graph) path, where ``mask`` is then the ``[R, R]`` tree mask.
            mask: ``[R, start + R] bool`` (True = may attend); None = causal over the rows.
            prof: optional step profiler with ``region(name)`` (cost model, §3.2).
            features / feature_layers: when ``feature_layers`` is non-empty, the outputs of those decoder
                layers (0-based) are appended to the list ``features`` as ``[R, hidden_size]`` tensors, in
                the order given (the context a block drafter reads, DFlash-style, §1.1).
        Returns:
            ``[R, hidden_size]`` in the model dtype.
        Raises:
            ValueError: when the rows do not fit the cache.
        """
        r = tokens.shape[0]
        if not isinstance(start, torch.Tensor) and start + r > cache.max_len:
            raise ValueError(f"{start + r} slots needed, cache holds {cache.max_len}")
        with region(prof, "other"):
            x = self.model.embed_tokens(tokens)
            cos, sin = self.rope(positions, x.dtype)
        captured = {}
        if isinstance(start, torch.Tensor) and self.kernels_on(x):
            return self._forward_fused(x, cos, sin, cache, start, mask, captured, features, feature_layers)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache, i, start, mask, prof)
            if i in feature_layers:
                captured[i] = x
        if feature_layers:
            features.extend(captured[i] for i in feature_layers)
        with region(prof, "norms_elementwise"):
            return self.model.norm(x)

    def _forward_fused(self, x, cos, sin, cache, start, mask, captured, features, feature_layers):
        """The static path through :meth:`DecoderLayer.forward_fused` (the tree mask packed once per pass)."""
        from specpilot.kernels import fused
        from specpilot.kernels.tree_attention import pack_tree_mask

        from specpilot.kernels.gemm import cublas_linear, linear

        words = pack_tree_mask(mask)
        lin = linear if self.skinny_gemm else cublas_linear
        delta = sq = None
        layers = self.model.layers
        for i, layer in enumerate(layers):
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            next_norm = None if nxt is None else (nxt.self_attn.qkv_proj, nxt.input_layernorm)
            x, delta, sq = layer.forward_fused(x, delta, cos, sin, cache, i, start, words, lin, self.fuse_swiglu, sq,
                                               self.fuse_norm, next_norm)
            if i in feature_layers:
                captured[i] = x if delta is None else x + delta
        if feature_layers:
            features.extend(captured[i] for i in feature_layers)
        return fused.add_rmsnorm(x, delta, self.model.norm.weight, self.model.norm.eps)[0]

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """Argmax token ids ``[R] long`` of the LM head for ``hidden [R, hidden_size]``, computed on logits in
        the model dtype: the float32 cast of :meth:`logits` is exact, so the argmax (first index on ties) is
        the same, without writing and re-reading ``R x vocab`` float32 logits. With the ``lm_head_int8``
        mechanism (:attr:`int8_head`) the certified INT8 head finds the same argmax (§4.1)."""
        if self.int8_head is not None:
            return self.int8_head.argmax(hidden)
        return self.full_greedy(hidden)

    def full_greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """:meth:`greedy` through the full head always (``[R] long``; the int8 head's fallback)."""
        return self.lm_head(hidden).argmax(dim=-1)

    def logits(self, hidden: torch.Tensor, prof=None) -> torch.Tensor:
        """LM head: ``hidden [R, hidden_size]`` -> logits ``[R, vocab_size]`` float32."""
        with region(prof, "lm_head"):
            return self.lm_head(hidden).float()
