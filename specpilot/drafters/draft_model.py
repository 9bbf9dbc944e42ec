"""Draft-model drafter: a smaller causal LM run sequentially (§1.1, EAGLE-style sequential drafting).

Each step feeds the committed tokens the drafter has not seen, then drafts ``depth`` tokens greedily (top-1),
recording the top-K candidates and log-probs at every position: a :class:`PositionalLattice`. The drafted
tokens' K/V are dropped afterwards, so the drafter's cache always holds exactly the committed prefix (R11).
"""

from __future__ import annotations

import torch

from ..engine.model import Transformer
from .lattice import PositionalLattice


class DraftModelDrafter:
    """Sequential draft model.

    Args:
        model: the draft :class:`Transformer` (same vocabulary as the target).
        top_k: candidates kept per position.
        max_len: cache slots (committed prefix + drafted tokens).
    """

    kind = "draft_model"

    def __init__(self, model: Transformer, top_k: int = 4, max_len: int = 4096):
        self.model, self.top_k = model, top_k
        self.cache = model.new_cache(max_len)
        self.n_seen = 0  # committed tokens whose K/V are in the cache

    def reset(self) -> None:
        """Start a new request: forget the previous request's cache."""
        self.n_seen = 0
        self.cache.length = 0

    @torch.inference_mode()
    def propose(self, committed: list[int], depth: int) -> PositionalLattice | None:
        """Draft ``depth`` positions after ``committed``; returns ``[depth, top_k]`` candidates.

        Raises:
            ValueError: if the committed prefix does not fit the drafter's cache.
        """
        m, dev = self.model, self.model.device
        n = len(committed)
        depth = min(depth, self.cache.max_len - n)
        if depth < 1:
            return None
        if self.n_seen > n or self.n_seen == n:  # rewind so that the last committed token is fed again
            self.n_seen = min(self.n_seen, n - 1)
        new = torch.tensor(committed[self.n_seen :], dtype=torch.long, device=dev)
        pos = torch.arange(self.n_seen, n, device=dev)
        hidden = m.forward(new, pos, self.cache, self.n_seen)[-1:]
        toks, lps = [], []
        for d in range(depth):
            logp = torch.log_softmax(m.logits(hidden)[0], dim=-1)
            lp, tk = logp.topk(self.top_k)
            toks.append(tk)
            lps.append(lp)
            if d + 1 < depth:
                hidden = m.forward(tk[:1], torch.tensor([n + d], device=dev), self.cache, n + d)
        self.n_seen = n
        self.cache.length = n
        return PositionalLattice(torch.stack(toks).cpu(), torch.stack(lps).float().cpu())
