"""The shared node budget (§4.4): one step's node budget filled best-first across every request's lattice.

Instead of giving each of n requests its own tree of N nodes, a batched step verifies the ``budget`` nodes of
highest path log-probability Σ log p(child | parent) among ALL requests' candidate paths: one max-heap over
every request's frontier. A confident request (steep lattice) gets more nodes, an unsure one (flat lattice)
fewer. Each request's share is the first nodes of its own best-first order, hence exactly
``build_best_first(lattice, len(share))``: a prefix-closed tree of depth at most its lattice's depth, with at
most the lattice's candidates (its top-K) under each node. Only which rows are verified changes, so decoding
stays lossless.
"""

from __future__ import annotations

import heapq

from specpilot.spec.lattice import Lattice
from specpilot.spec.trees import Tree


def build_shared(lattices: list[Lattice | None], budget: int) -> list[Tree]:
    """Trees of a shared node budget (§4.4): at most ``budget`` nodes in all, best-first across the lattices.

    Args:
        lattices: one per request of the step, in the step's order (``None``: the request drafts nothing and
            gets an empty tree).
        budget: nodes verified in the step in all (roots excluded), ≥ 0.
    Returns:
        One :class:`Tree` per lattice; ``sum(len(t)) <= budget``. Ties in path score go to the candidate pushed
        first (earlier requests' first-position candidates before later ones'), so with one lattice this is
        exactly :func:`~specpilot.spec.trees.build_best_first`.
    Raises:
        ValueError: ``budget < 0``.
    """
    if budget < 0:
        raise ValueError(f"a step's node budget is at least 0, got {budget}")
    trees = [Tree() for _ in lattices]
    heap: list[tuple[float, int, int, int, int]] = []  # (-path score, seq, request, parent node, token)
    seq = 0
    for r, lat in enumerate(lattices):
        if lat is None:
            continue
        for tok, lp in lat.children(()):
            heap.append((-lp, seq, r, -1, tok))
            seq += 1
    heapq.heapify(heap)
    placed = 0
    while heap and placed < budget:
        neg, _, r, parent, tok = heapq.heappop(heap)
        tree, lat = trees[r], lattices[r]
        i = tree.add(tok, parent, -neg)
        placed += 1
        if tree.depths[i] >= lat.depth:
            continue
        for ctok, lp in lat.children(tree.path(i)):
            heapq.heappush(heap, (neg - lp, seq, r, i, ctok))
            seq += 1
    return trees


def build_shared_reference(lattices: list[Lattice | None], budget: int) -> list[Tree]:
    """Plain reference of :func:`build_shared` (for tests): enumerate every request's candidate paths with their
    scores, keep the ``budget`` best by (score descending, then each request's own best-first rank, then request
    order), and rebuild each request's share as the best-first tree of that many nodes.

    Equal to :func:`build_shared` whenever path scores do not tie across requests (ties between requests are
    broken differently: by request order here, by push order there). Exponential in depth: small lattices only.
    """
    from specpilot.spec.trees import build_best_first

    ranked = []  # (-score, request, rank in its own best-first order)
    full = []
    for r, lat in enumerate(lattices):
        if lat is None:
            full.append(None)
            continue
        paths, stack = [], [((), 0.0)]
        while stack:
            path, score = stack.pop()
            if len(path) < lat.depth:
                for tok, lp in lat.children(path):
                    paths.append(score + lp)
                    stack.append((path + (tok,), score + lp))
        full.append(len(paths))
        for rank, s in enumerate(build_best_first(lat, len(paths)).scores):
            ranked.append((-s, r, rank))
    ranked.sort()
    share = [0] * len(lattices)
    for _, r, _ in ranked[:budget]:
        share[r] += 1
    return [build_best_first(lat, share[r]) if lat is not None else Tree() for r, lat in enumerate(lattices)]
