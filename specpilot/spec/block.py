"""Block drafter (DFlash-style parallel drafting, §1.1) with an optional Markov head (DSpark-style).

The network (:mod:`specpilot.spec.block_net`): a few decoder layers read the target's hidden states (outputs of ``target_layers``, concatenated and
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
from dataclasses import asdict
from pathlib import Path

import torch

from specpilot.model.transformer import Transformer
from specpilot.errors import DrafterError
from specpilot.spec.block_net import BlockConfig, BlockNet
from specpilot.spec.drafter import OneSlotDrafter
from specpilot.spec.lattice import MarkovLattice, PositionalLattice

TOP_K = 16  # candidates per position kept in a block drafter's lattice (§1.1)


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
