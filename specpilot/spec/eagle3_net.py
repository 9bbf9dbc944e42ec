"""The network of an EAGLE-3-style drafter (§1.1; Li et al., EAGLE-3, 2025), in the layout public EAGLE-3 heads use.

The target's outputs of three layers (low / mid / high; ``target_layers``) are concatenated ``[3 * target_hidden]``
and fused by ``fc`` to ``[hidden]``. One decoder layer of the drafter's own reads, per row, the embedding of a token
and a hidden state: ``input_layernorm(embed)`` and ``hidden_norm(hidden)`` are concatenated ``[2 * hidden]`` and
projected to q / k / v (the attention input is twice the hidden size); the residual of the attention is the
hidden state itself (not normed; with ``norm_before_residual`` the normed one); then a SwiGLU MLP with its own
residual. The layer's output before the final norm (the *pre-norm hidden*) is what the next drafting step reads
as its hidden state (EAGLE's autoregression over hidden states); ``norm`` + ``lm_head`` give logits over a
reduced *draft vocabulary* of ``draft_vocab_size`` ids, mapped to the target's by ``d2t`` (target id = draft id +
``d2t[draft id]``); ``t2d`` marks the target ids the draft vocabulary holds.

Row alignment (as EAGLE-3 and vLLM run it): row ``j`` reads the target feature of position ``j`` and the token at
position ``j + 1``, sits at RoPE position ``j`` and predicts the token at ``j + 2``; a draft row at depth ``d`` after
``n`` committed tokens reads its parent's pre-norm hidden and the parent's token and sits at position
``n - 2 + d``.

Parameter names are the public checkpoints' (``fc``, ``midlayer.self_attn.q_proj`` ..., ``midlayer.mlp.*``,
``midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}``, ``norm``, ``lm_head``, ``d2t``, ``t2d``,
optionally ``embed_tokens``), so a state dict loads as it is. :mod:`specpilot.spec.eagle3` binds a network to a
target as a drafter and reads / writes checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specpilot.model.args import ModelArgs, rope_inv_freq
from specpilot.model.layers import MLP, RMSNorm, sdpa_backends


@dataclass
class Eagle3Config:
    """Architecture of an EAGLE-3 drafter and the target it fits.

    Attributes:
        hidden_size / intermediate_size / heads / kv_heads / head_dim: the drafter's decoder layer (its attention
            input is ``2 * hidden_size``).
        vocab_size: the target's vocabulary (``t2d`` length); draft_vocab_size: the drafter's LM head rows.
        target_hidden: the target's hidden size (``fc`` reads ``len(target_layers) * target_hidden``).
        target_layers: 0-based target layers whose outputs are fused (EAGLE-3's aux layer ids minus one).
        own_embedding: the checkpoint holds its own ``embed_tokens`` (else the target's embedding is used).
        norm_before_residual: the attention's residual is the normed hidden (a variant vLLM reads from the config).
        rms_norm_eps / rope_theta / rope_scaling: as in a Hugging Face Llama config (rope: default or llama3).
        target_num_layers / target_model_type: facts of the target it was built for (0 / "": unknown).
    """

    hidden_size: int = 256
    intermediate_size: int = 512
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    vocab_size: int = 4096
    draft_vocab_size: int = 4096
    target_hidden: int = 256
    target_layers: list[int] = field(default_factory=lambda: [1, 3, 5])
    own_embedding: bool = False
    norm_before_residual: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    target_num_layers: int = 0
    target_model_type: str = ""

    def mlp_args(self) -> ModelArgs:
        """:class:`ModelArgs` of the drafter layer (its MLP and RoPE read them)."""
        return ModelArgs("llama", self.vocab_size, self.hidden_size, self.intermediate_size, 1, self.heads,
                         self.kv_heads, self.head_dim, self.rms_norm_eps, self.rope_theta, self.rope_scaling)


class Eagle3Attention(nn.Module):
    """q / k / v projections from ``2 * hidden`` (embedding and hidden concatenated) and the output projection."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(2 * h, cfg.heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.heads * d, h, bias=False)


class Eagle3Layer(nn.Module):
    """The drafter's one decoder layer (``midlayer`` in the public checkpoints)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = Eagle3Attention(cfg)
        self.mlp = MLP(cfg.mlp_args())
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)


class Eagle3Net(nn.Module):
    """The trainable part of an EAGLE-3 drafter (what ``model.safetensors`` holds).

    Args:
        cfg: :class:`Eagle3Config`.
    Without ``own_embedding`` the target's ``embed_tokens`` is passed to :meth:`embed` (shared and frozen).
    """

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layers) * cfg.target_hidden, h, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        if cfg.own_embedding:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def set_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Set ``d2t`` / ``t2d`` from the target ids ``[draft_vocab_size] long`` of the draft ids (ascending, as
        EAGLE-3 orders them)."""
        ids = draft_to_target.to(self.d2t.device)
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """Target features ``[..., len(target_layers) * target_hidden]`` -> fused hidden ``[..., hidden]``."""
        return self.fc(feats)

    def embed(self, tokens: torch.Tensor, target_embed: nn.Embedding) -> torch.Tensor:
        """Token embeddings ``[..., hidden]`` (the drafter's own table when it has one, else the target's)."""
        table = self.embed_tokens if self.cfg.own_embedding else target_embed
        return table(tokens).to(self.fc.weight.dtype)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [..., R, heads, D]`` by positions ``pos [..., R]`` (HF rotate-half, float32 angles; the
        frequencies are computed here, in float32 whatever the weights' dtype)."""
        f = pos.float()[..., None] * rope_inv_freq(self.cfg.mlp_args()).to(pos.device)
        emb = torch.cat((f, f), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[..., None, :], emb.sin().to(x.dtype)[..., None, :]
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def project(self, emb: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor):
        """Rows ``emb, hidden [..., R, hidden]`` at ``pos [..., R] long`` -> ``(q [..., R, heads, D], k, v
        [..., R, kv_heads, D], residual [..., R, hidden])``, RoPE applied to q and k."""
        c, m = self.cfg, self.midlayer
        e = m.input_layernorm(emb)
        hn = m.hidden_norm(hidden)
        res = hn if c.norm_before_residual else hidden
        x = torch.cat((e, hn), dim=-1)
        lead = x.shape[:-1]
        q = m.self_attn.q_proj(x).view(*lead, c.heads, c.head_dim)
        k = m.self_attn.k_proj(x).view(*lead, c.kv_heads, c.head_dim)
        v = m.self_attn.v_proj(x).view(*lead, c.kv_heads, c.head_dim)
        return self._rope(q, pos), self._rope(k, pos), v, res

    def attend(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``q [B, R, heads, D]`` over ``keys / vals [B, S, kv_heads, D]`` with ``mask [B, R, S] bool`` (True: may
        attend; every row must see at least one key) -> ``[B, R, heads * D]``."""
        rep = self.cfg.heads // self.cfg.kv_heads
        keys, vals = keys.repeat_interleave(rep, 2), vals.repeat_interleave(rep, 2)
        with sdpa_backends(q.device):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2),
                                               attn_mask=mask[:, None])
        return o.transpose(1, 2).reshape(*q.shape[:2], -1)

    def finish(self, attn: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        """Attention output ``[..., heads * D]`` + residual ``[..., hidden]`` -> the pre-norm hidden ``[..., hidden]``
        (output projection, residual, MLP with its residual)."""
        m = self.midlayer
        h = res + m.self_attn.o_proj(attn)
        return h + m.mlp(m.post_attention_layernorm(h))

    def draft_logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden ``[..., hidden]`` -> logits over the draft vocabulary ``[..., draft_vocab_size] float32``."""
        return self.lm_head(self.norm(prenorm)).float()

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids ``[...] long`` -> the target's ids ``[...] long`` (``id + d2t[id]``)."""
        return draft_ids + self.d2t[draft_ids]

    def target_logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary ``[..., vocab_size] float32``: the draft logits at their target ids,
        ``-inf`` at ids outside the draft vocabulary (as vLLM's ``compute_logits`` scatters them)."""
        lg = self.draft_logits(prenorm)
        out = lg.new_full((*lg.shape[:-1], self.cfg.vocab_size), float("-inf"))
        out[..., self.to_target(torch.arange(self.cfg.draft_vocab_size, device=lg.device))] = lg
        return out
