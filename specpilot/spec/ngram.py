"""N-gram drafter: prompt lookup, training-free (HF transformers' prompt lookup decoding, as a lattice).

The longest suffix of the committed tokens (``ngram_max`` down to ``ngram_min`` tokens) is looked up in
the earlier committed tokens; the tokens that followed each match are the proposals. Several matches give
a trie lattice (branches where the continuations disagree), so a tree builder can verify several of them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specpilot.spec.drafter import DraftRequest, SlotTable
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


class _Index:
    """One request's n-gram index: the tokens indexed so far and n-gram -> start positions."""

    def __init__(self):
        self.seen: list[int] = []  # the tokens indexed so far (a prefix of every later ``committed``)
        self.starts: dict[tuple[int, ...], list[int]] = {}


class NgramDrafter:
    """Prompt-lookup drafter with an incremental n-gram index per request slot (:class:`~specpilot.spec.drafter.Drafter`).

    The index maps every n-gram (``ngram_min <= n <= ngram_max``) of the committed tokens that ends before the
    last token to its start positions, in order; each step indexes only the tokens committed since the last
    one, and a lookup is one dict access per suffix length. Left O(length) per step: one C-speed list
    comparison that checks ``committed`` extends the tokens indexed so far (a few µs at 1,000 tokens).
    :func:`ngram_continuations_reference` is the plain definition it equals (``tests/test_ngram.py``).
    ``committed`` is a list of ints (another sequence type rebuilds the index every call). It proposes only ids
    it saw in the committed tokens, so it fits any target (``vocab_size`` None) and has no context limit.

    Args:
        ngram_max: longest suffix tried (tokens).
        ngram_min: shortest suffix tried (tokens), 1 ≤ ngram_min ≤ ngram_max.
        max_matches: most matches kept (most recent first) as the lattice's continuations, ≥ 1.
        max_slots: requests held at once.
    Raises:
        ValueError: on ``ngram_min < 1``, ``ngram_min > ngram_max`` or ``max_matches < 1``.
    """

    kind = "ngram"
    target_layers: tuple[int, ...] = ()
    vocab_size = None
    max_context = None

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1, max_matches: int = 8, max_slots: int = 1024):
        if not 1 <= ngram_min <= ngram_max or max_matches < 1:
            raise ValueError(f"n-gram drafter needs 1 <= ngram_min <= ngram_max and max_matches >= 1, got "
                             f"ngram_min {ngram_min}, ngram_max {ngram_max}, max_matches {max_matches}")
        self.ngram_max, self.ngram_min, self.max_matches = ngram_max, ngram_min, max_matches
        self.max_slots = max_slots
        self._slots = SlotTable(max_slots, _Index)

    def reset(self, slot: int = 0) -> None:
        """Forget the index of ``slot``."""
        self._slots.drop(slot)

    def observe(self, slot: int, features: torch.Tensor, start: int) -> None:
        """Reads no target features: nothing to do."""

    def _extend(self, ix: _Index, committed: list[int]) -> _Index:
        """Index the n-grams ``committed[end - n : end]`` with ``len(ix.seen) <= end < len(committed)``; a fresh
        index when ``committed`` does not extend the tokens seen so far (a new request without a reset)."""
        k = len(ix.seen)
        if k > len(committed) or committed[:k] != ix.seen:
            k = self._rollback(ix, committed)
            if k == 0:
                ix = _Index()
        index, lo, hi = ix.starts, self.ngram_min, self.ngram_max
        for end in range(max(k, 1), len(committed)):  # n-grams committed[end - n : end], end <= len - 1
            for n in range(lo, min(hi, end) + 1):
                index.setdefault(tuple(committed[end - n : end]), []).append(end - n)
        ix.seen.extend(committed[k:])
        return ix

    def _rollback(self, ix: _Index, committed: list[int]) -> int:
        """Cut ``ix`` back to the longest prefix it shares with ``committed`` (TLV drafts after a chain that its exact
        pass may then reject): pop the n-grams ending past it, in reverse order of indexing. Returns that prefix's
        length (0: nothing kept, or ``committed`` is not an extension of a prefix of the index)."""
        seen, p = ix.seen, min(len(ix.seen), len(committed))
        while p > 0 and committed[p - 1] != seen[p - 1]:  # the shared prefix ends at the last agreeing token ...
            p -= 1
        if p == 0 or committed[:p] != seen[:p]:  # ... and is a prefix (else a new request without a reset)
            return 0
        lo, hi = self.ngram_min, self.ngram_max
        for end in range(len(seen) - 1, max(p, 1) - 1, -1):
            for n in range(lo, min(hi, end) + 1):
                key = tuple(seen[end - n : end])
                starts = ix.starts[key]
                starts.pop()  # the last start indexed under this n-gram is end - n
                if not starts:
                    del ix.starts[key]
        del seen[p:]
        return p

    def continuations(self, committed: list[int], depth: int, slot: int = 0) -> list[list[int]]:
        """The continuations :func:`ngram_continuations_reference` returns, from ``slot``'s index."""
        n_tok = len(committed)
        if n_tok < 2 or depth < 1:
            return []
        ix = self._extend(self._slots.get(slot), committed)
        self._slots.put(slot, ix)
        for n in range(min(self.ngram_max, n_tok - 1), self.ngram_min - 1, -1):
            starts = ix.starts.get(tuple(committed[n_tok - n :]))
            if starts:
                return [committed[s + n : s + n + depth] for s in reversed(starts[-self.max_matches :])]
        return []

    def propose(self, batch: Sequence[DraftRequest]) -> list[TrieLattice | None]:
        """Per request, the trie lattice of continuations after its committed ids (``depth`` positions); None
        where nothing matches."""
        out = []
        for q in batch:
            conts = self.continuations(q.committed, q.depth, q.slot)
            out.append(TrieLattice(conts, q.depth) if conts else None)
        return out
