"""The certified head's bf16 first pass on the CPU (:mod:`specpilot.head.cpu`): its bound encloses the exact head's
logits, its candidate search finds exactly the survivors of a plain evaluation over every logit, and an engine with
the certified head gives the plain engine's tokens (the argmax cases themselves, ties and near-ties, run through it
in ``test_lm_head_int8.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specpilot.head.bound import eps
from specpilot.head.certified import CertifiedInt8Head
from specpilot.head.cpu import BLOCK, Bf16FirstPass, applies

pytestmark = pytest.mark.skipif(not applies(torch.ones(1, 1)), reason="this build cannot prepack for oneDNN")
EPS_X = eps(128, 0.0, 2.0**-24, 0.0)


def _weights(v=3001, k=128, seed=0):
    """A head with an outlier element, an all-zero row, a tiny row (bf16 denormals) and ``v`` not a multiple of the
    search's block (a tail block)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, k, generator=g) * 0.05
    w[7, 3], w[11] = 4.0, 0.0
    w[12] = 1e-39
    assert v % BLOCK
    return w, g


@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0, 1e5])
def test_the_bound_encloses_the_exact_heads_logits(scale):
    w, g = _weights()
    fp = Bf16FirstPass(w, w.double().norm(dim=1))
    h = torch.randn(24, 128, generator=g) * scale
    h[0] = w[7] * 3  # the outlier row wins
    a = fp.logits(h).double()
    x = h.bfloat16().double().norm(dim=1)[:, None]
    y = (h.double() - h.bfloat16().double()).norm(dim=1)[:, None] + EPS_X * h.double().norm(dim=1)[:, None]
    e = 2.0**-8 * a.abs() + x * fp.coef[0].double() + y * fp.coef[1].double()
    for exact in (F.linear(h, w), h @ w.T, (h.double() @ w.double().T)):  # two float32 orders, and real values
        err = (exact.double() - a).abs()
        assert bool((err <= e).all())
    assert float((err / e).max()) > 1e-2  # not vacuous


@pytest.mark.parametrize("rows", [1, 8, 33])
def test_the_candidate_search_finds_every_survivor(rows):
    w, g = _weights(seed=rows)
    w[6] = w[5]
    w[6, 0] += 1e-5
    fp = Bf16FirstPass(w, w.double().norm(dim=1))
    h = torch.randn(rows, 128, generator=g) * 20
    h[0] = w[5] * 400  # two near-equal leaders
    if rows > 1:
        h[1] = w[-1] * 300  # the winner in the tail block
    cols, keep = fp.survivors(h, EPS_X)
    want = fp.survivors_reference(h, EPS_X)
    got = torch.zeros_like(want)
    got[:, cols] = keep
    assert torch.equal(got, want)
    assert bool(want[torch.arange(rows), F.linear(h, w).argmax(1)].all())
    assert int(keep[0].sum()) >= 2 and (rows == 1 or bool(keep[1, -1]) and cols[-1] == w.shape[0] - 1)
    assert int(want.sum()) < 0.01 * rows * w.shape[0]  # the pass discards most of the vocabulary


def test_a_row_with_non_finite_logits_keeps_nothing():
    w, g = _weights()
    fp = Bf16FirstPass(w, w.double().norm(dim=1))
    h = torch.randn(3, 128, generator=g)
    h[1, 0] = float("nan")
    cols, keep = fp.survivors(h, EPS_X)
    assert not bool(keep[1].any()) and bool(keep[0].any()) and bool(keep[2].any())


def test_undecided_rows_take_the_engines_own_head():
    """A near-tie the bound cannot settle goes to ``full``: the GEMM the engine runs, not the reference's."""
    from tests.test_lm_head_int8 import real_tie_weights

    w, h = real_tie_weights(torch.float32)
    head = CertifiedInt8Head(w)
    assert head.cpu_first_pass is not None
    calls = []

    def full(x):
        calls.append(x.shape[0])
        return torch.full((x.shape[0],), 3, dtype=torch.long)  # a marker no pair row would give

    got = head.argmax(h, full=full)
    assert calls == [h.shape[0]] and head.stats.undecided_rows > 0
    assert int((got == 3).sum()) == head.stats.undecided_rows


def test_refuses_what_it_cannot_serve():
    with pytest.raises(ValueError, match="float32 CPU head"):
        Bf16FirstPass(torch.ones(4, 4, dtype=torch.bfloat16), torch.ones(4, dtype=torch.float64))
    assert CertifiedInt8Head(torch.randn(10, 8).bfloat16()).cpu_first_pass is None
    assert CertifiedInt8Head(torch.randn(10, 8), cpu_first_pass=False).cpu_first_pass is None
