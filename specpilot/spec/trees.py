"""Draft trees and the builders that make them from a lattice (§1.1 chain, §4.2 best-first; for comparison
DDTree's marginal best-first, an EAGLE-2 top-k tree and a Sequoia static tree).

A :class:`Tree` lists its drafted nodes in topological order (a parent before its children); node ``i``
(0-based) is row ``i + 1`` of the verification pass, row 0 being the root (the last committed token).
Every builder returns a prefix-closed tree of at most ``nodes`` nodes and depth at most ``lattice.depth``.
"""

from __future__ import annotations

import heapq
from types import MappingProxyType
from dataclasses import dataclass, field

import numpy as np
import torch

from specpilot.spec.lattice import Lattice


def ancestor_mask_of(row_parents: list[int]) -> torch.Tensor:
    """``[R, R] bool`` ancestor-or-self mask of rows given each row's parent row (-1 for a root; a row
    with no parent sees only itself, as a padding row). Parents must precede their children.

    Raises: ValueError when a parent does not precede its child.
    """
    n = len(row_parents)
    m = np.zeros((n, n), dtype=np.bool_)  # numpy row copies: a few µs a step where torch indexing took ~20
    for r, p in enumerate(row_parents):
        if p >= r:
            raise ValueError(f"row {r}'s parent {p} does not precede it")
        if p >= 0:
            m[r] = m[p]
        m[r, r] = True
    return torch.from_numpy(m)


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
        m = ancestor_mask_of([-1] + [p + 1 for p in self.parents])
        return m.to(device) if device is not None else m

    def child_maps(self) -> list[dict[int, int]]:
        """Per row (root = 0), ``{token: child row}``; the first child with a token wins."""
        maps: list[dict[int, int]] = [{} for _ in range(len(self) + 1)]
        for i, (tok, p) in enumerate(zip(self.tokens, self.parents)):
            maps[p + 1].setdefault(tok, i + 1)
        return maps


    def accept(self, argmax: list[int]) -> tuple[list[int], list[int]]:
        """Greedy acceptance (§1.1): from the root, step to the child whose token equals the row's argmax while one
        exists. ``argmax``: the exact pass's argmax per row (root = row 0). Returns ``(path, tokens)``: the accepted
        rows (root first, increasing) and the accepted draft tokens plus the bonus (the argmax at the last row)."""
        kids = self.child_maps()
        path, row = [0], 0
        while argmax[row] in kids[row]:
            row = kids[row][argmax[row]]
            path.append(row)
        return path, [self.tokens[i - 1] for i in path[1:]] + [argmax[row]]

    def chain_first(self) -> "Tree":
        """The same tree with its top chain first: from the root, the best-scored child at each level becomes nodes
        0, 1, 2, ... (so in a pass laid out at ``start + index`` each sits at its own position), then the other
        nodes in their order. Still topological (a parent before its children). Verifying it accepts the same tokens
        (acceptance follows tokens, not indices); a batched pass whose attention walks position-aligned blocks gives
        that chain's rows AR's bits, and accepting along it moves no K/V."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents):
            kids[p + 1].append(i)
        chain, row = [], 0
        while kids[row]:
            best = max(kids[row], key=lambda i: self.scores[i])  # first of equals: insertion order
            chain.append(best)
            row = best + 1
        if chain == list(range(len(chain))):
            return self
        on_chain = set(chain)
        order = chain + [i for i in range(len(self)) if i not in on_chain]
        new = {old: k for k, old in enumerate(order)}
        return Tree([self.tokens[i] for i in order], [new[self.parents[i]] if self.parents[i] >= 0 else -1
                                                      for i in order],
                    [self.depths[i] for i in order], [self.scores[i] for i in order])

    def truncate(self, n: int) -> "Tree":
        """The first ``n`` nodes (a prefix of a topological order is prefix-closed: still a tree)."""
        return Tree(self.tokens[:n], self.parents[:n], self.depths[:n], self.scores[:n])

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


def _best_first(lattice: Lattice, nodes: int, kids) -> Tree:
    """Best-first over ``kids(path) -> [(token, log_prob)]``: a max-heap over the frontier (ties: insertion)."""
    tree = Tree()
    heap: list[tuple[float, int, int, int]] = []  # (-score, seq, parent, token)
    seq = 0
    for tok, lp in kids(()):
        heap.append((-lp, seq, -1, tok))
        seq += 1
    heapq.heapify(heap)
    while heap and len(tree) < nodes:
        neg, _, parent, tok = heapq.heappop(heap)
        i = tree.add(tok, parent, -neg)
        if tree.depths[i] >= lattice.depth:
            continue
        for ctok, lp in kids(tree.path(i)):
            heapq.heappush(heap, (neg - lp, seq, i, ctok))
            seq += 1
    return tree


def build_best_first(lattice: Lattice, nodes: int) -> Tree:
    """Best-first tree (§4.2): the ``nodes`` nodes of highest path score Σ log p(child | parent).

    A max-heap over the frontier; popping a node adds it and pushes its children (the next position's
    candidates scored given the node's path). Exactly best-first: no candidate left on the frontier has a
    higher path score than an included node (ties broken by insertion order). Prefix-closed by construction.
    """
    return _best_first(lattice, nodes, lattice.children)


def build_ddtree_marginal(lattice: Lattice, nodes: int) -> Tree:
    """DDTree-style best-first on marginal (parent-free) scores ``lattice.marginal(path)`` (§2.3, §4.2).

    On a Markov lattice the candidates and scores ignore the parent token; on any other lattice this equals
    :func:`build_best_first`. ``scores`` hold the marginal path scores.
    """
    return _best_first(lattice, nodes, lattice.marginal)


def build_eagle2_topk(lattice: Lattice, nodes: int, k: int = 4) -> Tree:
    """EAGLE-2-style tree (§4.2 comparison): expand the top-``k`` children of each of the ``k`` best frontier
    nodes per depth, then keep the global best ``nodes`` of all generated nodes by path score.

    Path scores are Σ log p(child | parent) (≤ 0, so a child never beats its parent; ties go to the
    shallower, earlier node), hence the kept set is prefix-closed.
    """
    pool: list[tuple[float, int, int, int, tuple[int, ...]]] = []  # (score, depth, parent pool idx, token, path)
    frontier = [(0.0, -1, ())]
    for depth in range(1, lattice.depth + 1):
        new = []
        for score, pidx, path in frontier:
            for tok, lp in lattice.children(path)[:k]:
                pool.append((score + lp, depth, pidx, tok, path + (tok,)))
                new.append(len(pool) - 1)
        if not new:
            break
        new.sort(key=lambda i: (-pool[i][0], i))
        frontier = [(pool[i][0], i, pool[i][4]) for i in new[:k]]
    keep = sorted(range(len(pool)), key=lambda i: (-pool[i][0], pool[i][1], i))[:nodes]
    keep.sort(key=lambda i: (pool[i][1], i))
    tree, where = Tree(), {}
    for i in keep:
        score, _, pidx, tok, _ = pool[i]
        where[i] = tree.add(tok, -1 if pidx < 0 else where[pidx], score)
    return tree


class SequoiaBuilder:
    """Sequoia-style static tree (§4.2 comparison): one fixed shape for every step, from a measured profile.

    ``profile[d][r]`` = P(the target's token is the rank-``r`` candidate at depth ``d + 1`` | the path to
    it was accepted), measured by :func:`acceptance_profile`. Treating ranks as independent, a node's
    value is the product of its path's probabilities (the chance it is accepted); the expected accepted
    length of a shape is the sum of its node values, and greedily adding the highest-value frontier node
    (best-first on Σ log p[d][r], values shrink along a path) gives the optimal N-node shape (Sequoia's DP
    for this objective). The shape is a list of ``(parent shape index, rank)``; building a tree maps rank
    r under a node to the r-th child of its lattice candidates (a missing rank drops its subtree).
    Without a profile, p[d][r] = 0.5^(r+1) (a generic geometric profile).
    """

    def __init__(self, profile: list[list[float]] | None = None):
        self.profile = profile
        self._shapes: dict[tuple[int, int], list[tuple[int, int]]] = {}

    def _p(self, d: int, r: int) -> float:
        if self.profile is None:
            return 0.5 ** (r + 1)
        row = self.profile[min(d, len(self.profile) - 1)]
        return row[r] if r < len(row) else 0.0

    def shape(self, nodes: int, depth: int, width: int = 16) -> list[tuple[int, int]]:
        """The static shape: ``[(parent index or -1, rank)]`` in topological order, at most ``nodes``."""
        key = (nodes, depth)
        if key not in self._shapes:
            out: list[tuple[int, int]] = []
            heap = [(-self._p(0, r), r, -1, r, 1) for r in range(width) if self._p(0, r) > 0]
            heapq.heapify(heap)
            seq = width
            while heap and len(out) < nodes:
                neg, _, parent, r, d = heapq.heappop(heap)
                out.append((parent, r))
                if d < depth:
                    for cr in range(width):
                        p = self._p(d, cr)
                        if p > 0:
                            heapq.heappush(heap, (neg * p, seq, len(out) - 1, cr, d + 1))
                            seq += 1
            self._shapes[key] = out
        return self._shapes[key]

    def __call__(self, lattice: Lattice, nodes: int) -> Tree:
        tree, where = Tree(), {}
        for i, (parent, r) in enumerate(self.shape(nodes, lattice.depth)):
            if parent >= 0 and parent not in where:
                continue
            path = tree.path(where[parent]) if parent >= 0 else ()
            kids = lattice.children(path)
            if r < len(kids):
                tok, lp = kids[r]
                base = tree.scores[where[parent]] if parent >= 0 else 0.0
                where[i] = tree.add(tok, where[parent] if parent >= 0 else -1, base + lp)
        return tree


def acceptance_profile(steps, depth: int, width: int = 16) -> list[list[float]]:
    """Positional acceptance profile for :class:`SequoiaBuilder` from ``(lattice, target tokens)`` pairs.

    For each step, walk the target's tokens down the lattice: at depth d the target token's rank among
    ``children(path)`` is counted (stop at the first miss). ``profile[d][r]`` = count(rank r at d) /
    count(reached d); rows never reached copy the previous row.
    """
    hits = [[0] * width for _ in range(depth)]
    reached = [0] * depth
    for lat, target in steps:
        path: tuple[int, ...] = ()
        for d in range(min(depth, lat.depth, len(target))):
            reached[d] += 1
            ranks = [t for t, _ in lat.children(path)][:width]
            if target[d] not in ranks:
                break
            hits[d][ranks.index(target[d])] += 1
            path += (target[d],)
    prof: list[list[float]] = []
    for d in range(depth):
        prof.append([h / reached[d] for h in hits[d]] if reached[d] else (prof[-1] if prof else [0.5 ** (r + 1) for r in range(width)]))
    return prof


#: The registry of tree builders (read-only). ``sequoia`` here has the generic geometric profile; a measured
#: one is passed to :func:`build_tree` as a :class:`SequoiaBuilder` of its own (the replay table does).
BUILDERS = MappingProxyType({"chain": build_chain, "best_first": build_best_first,
                             "ddtree_marginal": build_ddtree_marginal, "eagle2_topk": build_eagle2_topk,
                             "sequoia": SequoiaBuilder()})


def build_tree(kind: str, lattice: Lattice, nodes: int, sequoia: SequoiaBuilder | None = None) -> Tree:
    """Dispatch to a builder by name (see :data:`BUILDERS`); ``sequoia`` replaces the default ``sequoia``
    builder (a measured acceptance profile). Raises KeyError for an unknown name."""
    if kind == "sequoia" and sequoia is not None:
        return sequoia(lattice, nodes)
    return BUILDERS[kind](lattice, nodes)
