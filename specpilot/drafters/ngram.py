"""N-gram drafter: prompt lookup, training-free (HF transformers' prompt lookup decoding, as a lattice).

The longest suffix of the committed tokens (``ngram_max`` down to ``ngram_min`` tokens) is looked up in
the earlier committed tokens; the tokens that followed each match are the proposals. Several matches give
a trie lattice (branches where the continuations disagree), so a tree builder can verify several of them.
"""

from __future__ import annotations

import torch

from .lattice import TrieLattice


class NgramDrafter:
    """Prompt-lookup drafter.

    Args:
        ngram_max: longest suffix tried (tokens).
        ngram_min: shortest suffix tried (tokens).
        max_matches: most matches kept (most recent first) as the lattice's continuations.
    """

    kind = "ngram"

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1, max_matches: int = 8):
        self.ngram_max, self.ngram_min, self.max_matches = ngram_max, ngram_min, max_matches

    def reset(self) -> None:
        """Start a new request (the n-gram drafter keeps no state)."""

    def propose(self, committed: list[int], depth: int) -> TrieLattice | None:
        """Lattice of continuations after ``committed`` (list of ids), ``depth`` positions; None if no match."""
        n_tok = len(committed)
        if n_tok < 2 or depth < 1:
            return None
        seq = torch.tensor(committed, dtype=torch.long)
        for n in range(min(self.ngram_max, n_tok - 1), self.ngram_min - 1, -1):
            windows = seq[: n_tok - 1].unfold(0, n, 1)  # windows ending before the last token
            hits = (windows == seq[n_tok - n :]).all(dim=1).nonzero().flatten()
            if hits.numel() == 0:
                continue
            conts = []
            for start in reversed(hits.tolist()):  # most recent first
                cont = committed[start + n : start + n + depth]
                if cont:
                    conts.append(cont)
                if len(conts) >= self.max_matches:
                    break
            if conts:
                return TrieLattice(conts, depth)
        return None
