"""The network of a block drafter (DFlash-style parallel drafting, §1.1; DSpark-style Markov head).

A few decoder layers read the target's hidden states (outputs of ``target_layers``, concatenated and
projected) as context and draft B positions in one pass. The block's rows are the anchor (the last committed
token, which has no target features yet) at position L, then mask embeddings at L+1 … L+B−1; row i predicts
the token at position L+1+i. Block rows attend to their request's context slots (the attention mask says which)
and causally to the block rows up to themselves. The network shares the target's token embedding and LM head
(frozen, not stored again). The Markov head adds ``markov_v(markov_u[prev])`` (rank r) to a row's logits,
``prev`` being the token before the predicted one (the anchor for row 0), so a child's score depends on its
parent's token. :mod:`specpilot.spec.block` binds a network to a target as a drafter and holds its checkpoints.

Two options reproduce public DFlash checkpoints (:mod:`specpilot.spec.dflash_import`; both off by default, so
our own checkpoints load unchanged): ``ctx_layer_norm=False`` (context K/V projected from the fused target
features without each layer's input norm) and ``diffusion_block=True`` (DFlash's block: rows see each other in
both directions and each row predicts the token at its own position, see :meth:`BlockNet.run`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specpilot.model.args import ModelArgs
from specpilot.model.layers import MLP, RMSNorm, sdpa_backends


@dataclass
class BlockConfig:
    """Architecture of a block drafter and the target it fits.

    Attributes:
        block_size: B, positions drafted per pass (trained block length; a DFlash checkpoint's ``block_size``
            counts its anchor row, so B is one less).
        markov_rank: r of the Markov head (0 = no Markov head: kind ``block``; > 0: ``block_markov``).
        layers / heads / kv_heads / head_dim / intermediate_size: the drafter's decoder layers.
        target_layers: 0-based target layer indices whose outputs form the context.
        target_hidden / vocab_size / target_num_layers / target_model_type: facts of the target it fits.
        ctx_layer_norm: the context passes through each layer's ``input_layernorm`` before that layer's k/v
            projections (ours); False: the fused features ``ctx_norm(fc(feats))`` go to them as they are (DFlash).
        diffusion_block: DFlash's block layout (:meth:`BlockNet.run`); False: rows attend causally and row i
            predicts the token after its own position (ours).
        mask_token_id: the target token whose embedding fills ``mask_embed`` (DFlash); None: a learned vector.
        draft_vocab_size: 0: candidates range over the target's whole vocabulary; n > 0: over the n target ids of
            :attr:`BlockNet.draft_ids` only (EAGLE-3's reduced draft vocabulary: the shared head's product over n
            rows instead of the vocabulary, the drafter's largest cost on a big-vocabulary target).
    """

    block_size: int = 16
    markov_rank: int = 0
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    target_layers: list[int] = field(default_factory=lambda: [1, 3, 5])
    target_hidden: int = 256
    vocab_size: int = 4096
    target_num_layers: int = 6
    target_model_type: str = "qwen3"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    ctx_layer_norm: bool = True
    diffusion_block: bool = False
    mask_token_id: int | None = None
    draft_vocab_size: int = 0

    @property
    def kind(self) -> str:
        return "block_markov" if self.markov_rank > 0 else "block"

    def layer_args(self) -> ModelArgs:
        """The :class:`ModelArgs` of one drafter layer (hidden = the target's hidden size)."""
        return ModelArgs("qwen3", self.vocab_size, self.target_hidden, self.intermediate_size, self.layers,
                         self.heads, self.kv_heads, self.head_dim, self.rms_norm_eps, self.rope_theta, qk_norm=True)


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate ``x [..., S, H, D]`` by position ids ``pos [..., S]`` (HF rotate-half, float32 angles)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)).float()
    f = pos.float()[..., None] * inv
    emb = torch.cat((f, f), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[..., None, :], emb.sin().to(x.dtype)[..., None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class BlockLayer(nn.Module):
    """One drafter layer: attention whose keys/values are [context slots; block rows], then a SwiGLU MLP."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        h, d = a.hidden_size, a.head_dim
        self.q_proj = nn.Linear(h, a.n_heads * d, bias=False)
        self.k_proj = nn.Linear(h, a.n_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, a.n_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(a.n_heads * d, h, bias=False)
        self.q_norm, self.k_norm = RMSNorm(d, a.rms_norm_eps), RMSNorm(d, a.rms_norm_eps)
        self.input_layernorm = RMSNorm(h, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, a.rms_norm_eps)
        self.mlp = MLP(a)
        self.a = a

    def kv(self, x: torch.Tensor, pos: torch.Tensor, norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of rows ``x [..., S, hidden]`` at ``pos [..., S]`` -> ``[..., S, KVH, D]`` each; ``norm``:
        through ``input_layernorm`` first (block rows always; context rows unless ``ctx_layer_norm`` is off)."""
        h = self.input_layernorm(x) if norm else x
        shp = (*x.shape[:-1], self.a.n_kv_heads, self.a.head_dim)
        k = _rope(self.k_norm(self.k_proj(h).view(shp)), pos, self.a.rope_theta)
        return k, self.v_proj(h).view(shp)

    def forward(self, x, pos, ctx_k, ctx_v, mask):
        """Block rows ``x [Bt, Q, hidden]`` (the target's dtype) at positions ``pos [Bt, Q] long``; context keys /
        values ``ctx_k/v [Bt, C, KVH, D]`` (RoPE applied); ``mask [Bt, Q, C + Q] bool`` (True: row q may attend to
        that context slot or block row; each row must see at least itself). Returns ``[Bt, Q, hidden]``."""
        a = self.a
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(*x.shape[:-1], a.n_heads, a.head_dim)
        q = _rope(self.q_norm(q), pos, a.rope_theta)
        k, v = self.kv(x, pos)
        keys, vals = torch.cat((ctx_k, k), 1), torch.cat((ctx_v, v), 1)
        rep = a.n_heads // a.n_kv_heads
        keys, vals = keys.repeat_interleave(rep, 2), vals.repeat_interleave(rep, 2)
        with sdpa_backends(x.device):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2),
                                               attn_mask=mask[:, None])
        x = x + self.o_proj(o.transpose(1, 2).reshape(*x.shape[:-1], a.n_heads * a.head_dim))
        return x + self.mlp(self.post_attention_layernorm(x))


class BlockNet(nn.Module):
    """The trainable part of a block drafter (what ``model.safetensors`` holds).

    Args:
        cfg: :class:`BlockConfig`.
    The target's ``embed_tokens`` and ``lm_head`` are passed to :meth:`logits` / :meth:`block_input`
    (shared and frozen, §1.1).
    """

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.cfg = cfg
        a = cfg.layer_args()
        h = cfg.target_hidden
        self.fc = nn.Linear(len(cfg.target_layers) * h, h, bias=False)
        self.ctx_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.mask_embed = nn.Parameter(torch.randn(h) * 0.02)
        self.layers = nn.ModuleList(BlockLayer(a) for _ in range(cfg.layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        if cfg.markov_rank > 0:
            self.markov_u = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
            self.markov_v = nn.Linear(cfg.markov_rank, cfg.vocab_size, bias=False)
            nn.init.normal_(self.markov_u.weight, std=0.02)
            nn.init.zeros_(self.markov_v.weight)
        if cfg.draft_vocab_size > 0:  # ascending target ids (set by the trainer: the most frequent greedy tokens)
            self.register_buffer("draft_ids", torch.arange(cfg.draft_vocab_size))

    def context_kv(self, feats: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values) ``[..., S, KVH, D]`` of context slots.

        Args:
            feats: ``[..., S, len(target_layers) * hidden]`` target features of committed tokens.
            pos: ``[..., S] long`` their positions.
        """
        ctx = self.ctx_norm(self.fc(feats))
        return [layer.kv(ctx, pos, self.cfg.ctx_layer_norm) for layer in self.layers]

    def block_input(self, anchors: torch.Tensor, embed: nn.Embedding, block: int) -> torch.Tensor:
        """``anchors [Bt] long`` -> block rows ``[Bt, block, hidden]``: anchor embedding then mask embeddings."""
        x = self.mask_embed.expand(anchors.shape[0], block, -1).clone()
        x[:, 0] = embed(anchors).to(x.dtype)
        return x

    def run(self, x, pos, ctx_kv, mask) -> torch.Tensor:
        """Drafter layers + final norm: ``x [Bt, Q, hidden]`` -> ``[Bt, Q, hidden]``, row i's output predicting the
        token at ``pos[:, i] + 1``; ``ctx_kv`` holds per layer the (keys, values) ``[Bt, C, KVH, D]`` of each
        row's context (padded to one C, the padding masked out by ``mask [Bt, Q, C + Q] bool``); see
        :class:`BlockLayer`.

        With ``diffusion_block`` (DFlash), the Q rows (anchor, then masks) get one more mask row at
        ``pos[:, -1] + 1``; the Q + 1 rows see each other in both directions and the context slots that
        ``mask``'s first row sees (the drafters give every row of a request the same context); row j's output
        predicts the token at its own position, so rows 1 … Q are returned (same contract as above)."""
        if self.cfg.diffusion_block:
            bt, q = x.shape[:2]
            c = mask.shape[-1] - q
            x = torch.cat((x, self.mask_embed.to(x.dtype).expand(bt, 1, -1)), 1)
            pos = torch.cat((pos, pos[:, -1:] + 1), 1)
            mask = torch.cat((mask[:, :1, :c].expand(bt, q + 1, c), mask.new_ones(bt, q + 1, q + 1)), -1)
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            x = layer(x, pos, ck, cv, mask)
        return self.norm(x[:, 1:] if self.cfg.diffusion_block else x)

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """``prev [...] long`` -> the Markov head's logit bias ``[..., vocab]`` (zero without the head)."""
        if self.cfg.markov_rank == 0:
            raise ValueError("this block drafter has no Markov head")
        return self.markov_v(self.markov_u(prev)).float()
