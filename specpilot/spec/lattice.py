"""Lattices: what a drafter proposes, and what a tree builder reads (§1.1, §2.4, §4.2).

A lattice has ``depth`` draft positions. ``children(path)`` gives the candidate tokens for the position
after ``path`` (a tuple of already chosen draft tokens, ``()`` for the first position) with their
log-probs, best first. A positional lattice ignores ``path`` (its candidates at position k are the
drafter's top-K at k); a trie lattice (n-gram) conditions on the whole path, as does a tree lattice (EAGLE-3's dynamic expansion,
which scores only the paths it expanded); a Markov lattice (block
drafter with a Markov head, DSpark-style) conditions on ``path[-1]``. ``marginal(path)`` gives parent-free
scores (DDTree's, used by ``ddtree_marginal``); it equals ``children`` for lattices without a Markov head.
Tree builders need nothing else.
"""

from __future__ import annotations

import math

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

    def marginal(self, path: tuple[int, ...]) -> list[tuple[int, float]]:
        """Parent-free candidates ``[(token, log_prob)]`` for position ``len(path)``, best first.

        Defaults to :meth:`children` (lattices whose scores do not use a Markov head).
        """
        return self.children(path)


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
        counts: dict[tuple[int, ...], dict[int, int]] = {}  # path -> {token: count}, in first-seen order
        for cont in continuations:
            key: tuple[int, ...] = ()
            for tok in cont[:depth]:
                slot = counts.setdefault(key, {})
                slot[tok] = slot.get(tok, 0) + 1
                key += (tok,)
        self._kids: dict[tuple[int, ...], list[tuple[int, float]]] = {}
        for key, slot in counts.items():  # most continuations first, ties by first seen (a stable sort)
            total = sum(slot.values())
            self._kids[key] = [(t, math.log(c / total)) for t, c in sorted(slot.items(), key=lambda tc: -tc[1])]

    def children(self, path: tuple[int, ...]) -> list[tuple[int, float]]:
        return self._kids.get(tuple(path), [])


class TreeLattice(Lattice):
    """Candidates conditioned on the whole path, given as a tree (a sequential drafter's dynamic expansion, §1.1).

    Args:
        kids: ``{path: [(token, log_prob), ...]}``, best first: the candidates the drafter scored after ``path``
            (``()``: the first position). A path it did not expand has no candidates (a leaf for every builder).
        depth: draft positions (no path longer than ``depth - 1`` has candidates).
    """

    def __init__(self, kids: dict[tuple[int, ...], list[tuple[int, float]]], depth: int):
        self.depth, self._kids = depth, kids

    def children(self, path: tuple[int, ...]) -> list[tuple[int, float]]:
        return self._kids.get(tuple(path), []) if len(path) < self.depth else []


class MarkovLattice(Lattice):
    """Block-drafter lattice with a Markov head (DSpark-style, §1.1, §2.3): scores depend on the parent token.

    Args:
        tokens: ``[D, K] long`` candidates per position: the top-K of the base (marginal) distribution.
        marginal: ``[D, K] float`` their base log-probs (no Markov bias).
        cond: ``[D, K, K] float``: ``cond[d, j, c]`` = log p(tokens[d, c] | parent = tokens[d-1, j]) with the
            Markov bias of the parent, log-softmax over the FULL vocabulary (exact renormalization, not
            over the K candidates). Row ``d = 0`` uses ``cond[0, 0]`` (parent = the anchor token).
        anchor: the last committed token (parent of position 0).
        top_k: candidates returned per position (cut after sorting by the conditioned score).

    ``children(path)``: the K candidates of position ``len(path)`` re-sorted by their score given
    ``path[-1]`` (or the anchor), first ``top_k``. A parent that is not a candidate of the previous
    position has no stored scores (tree paths never contain one): ValueError.
    """

    def __init__(self, tokens: torch.Tensor, marginal: torch.Tensor, cond: torch.Tensor, anchor: int, top_k: int):
        self.depth, self.top_k, self.anchor = int(tokens.shape[0]), top_k, anchor
        self._tok = tokens.tolist()
        self._marg = marginal.tolist()
        self._cond = cond
        self._index = [{t: j for j, t in reversed(list(enumerate(row)))} for row in self._tok]
        self._memo: dict[tuple[int, int], list[tuple[int, float]]] = {}

    def _parent_row(self, d: int, parent: int) -> int:
        if d == 0:
            if parent != self.anchor:
                raise ValueError(f"position 0's parent must be the anchor {self.anchor}, got {parent}")
            return 0
        j = self._index[d - 1].get(parent)
        if j is None:
            raise ValueError(f"token {parent} is not a candidate of position {d - 1}")
        return j

    def score(self, position: int, parent_token: int, candidates) -> torch.Tensor:
        """Log-probs ``[len(candidates)] float32`` of candidate tokens at ``position`` given ``parent_token``.

        Raises:
            ValueError: a candidate outside the position's top-K, or an unknown parent.
        """
        j = self._parent_row(position, parent_token)
        idx = []
        for c in candidates:
            if c not in self._index[position]:
                raise ValueError(f"token {c} is not a candidate of position {position}")
            idx.append(self._index[position][c])
        return self._cond[position, j, idx].float()

    def children(self, path: tuple[int, ...]) -> list[tuple[int, float]]:
        d = len(path)
        if d >= self.depth:
            return []
        j = self._parent_row(d, path[-1] if d else self.anchor)
        key = (d, j)
        if key not in self._memo:
            row = self._cond[d, j].tolist()
            order = sorted(range(len(row)), key=lambda c: -row[c])  # stable: base rank breaks ties
            self._memo[key] = [(self._tok[d][c], row[c]) for c in order[: self.top_k]]
        return self._memo[key]

    def marginal(self, path: tuple[int, ...]) -> list[tuple[int, float]]:
        d = len(path)
        if d >= self.depth:
            return []
        return list(zip(self._tok[d], self._marg[d]))[: self.top_k]
