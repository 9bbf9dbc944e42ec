"""Block drafter (DFlash-style parallel drafting, §1.1) with an optional Markov head (DSpark-style).

A few decoder layers read the target's hidden states (outputs of ``target_layers``, concatenated and
projected) as context and draft B positions in one pass. The block's rows are the anchor (the last committed
token, which has no target features yet) at position L, then mask embeddings at L+1 … L+B−1; row i predicts
the token at position L+1+i. Block rows attend to every context slot and causally to the block rows up to
themselves. The drafter shares the target's token embedding and LM head (frozen, not stored again). The
Markov head adds ``markov_v(markov_u[prev])`` (rank r) to a row's logits, ``prev`` being the token before
the predicted one (the anchor for row 0), so a child's score depends on its parent's token.

Checkpoint: a directory with ``config.json`` (``"specpilot_drafter": "block"`` + :class:`BlockConfig`
fields + the target facts it was trained for) and ``model.safetensors``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specpilot.model.args import ModelArgs
from specpilot.model.layers import MLP, RMSNorm
from specpilot.model.transformer import Transformer
from specpilot.errors import DrafterError
from specpilot.spec.drafter import OneSlotDrafter
from specpilot.spec.lattice import MarkovLattice, PositionalLattice

TOP_K = 16  # candidates per position kept in a block drafter's lattice (§1.1)


@dataclass
class BlockConfig:
    """Architecture of a block drafter and the target it fits.

    Attributes:
        block_size: B, positions drafted per pass (trained block length).
        markov_rank: r of the Markov head (0 = no Markov head: kind ``block``; > 0: ``block_markov``).
        layers / heads / kv_heads / head_dim / intermediate_size: the drafter's decoder layers.
        target_layers: 0-based target layer indices whose outputs form the context.
        target_hidden / vocab_size / target_num_layers / target_model_type: facts of the target it fits.
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

    def kv(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of rows ``x [..., S, hidden]`` at ``pos [..., S]`` -> ``[..., S, KVH, D]`` each."""
        h = self.input_layernorm(x)
        shp = (*x.shape[:-1], self.a.n_kv_heads, self.a.head_dim)
        k = _rope(self.k_norm(self.k_proj(h).view(shp)), pos, self.a.rope_theta)
        return k, self.v_proj(h).view(shp)

    def forward(self, x, pos, ctx_k, ctx_v, mask):
        """Block rows ``x [Bt, Q, hidden]`` at ``pos [Bt, Q]``; context ``ctx_k/v [Bt, C, KVH, D]``;
        ``mask [Bt, Q, C + Q] bool``. Returns ``[Bt, Q, hidden]``."""
        a = self.a
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(*x.shape[:-1], a.n_heads, a.head_dim)
        q = _rope(self.q_norm(q), pos, a.rope_theta)
        k, v = self.kv(x, pos)
        keys, vals = torch.cat((ctx_k, k), 1), torch.cat((ctx_v, v), 1)
        rep = a.n_heads // a.n_kv_heads
        keys, vals = keys.repeat_interleave(rep, 2), vals.repeat_interleave(rep, 2)
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

    def context_kv(self, feats: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values) ``[..., S, KVH, D]`` of context slots.

        Args:
            feats: ``[..., S, len(target_layers) * hidden]`` target features of committed tokens.
            pos: ``[..., S] long`` their positions.
        """
        ctx = self.ctx_norm(self.fc(feats))
        return [layer.kv(ctx, pos) for layer in self.layers]

    def block_input(self, anchors: torch.Tensor, embed: nn.Embedding, block: int) -> torch.Tensor:
        """``anchors [Bt] long`` -> block rows ``[Bt, block, hidden]``: anchor embedding then mask embeddings."""
        x = self.mask_embed.expand(anchors.shape[0], block, -1).clone()
        x[:, 0] = embed(anchors).to(x.dtype)
        return x

    def run(self, x, pos, ctx_kv, mask) -> torch.Tensor:
        """Drafter layers + final norm: ``x [Bt, Q, hidden]`` -> ``[Bt, Q, hidden]`` (see :class:`BlockLayer`)."""
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            x = layer(x, pos, ck, cv, mask)
        return self.norm(x)

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """``prev [...] long`` -> the Markov head's logit bias ``[..., vocab]`` (zero without the head)."""
        if self.cfg.markov_rank == 0:
            raise ValueError("this block drafter has no Markov head")
        return self.markov_v(self.markov_u(prev)).float()


class BlockDrafter(OneSlotDrafter):
    """Block drafter bound to a target (:class:`~specpilot.spec.drafter.Drafter`, one request slot): keeps the
    context K/V of the committed slots and proposes lattices.

    Args:
        net: a :class:`BlockNet` (same dtype / device as the target).
        target: the target :class:`Transformer` (its embedding and LM head are shared).
        top_k: candidates per position exposed by the lattice (≤ 16).
        max_len: context slots allocated up front; the buffers grow (doubling) when a longer context is observed.
    The engine captures the target's outputs at :attr:`target_layers` and hands them to :meth:`observe`. The
    drafter always runs all B block rows and cuts the lattice to ``depth``, so a lattice's first positions do not
    depend on the requested depth (exact replay).
    """

    kind = "block"

    def __init__(self, net: BlockNet, target: Transformer, top_k: int = TOP_K, max_len: int = 4096):
        self.net, self.target, self.top_k = net.eval(), target, min(top_k, TOP_K)
        self.cfg = net.cfg
        self.target_layers = tuple(net.cfg.target_layers)
        self.vocab_size = net.cfg.vocab_size
        shape = (net.cfg.layers, max(max_len, 1), net.cfg.kv_heads, net.cfg.head_dim)
        dt, dev = target.dtype, target.device
        self.ctx_k = torch.zeros(shape, dtype=dt, device=dev)
        self.ctx_v = torch.zeros(shape, dtype=dt, device=dev)
        self._context = 0  # committed slots whose context K/V are held

    @property
    def context_length(self) -> int:
        """Committed slots whose context K/V are held (written by :meth:`observe`, cleared by :meth:`reset`)."""
        return self._context

    def clear(self) -> None:
        """Start a new request (forget the context)."""
        self._context = 0

    def _reserve(self, n: int) -> None:
        """Context buffers of at least ``n`` slots (doubling; the held slots are kept)."""
        have = self.ctx_k.shape[1]
        if n <= have:
            return
        size = max(n, 2 * have)
        for name in ("ctx_k", "ctx_v"):
            old = getattr(self, name)
            new = old.new_zeros((old.shape[0], size, *old.shape[2:]))
            new[:, :have] = old
            setattr(self, name, new)

    @torch.inference_mode()
    def observe(self, slot: int, features: torch.Tensor, start: int) -> None:
        """Store the context K/V of committed slots ``[start, start + k)`` from ``features [k, n_layers*hidden]``;
        the context then ends there (slots past it are forgotten)."""
        self.check_slot(slot)
        k = features.shape[0]
        self._reserve(start + k)
        pos = torch.arange(start, start + k, device=features.device)
        for i, (ck, cv) in enumerate(self.net.context_kv(features.to(self.ctx_k.dtype), pos)):
            self.ctx_k[i, start : start + k] = ck
            self.ctx_v[i, start : start + k] = cv
        self._context = start + k

    @torch.inference_mode()
    def block_logits(self, committed: list[int]) -> torch.Tensor:
        """Base logits ``[B, vocab] float32`` of the B block positions after ``committed`` (one pass)."""
        n, b = len(committed), self.cfg.block_size
        dev = self.ctx_k.device
        x = self.net.block_input(torch.tensor([committed[-1]], device=dev), self.target.model.embed_tokens, b)
        pos = torch.arange(n - 1, n - 1 + b, device=dev)[None]
        mask = torch.ones(1, b, n - 1 + b, dtype=torch.bool, device=dev)
        mask[0, :, n - 1:] = torch.ones(b, b, dtype=torch.bool, device=dev).tril()
        ctx = [(self.ctx_k[i, None, : n - 1], self.ctx_v[i, None, : n - 1]) for i in range(self.cfg.layers)]
        return self.target.logits(self.net.run(x, pos, ctx, mask)[0])

    @torch.inference_mode()
    def draft(self, committed: list[int], depth: int):
        """``min(depth, B)`` positions drafted after ``committed`` in one pass: a :class:`PositionalLattice` ``[depth, top_k]`` (no Markov head) or a :class:`MarkovLattice` (top-16
        base candidates per position, parent-conditioned log-probs renormalized exactly over the full
        vocabulary), or None when ``depth < 1``. Needs the context of ``committed[:-1]`` (R11).

        Raises:
            RuntimeError: when the context held does not end at ``len(committed) - 1``.
        """
        n, b = len(committed), self.cfg.block_size
        depth = min(depth, b)
        if depth < 1:
            return None
        if self._context != n - 1:
            raise RuntimeError(f"block drafter context holds {self._context} slots, expected {n - 1}")
        logits = self.block_logits(committed)[:depth]  # [depth, V] float32
        anchor = torch.tensor([committed[-1]], device=logits.device)
        logp = logits.log_softmax(-1)
        marg, toks = logp.topk(TOP_K, dim=-1)
        if self.cfg.markov_rank == 0:
            return PositionalLattice(toks[:, : self.top_k].cpu(), marg[:, : self.top_k].cpu())
        parents = torch.cat((anchor.expand(1, TOP_K), toks[:-1]), 0)  # [depth, 16]; row 0: the anchor
        cond = (logits[:, None, :] + self.net.markov_bias(parents)).log_softmax(-1)  # [depth, 16, V]
        cond = cond.gather(-1, toks[:, None, :].expand(-1, TOP_K, -1))  # [depth, parent j, child c]
        return MarkovLattice(toks.cpu(), marg.cpu(), cond.cpu(), committed[-1], self.top_k)


def save_block(net: BlockNet, out: str | Path, extra: dict | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (bf16) of ``net`` to ``out``; returns the directory."""
    from specpilot.fileio import save_safetensors

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"specpilot_drafter": "block", "kind": net.cfg.kind, **asdict(net.cfg), **(extra or {})}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in net.state_dict().items()}
    save_safetensors(sd, out / "model.safetensors")
    return out


def is_block_dir(path) -> bool:
    """True when ``path/config.json`` declares ``"specpilot_drafter": "block"``."""
    p = Path(path) / "config.json"
    try:
        return p.is_file() and json.loads(p.read_text()).get("specpilot_drafter") == "block"
    except (OSError, ValueError):
        return False


def load_block(path, target: Transformer) -> BlockNet:
    """Load a block drafter directory for ``target`` (dtype / device of the target).

    Raises:
        DrafterError: missing files, or the drafter does not fit the target (hidden size, vocabulary,
            layer indices).
    """
    from safetensors.torch import load_file

    p = Path(path)
    if not is_block_dir(p) or not (p / "model.safetensors").is_file():
        raise DrafterError(f"{p} is not a block drafter directory (a config.json with \"specpilot_drafter\": \"block\" "
                           "and a model.safetensors; a causal LM directory is a draft model)")
    raw = json.loads((p / "config.json").read_text())
    names = BlockConfig.__dataclass_fields__
    cfg = BlockConfig(**{k: v for k, v in raw.items() if k in names})
    ta = target.args
    if cfg.target_hidden != ta.hidden_size or cfg.vocab_size != ta.vocab_size:
        raise DrafterError(f"block drafter {p} was built for hidden {cfg.target_hidden} / vocab {cfg.vocab_size}, "
                           f"the target has hidden {ta.hidden_size} / vocab {ta.vocab_size}")
    if max(cfg.target_layers) >= ta.num_layers or min(cfg.target_layers) < 0:
        raise DrafterError(f"block drafter {p} reads target layers {cfg.target_layers}, "
                           f"the target has {ta.num_layers} layers")
    with torch.device("meta"):  # no initialisation (the weights are loaded next; it would draw from torch's RNG)
        net = BlockNet(cfg)
    net = net.to_empty(device="cpu")
    try:
        net.load_state_dict(load_file(str(p / "model.safetensors")))
    except RuntimeError as e:
        raise DrafterError(f"block drafter weights in {p} do not match its config.json: {str(e)[:200]}") from None
    return net.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
