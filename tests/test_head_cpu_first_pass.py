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
    assert head._int8 is None  # the bf16 pass never reads the int8 copy: it was not built
    assert head.q.dtype == torch.int8 and head._int8 is not None  # built on first use


def test_refuses_what_it_cannot_serve():
    with pytest.raises(ValueError, match="float32 CPU head"):
        Bf16FirstPass(torch.ones(4, 4, dtype=torch.bfloat16), torch.ones(4, dtype=torch.float64))
    assert CertifiedInt8Head(torch.randn(10, 8).bfloat16()).cpu_first_pass is None
    assert CertifiedInt8Head(torch.randn(10, 8), cpu_first_pass=False).cpu_first_pass is None


def test_denormal_hidden_components_are_in_the_bound():
    """AVX512-BF16 reads denormal inputs as zero: a vocab row fed only by h's denormal components times a large
    weight (2^30) must not be discarded (it was, before the bound carried 2^-120 sqrt(K) ||W_v||)."""
    k = 1024
    h = torch.full((1, k), 127 * 2.0**-133)  # the largest bf16 subnormal, float32-exact
    h[0, 0] = 2.0**-126
    w = torch.zeros(2, k)
    w[0, 0] = 2.0**30
    w[1, 1:] = 2.0**30
    head = CertifiedInt8Head(w)
    want = F.linear(h, w).argmax(-1)
    assert want.tolist() == [1]
    assert torch.equal(head.argmax(h, full=lambda x: F.linear(x, w).argmax(-1)), want)
    fp = head.cpu_first_pass
    eps_x = eps(k, 0.0, 2.0**-24, 0.0)
    assert bool(fp.survivors_reference(h, eps_x)[0, 1])


def test_the_search_threshold_carries_the_bounds_own_inflation():
    """h tuned so that the threshold sits within 2^-48 |top| of a candidate's logit (0): the search must still find
    what the plain evaluation keeps (its threshold once left out the bound's (1 + 2^-40) on 2^-8 |a|)."""
    import struct

    from specpilot.head.cpu import _FLOOR, _REL_A, _row_terms

    m, k = 256, 256 * 2 + 3
    g = torch.Generator().manual_seed(0)
    wv = torch.randn(m, generator=g)
    w = torch.zeros(2, k)
    w[0, :m], w[1, m:2 * m] = wv, wv
    fp = Bf16FirstPass(w, w.double().norm(dim=1))
    eps_x = eps(k, 0.0, 2.0**-24, 0.0)
    h = torch.zeros(1, k)
    h[0, :m] = wv.bfloat16().float() + 0.3 * torch.randn(m, generator=g)

    def gap(h):  # the threshold's distance above 0 as the search computed it before, and the top logit
        top = float(fp.logits(h).float().max())
        x, y = (float(t) for t in _row_terms(h, eps_x))
        b = (x * fp.cmax + y * fp.wmax + _FLOOR) * (1 + 2.0**-40)
        return top - (_REL_A * abs(top) + b) - b, top

    f32 = lambda v: struct.unpack("f", struct.pack("f", v))[0]  # noqa: E731
    for j, hi in zip(range(2 * m, k), (1e4, 1e2, 1e0)):  # bisect three free coordinates, coarse to fine
        lo_v, hi_v = 0.0, hi
        for _ in range(200):
            mid = f32((lo_v + hi_v) / 2)
            if mid in (lo_v, hi_v):
                break
            h[0, j] = mid
            lo_v, hi_v = (mid, hi_v) if gap(h)[0] > 0 else (lo_v, mid)
        h[0, j] = lo_v
    t, top = gap(h)
    assert 0 < t < 2.0**-40 * top  # the case is built
    want = fp.survivors_reference(h, eps_x)
    cols, keep = fp.survivors(h, eps_x)
    got = torch.zeros_like(want)
    got[:, cols] = keep
    assert torch.equal(got, want) and bool(want[0, 1])
