"""Triton certified INT8 LM head (specpilot.head.kernel, §4.1) against float64 and the engine's exact head.

CPU: the Triton interpreter (small shapes: V ~1000-3000, K 64-256); CUDA: compiled.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from .tritonutil import DEV, triton  # noqa: F401

from specpilot.head.bound import eps, fp32_reduction
from specpilot.head.certified import CertifiedInt8Head
from specpilot.head.kernel import Int8HeadKernel

from .test_lm_head_int8 import real_tie_weights


def exact_argmax(h, w):
    """The exact head and argmax (``Transformer.logits``' GEMM reducing in float32, as the bound assumes), over all
    rows at once. The process's cuBLAS flags are left as they are: the head scopes its own exact GEMMs."""
    with fp32_reduction(w.device):
        return F.linear(h.to(w.dtype), w).float().argmax(dim=-1)


def make(v, k, dtype, seed, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(v, k, generator=g) * scale).to(DEV, dtype)
    return w, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v,k,r", [(1000, 96, 1), (2048, 128, 5), (3001, 256, 17), (1500, 64, 40)])
def test_bounds_enclose_float64(dtype, v, k, r):
    w, g = make(v, k, dtype, seed=v + k + r)
    w[3, 5] = 2.0  # an outlier row (coarse scale)
    head = CertifiedInt8Head(w)
    kern = Int8HeadKernel(head, block_v=64, block_k=64)
    h = (torch.randn(r, k, generator=g) * 5).to(DEV, dtype)
    u, lmax, a, hn = kern.bounds(h, write_a=True)
    h64 = h.double()
    # the INT8 logits against float64 (products and sums exact to ~1e-16): within the kernel's own rounding
    a64 = (h64 @ head.q.double().T) * head.scale.double()
    eps_a = eps(k, 0.0, 2.0**-23, 2.0**-24)
    tol = eps_a * head.scale.double() * head.q_norm * h64.norm(dim=1, keepdim=True) + 1e-30
    assert bool(((a.double() - a64).abs() <= tol).all())
    # U and the per-block max of L enclose the engine's exact logits
    z = F.linear(h, w).double()
    assert bool((u.double() >= z).all())
    nb = lmax.shape[1]
    zpad = torch.full((r, nb * 64), -float("inf"), dtype=torch.float64, device=z.device)
    zpad[:, :v] = z
    assert bool((lmax.double() <= zpad.view(r, nb, 64).amax(-1)).all())
    assert hn.dtype == torch.float32 and bool((hn.double() >= h64.norm(dim=1)).all())
    # not vacuous: the bound is a small fraction of the logits' spread
    assert float((u.double() - a.double()).median()) < 0.5 * float(z.std())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_random(dtype):
    w, g = make(2500, 128, dtype, seed=11)
    head = CertifiedInt8Head(w, use_kernel=True)
    kern = head.kernel()
    for r, scale in ((1, 1.0), (7, 30.0), (33, 3.0)):
        h = (torch.randn(r, 128, generator=g) * scale).to(DEV, dtype)
        tok, ok = kern(h)
        ref = exact_argmax(h, w)
        assert tok.dtype == torch.int64 and ok.dtype == torch.bool and tok.shape == ok.shape == (r,)
        assert bool(ok.any())
        assert torch.equal(tok[ok], ref[ok])
        assert torch.equal(head.argmax(h), ref)  # flagged rows settled by the full head
        assert int(kern.last_survivors.max()) >= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planted_duplicates_lowest_index(dtype):
    w, g = make(1000, 64, dtype, seed=2)
    for v in (500, 10, 900):
        w[v] = w[123]
    head = CertifiedInt8Head(w, use_kernel=True)
    h = torch.stack([w[123].float() * c for c in (1.0, 50.0, 1e4)] + [torch.randn(64, generator=g).to(DEV)]).to(dtype)
    tok, ok = head.kernel()(h)
    ref = exact_argmax(h, w)
    assert ref[:3].tolist() == [10, 10, 10]
    assert torch.equal(tok[ok], ref[ok])
    assert torch.equal(head.argmax(h), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_arithmetic_ties(dtype):
    """Pairs equal in real arithmetic, summed in different orders: float32 rows must be flagged (the engine's
    own rounding decides them), bf16 outputs of a pair round to the same value (decided: lowest index)."""
    w, h = real_tie_weights(dtype, n=40, k=128)
    w, h = w.to(DEV), h.to(DEV)
    head = CertifiedInt8Head(w, use_kernel=True)
    tok, ok = head.kernel()(h)
    ref = exact_argmax(h, w)
    assert torch.equal(tok[ok], ref[ok])
    assert torch.equal(head.argmax(h), ref)
    if dtype == torch.float32 and DEV == "cpu":
        assert not bool(ok.all())


def test_one_ulp_nudges():
    g = torch.Generator().manual_seed(7)
    base = torch.randn(40, 128, generator=g) * 0.05
    nudged = base.clone()
    j = torch.randint(0, 128, (40,), generator=g)
    nudged[torch.arange(40), j] = torch.nextafter(base[torch.arange(40), j], torch.ones(40))
    w = torch.cat([torch.stack([base, nudged], 1).reshape(80, 128), torch.randn(900, 128, generator=g) * 0.05]).to(DEV)
    h = (base * 20 + torch.randn(40, 128, generator=g) * 0.01).to(DEV)
    head = CertifiedInt8Head(w, use_kernel=True)
    tok, ok = head.kernel()(h)
    ref = exact_argmax(h, w)
    assert torch.equal(tok[ok], ref[ok])
    assert torch.equal(head.argmax(h), ref)
    assert bool((ref // 2 == torch.arange(40, device=ref.device)).all())


def test_overflow_and_non_finite_rows_flagged():
    w, g = make(1200, 64, torch.float32, seed=5)
    head = CertifiedInt8Head(w, use_kernel=True, capacity=16)
    h = torch.randn(5, 64, generator=g).to(DEV)
    h[1] = 0.0  # every logit 0: 1200 survivors > capacity -> flagged; the exact head says index 0
    h[2, 3] = float("nan")
    h[3, 0] = float("inf")
    h[4] *= 1e37  # the exact head could overflow
    tok, ok = head.kernel()(h)
    assert ok.tolist() == [True, False, False, False, False]
    assert int(head.kernel().last_survivors[1]) == 1200
    assert torch.equal(head.argmax(h), exact_argmax(h, w))
    assert head.stats.undecided_rows == 4 and head.stats.full_head_calls == 1
    ids, needs = head.argmax_flagged(h)  # the graph form: the same flags, explicitly, and valid ids throughout
    assert needs.dtype == torch.bool and ids.dtype == torch.int64 and ids.device == needs.device == h.device
    assert needs.tolist() == [False, True, True, True, True]
    assert int(ids[0]) == int(exact_argmax(h, w)[0]) and bool(((ids >= 0) & (ids < 1200)).all())


def test_kernel_errors():
    head = CertifiedInt8Head(torch.randn(100, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="bf16 or float32"):
        Int8HeadKernel(head)
    head = CertifiedInt8Head(torch.randn(100, 32))
    with pytest.raises(ValueError, match="capacity"):
        Int8HeadKernel(head, capacity=24)
    with pytest.raises(ValueError, match=r"\[R, 32\]"):
        Int8HeadKernel(head)(torch.randn(2, 31))


def test_many_rows_take_the_full_head():
    w, g = make(500, 32, torch.float32, seed=9)
    head = CertifiedInt8Head(w, use_kernel=True)
    h = torch.randn(70, 32, generator=g).to(DEV)
    assert torch.equal(head.argmax(h), exact_argmax(h, w)) and head.stats.full_head_calls == 1
    ids, needs = head.argmax_flagged(h)
    assert torch.equal(ids, exact_argmax(h, w)) and needs.shape == (70,) and not bool(needs.any())
