"""Draft trees and the builders that make them from a lattice (§1.1 chain, §4.2 best-first).

A :class:`Tree` lists its drafted nodes in topological order (a parent before its children); node ``i``
(0-based) is row ``i + 1`` of the verification pass, row 0 being the root (the last committed token).
Every builder returns a prefix-closed tree of at most ``nodes`` nodes and depth at most ``lattice.depth``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from ..drafters.lattice import Lattice


@dataclass
class Tree:
    """Drafted nodes (root excluded).

    Attributes:
        tokens: token id per node.
        parents: parent per node: ``-1`` = the root, else the index of an earlier node.
        depths: depth per node (1 = child of the root).
        scores: path score Σ log p(child | parent) per node.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, score: float) -> int:
        """Append a node under ``parent`` (-1 = root); returns its index."""
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.scores.append(score)
        return len(self.tokens) - 1

    def path(self, i: int) -> tuple[int, ...]:
        """Tokens from the root's first child down to node ``i`` (inclusive)."""
        out = []
        while i >= 0:
            out.append(self.tokens[i])
            i = self.parents[i]
        return tuple(reversed(out))

    def ancestor_mask(self, device=None) -> torch.Tensor:
        """``[N + 1, N + 1] bool``: row r may attend row c iff c is r itself or an ancestor (root = row 0)."""
        n = len(self) + 1
        m = torch.zeros(n, n, dtype=torch.bool)
        m[:, 0] = True
        for i, p in enumerate(self.parents):
            r = i + 1
            if p >= 0:
                m[r] = m[p + 1]
            m[r, r] = True
        m[0, 0] = True
        return m.to(device) if device is not None else m

    def child_maps(self) -> list[dict[int, int]]:
        """Per row (root = 0), ``{token: child row}``; the first child with a token wins."""
        maps: list[dict[int, int]] = [{} for _ in range(len(self) + 1)]
        for i, (tok, p) in enumerate(zip(self.tokens, self.parents)):
            maps[p + 1].setdefault(tok, i + 1)
        return maps


def build_chain(lattice: Lattice, nodes: int) -> Tree:
    """Stock (§1.1): follow the best candidate at each position, up to ``min(nodes, depth)`` nodes.

    With a parent-conditioned lattice the chain follows the conditioning (each position given the chosen
    previous token). Returns a chain :class:`Tree` (possibly empty).
    """
    tree, parent, score = Tree(), -1, 0.0
    for _ in range(min(nodes, lattice.depth)):
        kids = lattice.children(tree.path(parent) if parent >= 0 else ())
        if not kids:
            break
        tok, lp = kids[0]
        score += lp
        parent = tree.add(tok, parent, score)
    return tree


def build_best_first(lattice: Lattice, nodes: int) -> Tree:
    """Best-first tree (§4.2): the ``nodes`` nodes of highest path score Σ log p(child | parent).

    A max-heap over the frontier; popping a node adds it and pushes its children (the next position's
    candidates scored given the node's path). Exactly best-first: no candidate left on the frontier has a
    higher path score than an included node (ties broken by insertion order). Prefix-closed by construction.
    """
    tree = Tree()
    heap: list[tuple[float, int, int, int]] = []  # (-score, seq, parent, token)
    seq = 0
    for tok, lp in lattice.children(()):
        heap.append((-lp, seq, -1, tok))
        seq += 1
    heapq.heapify(heap)
    while heap and len(tree) < nodes:
        neg, _, parent, tok = heapq.heappop(heap)
        i = tree.add(tok, parent, -neg)
        if tree.depths[i] >= lattice.depth:
            continue
        for ctok, lp in lattice.children(tree.path(i)):
            heapq.heappush(heap, (neg - lp, seq, i, ctok))
            seq += 1
    return tree


BUILDERS = {"chain": build_chain, "best_first": build_best_first}


def build_tree(kind: str, lattice: Lattice, nodes: int) -> Tree:
    """Dispatch to a builder by name (``chain`` | ``best_first``). Raises KeyError for an unknown name."""
    return BUILDERS[kind](lattice, nodes)
