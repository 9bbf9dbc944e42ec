"""The n-gram drafter's incremental index equals the plain prompt-lookup reference."""

import random

import pytest

from specpilot.spec.ngram import NgramDrafter, ngram_continuations_reference
from specpilot.spec.drafter import propose_one


@pytest.mark.parametrize("seed", range(6))
def test_index_equals_reference_as_a_request_grows(seed):
    rng = random.Random(seed)
    lo = rng.randint(1, 3)
    hi = rng.randint(lo, 6)
    matches = rng.randint(1, 8)
    vocab = rng.choice([2, 3, 5, 20])  # small vocabularies: many matches, long repeats
    d = NgramDrafter(hi, lo, max_matches=matches)
    committed = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
    found = 0
    while len(committed) < 300:
        depth = rng.randint(1, 8)
        want = ngram_continuations_reference(committed, depth, hi, lo, matches)
        assert d.continuations(committed, depth) == want
        lattice = propose_one(d, committed, depth)
        assert (lattice is None) == (not want)
        found += bool(want)
        committed += [rng.randrange(vocab) for _ in range(rng.randint(1, 7))]  # an accepted path + bonus
    assert found > 10  # the comparison saw real matches, not only empty lists


def test_a_new_sequence_without_reset_rebuilds_the_index():
    d = NgramDrafter(3, 1, max_matches=4)
    a = [1, 2, 3, 1, 2, 3, 1, 2]
    assert d.continuations(a, 4) == ngram_continuations_reference(a, 4, 3, 1, 4) != []
    b = [7, 8, 9, 7, 8]  # shorter, unrelated: the old index must not leak into it
    assert d.continuations(b, 4) == ngram_continuations_reference(b, 4, 3, 1, 4) == [[9, 7, 8]]
    c = [7, 8, 5, 7, 8, 1, 2]  # same length prefix as b, different tokens
    assert d.continuations(c, 4) == ngram_continuations_reference(c, 4, 3, 1, 4)
    d.reset()
    assert d.continuations([4], 4) == [] and d.continuations([4, 4], 0) == []


@pytest.mark.parametrize("lo,hi,matches", [(0, 4, 4), (3, 2, 4), (1, 4, 0)])
def test_bad_parameters_are_refused(lo, hi, matches):
    with pytest.raises(ValueError, match="ngram_min"):
        NgramDrafter(hi, lo, max_matches=matches)
