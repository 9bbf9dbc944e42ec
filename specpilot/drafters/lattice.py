"""Lattices: what a drafter proposes, and what a tree builder reads (§1.1, §2.4, §4.2).

A lattice has ``depth`` draft positions. ``children(path)`` gives the candidate tokens for the position
after ``path`` (a tuple of already chosen draft tokens, ``()`` for the first position) with their
log-probs, best first. A positional lattice ignores ``path`` (its candidates at position k are the
drafter's top-K at k); a trie lattice (n-gram) conditions on the whole path; a Markov lattice would
condition on ``path[-1]``. Tree builders need nothing else.
"""

from __future__ import annotations

import math
from collections import Counter

import torch


class Lattice:
    """Base class. Subclasses implement :meth:`children`.

    Attributes:
        depth: number of draft positions (a tree built on it has depth ≤ this).
    """

    depth: int = 0

    def children(self, path: tuple[int, ...]) -> list[tuple[int, float]]:
        """Candidates ``[(token, log_prob), ...]`` for position ``len(path)``, best first; ``[]`` if none."""
        raise NotImplementedError


class PositionalLattice(Lattice):
    """Top-K candidates per position, independent of the parent (a sequential drafter's greedy run).

    Args:
        tokens: ``[D, K] long`` candidate ids per position, best first.
        logp: ``[D, K] float`` their log-probs.
    """

    def __init__(self, tokens: torch.Tensor, logp: torch.Tensor):
        self.depth = int(tokens.shape[0])
        self._rows = [list(zip(t, p)) for t, p in zip(tokens.tolist(), logp.tolist())]

    def children(self, path: tuple[int, ...]) -> list[tuple[int, float]]:
        d = len(path)
        return self._rows[d] if d < self.depth else []


class TrieLattice(Lattice):
    """Candidates conditioned on the whole path: a trie of continuations (n-gram prompt lookup).

    Args:
        continuations: token lists, each a proposed continuation (most relevant first).
        depth: positions kept (longer continuations are cut).
    The log-prob of a child is log(#continuations through it / #continuations through its parent).
    """

    def __init__(self, continuations: list[list[int]], depth: int):
        self.depth = depth
        counts: dict[tuple[int, ...], Counter] = {}
        first_seen: dict[tuple[tuple[int, ...], int], int] = {}
        for rank, cont in enumerate(continuations):
            cont = cont[:depth]
            for i, tok in enumerate(cont):
                key = tuple(cont[:i])
                counts.setdefault(key, Counter())[tok] += 1
                first_seen.setdefault((key, tok), rank)
        self._kids: dict[tuple[int, ...], list[tuple[int, float]]] = {}
        for key, cnt in counts.items():
            total = sum(cnt.values())
            order = sorted(cnt, key=lambda t: (-cnt[t], first_seen[(key, t)]))
            self._kids[key] = [(t, math.log(cnt[t] / total)) for t in order]

    def children(self, path: tuple[int, ...]) -> list[tuple[int, float]]:
        return self._kids.get(tuple(path), [])
