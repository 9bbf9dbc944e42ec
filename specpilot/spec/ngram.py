"""N-gram drafter: prompt lookup, training-free (HF transformers' prompt lookup decoding, as a lattice).

The longest suffix of the committed tokens (``ngram_max`` down to ``ngram_min`` tokens) is looked up in
the earlier committed tokens; the tokens that followed each match are the proposals. Several matches give
a trie lattice (branches where the continuations disagree), so a tree builder can verify several of them.
"""

from __future__ import annotations

import torch

from specpilot.spec.lattice import TrieLattice


def ngram_continuations_reference(committed: list[int], depth: int, ngram_max: int, ngram_min: int,
                                  max_matches: int) -> list[list[int]]:
    """Plain PyTorch prompt lookup (the reference of :class:`NgramDrafter`'s index).

    For ``n`` from ``min(ngram_max, len - 1)`` down to ``ngram_min``: every earlier occurrence of the last ``n``
    committed tokens that ends before the last token, most recent first, gives the (non-empty) continuation
    ``committed[end : end + depth]``; the first ``n`` with a match wins, at most ``max_matches`` of them.
    Returns ``[]`` when nothing matches (or ``len(committed) < 2`` or ``depth < 1``).
    """
    n_tok = len(committed)
    if n_tok < 2 or depth < 1:
        return []
    seq = torch.tensor(committed, dtype=torch.long)
    for n in range(min(ngram_max, n_tok - 1), ngram_min - 1, -1):
        windows = seq[: n_tok - 1].unfold(0, n, 1)  # windows ending before the last token
        hits = (windows == seq[n_tok - n :]).all(dim=1).nonzero().flatten()
        conts = []
        for start in reversed(hits.tolist()):  # most recent first
            conts.append(committed[start + n : start + n + depth])
            if len(conts) >= max_matches:
                break
        if conts:
            return conts
    return []


class NgramDrafter:
    """Prompt-lookup drafter with an incremental n-gram index.

    The index maps every n-gram (``ngram_min <= n <= ngram_max``) of the committed tokens that ends before the
    last token to its start positions, in order; each step indexes only the tokens committed since the last
    one, and a lookup is one dict access per suffix length. Left O(length) per step: one C-speed list
    comparison that checks ``committed`` extends the tokens indexed so far (a few µs at 1,000 tokens).
    :func:`ngram_continuations_reference` is the plain definition it equals (``tests/test_ngram.py``).
    ``committed`` is a list of ints (another sequence type rebuilds the index every call).

    Args:
        ngram_max: longest suffix tried (tokens).
        ngram_min: shortest suffix tried (tokens), 1 ≤ ngram_min ≤ ngram_max.
        max_matches: most matches kept (most recent first) as the lattice's continuations, ≥ 1.
    Raises:
        ValueError: on ``ngram_min < 1``, ``ngram_min > ngram_max`` or ``max_matches < 1``.
    """

    kind = "ngram"

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1, max_matches: int = 8):
        if not 1 <= ngram_min <= ngram_max or max_matches < 1:
            raise ValueError(f"n-gram drafter needs 1 <= ngram_min <= ngram_max and max_matches >= 1, got "
                             f"ngram_min {ngram_min}, ngram_max {ngram_max}, max_matches {max_matches}")
        self.ngram_max, self.ngram_min, self.max_matches = ngram_max, ngram_min, max_matches
        self.reset()

    def reset(self) -> None:
        """Start a new request: forget the index."""
        self._seen: list[int] = []  # the tokens indexed so far (a prefix of every later ``committed``)
        self._index: dict[tuple[int, ...], list[int]] = {}

    def _extend(self, committed: list[int]) -> None:
        """Index the n-grams ``committed[end - n : end]`` with ``len(self._seen) <= end < len(committed)``; rebuild
        from scratch when ``committed`` does not extend the tokens seen so far (a new request, no reset)."""
        k = len(self._seen)
        if k > len(committed) or committed[:k] != self._seen:
            self.reset()
            k = 0
        index, lo, hi = self._index, self.ngram_min, self.ngram_max
        for end in range(max(k, 1), len(committed)):  # n-grams committed[end - n : end], end <= len - 1
            for n in range(lo, min(hi, end) + 1):
                index.setdefault(tuple(committed[end - n : end]), []).append(end - n)
        self._seen.extend(committed[k:])

    def continuations(self, committed: list[int], depth: int) -> list[list[int]]:
        """The continuations :func:`ngram_continuations_reference` returns, from the index."""
        n_tok = len(committed)
        if n_tok < 2 or depth < 1:
            return []
        self._extend(committed)
        for n in range(min(self.ngram_max, n_tok - 1), self.ngram_min - 1, -1):
            starts = self._index.get(tuple(committed[n_tok - n :]))
            if starts:
                return [committed[s + n : s + n + depth] for s in reversed(starts[-self.max_matches :])]
        return []

    def propose(self, committed: list[int], depth: int) -> TrieLattice | None:
        """Lattice of continuations after ``committed`` (list of ids), ``depth`` positions; None if no match."""
        conts = self.continuations(committed, depth)
        return TrieLattice(conts, depth) if conts else None
