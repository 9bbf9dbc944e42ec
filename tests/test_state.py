"""A request's target state has one writer, and a pass kind says what it may write.

- Only the cache modules (:mod:`specpilot.model.cache`, and :mod:`specpilot.model.hybrid_cache` for hybrid targets)
  assign a cache length (read from the source, so a new writer anywhere in the package fails here), and only the
  request loop commits the target's (:class:`KVCache.commit`).
- An ``INSPECT`` pass (TLV's Q pass) gives the hidden states of the ``EXACT`` pass over the same rows and leaves
  the cache bit for bit as it was.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import specpilot
from specpilot.model.cache import PassKind

from .test_tree_attention import tree_mask_from_parents

PACKAGE = Path(specpilot.__file__).parent


def _length_writers():
    """``(file, line)`` of every assignment to an attribute named ``length`` or ``_length`` in the package."""
    out = []
    for f in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(el, ast.Attribute) and el.attr in ("length", "_length"):
                        out.append((str(f.relative_to(PACKAGE)), node.lineno))
    return out


def test_only_the_cache_module_writes_cache_lengths():
    writers = _length_writers()
    assert writers and all(f in ("model/cache.py", "model/hybrid_cache.py") for f, _ in writers), writers


def test_only_the_request_loop_commits_the_target_cache():
    """``commit`` on a target cache is called from the request loops alone (engine/engine.py, engine/batch.py; a draft
    model commits its own private cache, and the batched pilot's pass timing commits the prefix of a pool it made for
    itself, pilot/batch_budget.py)."""
    callers = []
    for f in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "commit"):
                continue
            owner = node.func.value  # ``x.cache.commit(...)`` or ``pool.cache(slot).commit(...)``
            if isinstance(owner, ast.Call):
                owner = owner.func
            if isinstance(owner, ast.Attribute) and owner.attr == "cache":
                callers.append(str(f.relative_to(PACKAGE)))
    assert set(callers) == {"engine/engine.py", "engine/batch.py", "spec/draft_model.py", "pilot/batch_budget.py"}, \
        callers


def test_commit_refuses_a_length_outside_the_cache(tiny_models):
    cache = tiny_models[0].new_cache(8)
    cache.commit(8)
    assert cache.length == 8
    with pytest.raises(ValueError, match="cannot commit 9 slots"):
        cache.commit(9)
    with pytest.raises(AttributeError):
        cache.length = 3  # read-only: commit() is the way


@pytest.mark.parametrize("tree", [False, True])
def test_inspect_pass_equals_exact_and_writes_nothing(tiny_models, tree):
    model = tiny_models[0]
    prompt = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(5))
    cache = model.new_cache(24)
    model.forward(prompt, torch.arange(9), cache, 0)  # the committed prefix
    toks = torch.tensor([5, 7, 9, 11, 13, 15])
    if tree:
        parents = [-1, 0, 0, 1, 2, 1]
        depth = torch.tensor([0, 1, 1, 2, 2, 2])
        mask = torch.ones(6, 15, dtype=torch.bool)
        mask[:, 9:] = tree_mask_from_parents(parents)
    else:
        depth, mask = torch.arange(6), None
    k0, v0 = cache.k.clone(), cache.v.clone()
    inspect = model.forward(toks, 9 + depth, cache, 9, mask, kind=PassKind.INSPECT)
    assert torch.equal(cache.k, k0) and torch.equal(cache.v, v0)  # not one bit written, scratch slots included
    exact = model.forward(toks, 9 + depth, cache, 9, mask, kind=PassKind.EXACT)
    assert torch.equal(inspect, exact)
    assert not torch.equal(cache.k[:, 9:15], k0[:, 9:15])  # the exact pass did write its rows
