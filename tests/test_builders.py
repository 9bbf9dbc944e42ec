"""Tree builder invariants on random lattices: prefix-closed, ≤ N nodes, depth ≤ lattice depth, and
best_first exactly best-first (checked against brute-force enumeration of every path)."""

from __future__ import annotations

import itertools

import pytest
import torch

from specpilot.spec.lattice import MarkovLattice, PositionalLattice, TrieLattice
from specpilot.spec.trees import BUILDERS, SequoiaBuilder, acceptance_profile, build_best_first, build_tree


def positional(depth=5, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(depth, 50, generator=g) * 2, -1)
    logp, tok = lp.topk(k, -1)
    return PositionalLattice(tok, logp)


def markov(depth=5, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(depth, 50, generator=g) * 2
    u, v = torch.randn(50, 3, generator=g), torch.randn(3, 50, generator=g)
    marg, tok = base.log_softmax(-1).topk(k, -1)
    parents = torch.cat((torch.full((1, k), 7), tok[:-1]), 0)
    cond = (base[:, None, :] + u[parents] @ v).log_softmax(-1).gather(-1, tok[:, None, :].expand(-1, k, -1))
    return MarkovLattice(tok, marg, cond, 7, k)


def trie(depth=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    conts = [torch.randint(0, 4, (depth,), generator=g).tolist() for _ in range(9)]
    return TrieLattice(conts, depth)


LATTICES = [positional(seed=s) for s in range(3)] + [markov(seed=s) for s in range(3)] + [trie(seed=s) for s in range(3)]


def check_tree(tree, lat, nodes):
    assert len(tree) <= nodes
    seen = set()
    for i, (tok, p, d) in enumerate(zip(tree.tokens, tree.parents, tree.depths)):
        assert p < i  # topological
        assert d == (1 if p < 0 else tree.depths[p] + 1) and d <= lat.depth
        parent_path = tree.path(p) if p >= 0 else ()
        assert tok in {t for t, _ in lat.children(parent_path)} | {t for t, _ in lat.marginal(parent_path)}
        assert tree.path(i) not in seen  # no duplicate sibling
        seen.add(tree.path(i))


@pytest.mark.parametrize("builder", sorted(BUILDERS))
@pytest.mark.parametrize("nodes", [1, 3, 8, 20, 200])
def test_invariants(builder, nodes):
    for lat in LATTICES:
        tree = build_tree(builder, lat, nodes)
        check_tree(tree, lat, nodes)
        assert len(tree) > 0


@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_chain_first_keeps_the_tree_and_its_acceptance(builder):
    """Tree.chain_first: the same set of token paths, still a valid tree, the top chain (best-scored child at each
    level) at nodes 0, 1, 2, ...; greedy acceptance gives the same tokens for any exact pass."""
    import random

    rng = random.Random(0)
    for lat in LATTICES:
        tree = build_tree(builder, lat, 20)
        moved = tree.chain_first()
        check_tree(moved, lat, 20)
        assert sorted(map(moved.path, range(len(moved)))) == sorted(map(tree.path, range(len(tree))))
        row, k = 0, 0
        while True:  # nodes 0..k-1 are the chain: node k's parent is k - 1, and it is the best child there
            kids = [i for i, p in enumerate(moved.parents) if p == row - 1]
            if not kids:
                break
            assert moved.parents[k] == k - 1 and moved.scores[k] == max(moved.scores[i] for i in kids)
            row, k = k + 1, k + 1
        for _ in range(20):
            table: dict = {}
            oracle = lambda path: table.setdefault(path, rng.choice([t for t, _ in lat.marginal(path)] + [-1]))  # noqa: E731
            argmax = lambda t: [oracle(())] + [oracle(t.path(i)) for i in range(len(t))]  # noqa: E731
            assert tree.accept(argmax(tree))[1] == moved.accept(argmax(moved))[1]


def all_paths(lat, kids):
    out = []
    def walk(path, score):
        if len(path) >= lat.depth:
            return
        for t, lp in kids(path):
            out.append((score + lp, path + (t,)))
            walk(path + (t,), score + lp)
    walk((), 0.0)
    return out


@pytest.mark.parametrize("nodes", [1, 5, 17, 40])
def test_best_first_is_exactly_best_first(nodes):
    for lat in LATTICES:
        paths = all_paths(lat, lat.children)
        best = sorted((s for s, _ in paths), reverse=True)[:nodes]
        tree = build_best_first(lat, nodes)
        assert len(tree) == min(nodes, len(paths))
        torch.testing.assert_close(torch.tensor(sorted(tree.scores, reverse=True)), torch.tensor(best))
        got = {tree.path(i): s for i, s in enumerate(tree.scores)}
        ref = dict((p, s) for s, p in paths)
        for p, s in got.items():
            assert abs(ref[p] - s) < 1e-9  # scores are Σ log p(child | parent) of the path


def test_ddtree_marginal_and_chain():
    for lat in LATTICES[:3] + LATTICES[6:]:  # no Markov head: marginal == conditioned
        assert build_tree("ddtree_marginal", lat, 12).tokens == build_best_first(lat, 12).tokens
    lat = LATTICES[3]
    paths = all_paths(lat, lat.marginal)
    best = sorted((s for s, _ in paths), reverse=True)[:12]
    torch.testing.assert_close(torch.tensor(sorted(build_tree("ddtree_marginal", lat, 12).scores, reverse=True)), torch.tensor(best))
    chain = build_tree("chain", lat, 10)
    assert len(chain) == lat.depth and all(d == i + 1 for i, d in enumerate(chain.depths))
    for i in range(len(chain)):  # each step is the conditioned top-1 given the chosen parent
        assert chain.tokens[i] == lat.children(chain.path(i - 1) if i else ())[0][0]


def test_eagle2_topk_keeps_global_best_of_its_pool():
    lat = positional(depth=4, k=6, seed=3)
    tree = build_tree("eagle2_topk", lat, 10)
    # its pool: top-4 children of the 4 best nodes per depth; kept = 10 best of the pool
    pool, frontier = [], [((), 0.0)]
    for _ in range(lat.depth):
        new = [(s + lp, p + (t,)) for p, s in frontier for t, lp in lat.children(p)[:4]]
        pool += new
        frontier = [(p, s) for s, p in sorted(new, key=lambda x: -x[0])[:4]]
    best = sorted((s for s, _ in pool), reverse=True)[:10]
    torch.testing.assert_close(torch.tensor(sorted(tree.scores, reverse=True)), torch.tensor(best))


def test_sequoia_shape_follows_profile():
    lat = positional(depth=6, k=4, seed=1)
    chain_like = SequoiaBuilder([[1.0, 0.0, 0.0, 0.0]] * 6)
    tree = chain_like(lat, 10)
    assert tree.tokens == build_tree("chain", lat, 6).tokens
    wide = SequoiaBuilder([[0.4, 0.3, 0.2, 0.1]] * 6)
    t2 = wide(lat, 8)
    assert len(t2) == 8 and sum(d == 1 for d in t2.depths) >= 2
    # the profile measured on steps where the target always takes rank 1 puts all mass on rank 1
    steps = [(lat, [lat.children(())[1][0]] + [lat.children((0,) * k)[1][0] for k in range(1, 6)])]
    prof = acceptance_profile(steps, 6, width=4)
    assert all(row[1] == 1.0 and row[0] == 0.0 for row in prof)
