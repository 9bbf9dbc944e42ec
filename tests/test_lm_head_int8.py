"""The certified INT8 LM head (§4.1): its argmax equals the exact head's on random, adversarial and real inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specpilot.errors import SpecPilotError
from specpilot.head.certified import CertifiedInt8Head


def reference(h, w):
    """The engine's exact head (``Transformer.logits``) and argmax, over all rows at once."""
    return F.linear(h.to(w.dtype), w).float().argmax(dim=-1)


@pytest.fixture(params=[None, False], ids=["default_pass", "int8_reference"])
def first_pass(request):
    """The head's first pass: the default (float32 on the CPU: the bf16 pass of :mod:`specpilot.head.cpu`), and the
    INT8 reference."""
    return request.param


def check(head, h):
    got = head.argmax(h)
    assert got.dtype == torch.long and got.shape == (h.shape[0],)
    assert torch.equal(got, reference(h, head.weight))
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_inputs(dtype, first_pass):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(3000, 96, generator=g) * 0.05).to(dtype)
    head = CertifiedInt8Head(w, cpu_first_pass=first_pass)
    for scale in (1.0, 30.0):
        h = (torch.randn(64, 96, generator=g) * scale).to(dtype)
        check(head, h)
    assert head.stats.rows == 128
    assert (head.cpu_first_pass is not None) == (first_pass is None and dtype == torch.float32)  # the CPU's bf16 pass
    assert head.stats.survivors < 0.1 * 128 * 3000  # the INT8 pass discards most of the vocabulary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bound_holds(dtype):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(2000, 128, generator=g) * 0.05).to(dtype)
    w[7, 3] = 4.0  # an outlier row: coarse scale
    head = CertifiedInt8Head(w)
    h = (torch.randn(32, 128, generator=g) * 10).to(dtype)
    a, e = head.bounds(h)
    err = (head.exact_logits(h).double() - a.double()).abs()
    assert bool((err <= e).all())
    assert float((err / e).max()) > 1e-3  # the bound is not vacuous...
    assert float(e.median() / head.exact_logits(h).abs().median()) < 0.5  # ...nor useless


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planted_exact_ties_lowest_index(dtype, first_pass):
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(1000, 64, generator=g) * 0.05).to(dtype)
    for v in (500, 10, 900):
        w[v] = w[123]
    head = CertifiedInt8Head(w, cpu_first_pass=first_pass)
    h = torch.stack([w[123].float() * c for c in (1.0, 50.0, 1e4)] + [torch.randn(64, generator=g)]).to(dtype)
    got = check(head, h)
    assert got[:3].tolist() == [10, 10, 10]


def real_tie_weights(dtype, n=80, k=256, seed=3):
    """Rows (2i, 2i+1) = A_i and A_i with adjacent elements swapped; h_i has equal adjacent pairs and points
    at A_i. So <A_i, h_i> = <B_i, h_i> in real arithmetic, but the float sums run in different orders."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, k, generator=g) * 0.05
    b = a.view(n, k // 2, 2).flip(-1).reshape(n, k)
    w = torch.cat([torch.stack([a, b], 1).reshape(2 * n, k), torch.randn(500, k, generator=g) * 0.05]).to(dtype)
    hp = a.view(n, k // 2, 2).mean(-1) * 20 + torch.randn(n, k // 2, generator=g) * 0.01
    return w, hp.repeat_interleave(2, dim=1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adversarial_near_ties(dtype, first_pass):
    """Planted real-arithmetic ties: the engine's float32 values differ by rounding, and in float32 it picks
    the higher index of a pair in some rows, so neither real values nor "lowest index" decide; the certified
    head must find these rows undecided and settle them with the engine's own computation."""
    w, h = real_tie_weights(dtype)
    head = CertifiedInt8Head(w, cpu_first_pass=first_pass)
    got = check(head, h)
    assert bool((got // 2 == torch.arange(h.shape[0])).all())  # each row's argmax is one of its pair
    if dtype == torch.float32:
        assert int((got % 2).sum()) > 0  # measured 11 of 80 rows pick the higher index
        assert head.stats.undecided_rows > 0 and head.stats.full_head_calls == 1
    else:  # bf16 outputs of a pair round to the same value: known exactly, decided by lowest index
        assert int((got % 2).sum()) == 0


def test_one_ulp_nudges(first_pass):
    """Pairs equal but for one element moved by one ulp (real gap ~1e-9 relative)."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(60, 256, generator=g) * 0.05
    nudged = base.clone()
    j = torch.randint(0, 256, (60,), generator=g)
    nudged[torch.arange(60), j] = torch.nextafter(base[torch.arange(60), j], torch.ones(60))
    w = torch.cat([torch.stack([base, nudged], 1).reshape(120, 256), torch.randn(500, 256, generator=g) * 0.05])
    h = base * 20 + torch.randn(60, 256, generator=g) * 0.01
    got = check(CertifiedInt8Head(w, cpu_first_pass=first_pass), h)
    assert bool((got // 2 == torch.arange(60)).all())


def test_no_full_head_without_near_ties(first_pass):
    """Clear winners: no row is undecided, no full head is computed."""
    w, h = real_tie_weights(torch.float32)
    w[1:160:2] *= 0.5  # pair partners are now far below
    head = CertifiedInt8Head(w, cpu_first_pass=first_pass)
    check(head, h)
    assert head.stats.undecided_rows == 0 and head.stats.full_head_calls == 0


def test_outlier_rows_and_large_norms(first_pass):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(2048, 128, generator=g) * 0.03
    out_rows = torch.randint(0, 2048, (40,), generator=g)
    w[out_rows, torch.randint(0, 128, (40,), generator=g)] = 30.0  # int8 scale 1000x coarser in these rows
    w[5] = 0.0  # an all-zero row
    w[6, :] = 1e-30  # a tiny row (float32 normal, flushed in bf16)
    head = CertifiedInt8Head(w, cpu_first_pass=first_pass)
    h = torch.randn(48, 128, generator=g)
    h[:16] *= 1e6
    h[16:24] *= 1e-6
    h[24:32, :] = 0.0  # all logits 0: a 2048-way exact tie -> index 0
    h[32:40] = w[out_rows[:8]] * 0.5 + 0.1 * torch.randn(8, 128, generator=g)  # outlier rows win
    got = check(head, h)
    assert got[24:32].tolist() == [0] * 8
    wb = w.to(torch.bfloat16)
    check(CertifiedInt8Head(wb, cpu_first_pass=first_pass), h.to(torch.bfloat16))


def test_non_finite_hidden_falls_back(first_pass):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(500, 32, generator=g)
    head = CertifiedInt8Head(w, cpu_first_pass=first_pass)
    h = torch.randn(4, 32, generator=g)
    h[1, 3] = float("nan")
    h[2, 0] = float("inf")
    h[3] *= 1e37  # the exact head overflows
    check(head, h)
    assert head.stats.undecided_rows == 3


def test_errors():
    with pytest.raises(SpecPilotError, match="inf or NaN"):
        CertifiedInt8Head(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(SpecPilotError, match="2-D"):
        CertifiedInt8Head(torch.ones(3))
    head = CertifiedInt8Head(torch.randn(10, 8))
    with pytest.raises(SpecPilotError, match=r"\[R, 8\]"):
        head.argmax(torch.randn(2, 9))


def test_int8_copy():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(300, 64, generator=g)
    head = CertifiedInt8Head(w)
    assert head.q.dtype == torch.int8 and int(head.q.abs().max()) == 127
    assert torch.allclose(head.scale, w.abs().amax(1) / 127)
    err = (w - head.scale[:, None] * head.q.float()).abs()
    assert bool((err <= head.scale[:, None] / 2 * (1 + 1e-5)).all())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bundled_target_real_hidden_states(dtype, first_pass):
    from specpilot.model.checkpoint import load_model, load_tokenizer
    from specpilot.zoo import bundled_target_dir

    model = load_model(bundled_target_dir(), dtype=dtype)
    tok = load_tokenizer(bundled_target_dir())
    text = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
            "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:")
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        hid = model(ids, torch.arange(len(ids)), model.new_cache(len(ids)), 0)
    head = CertifiedInt8Head(model.lm_head.weight, cpu_first_pass=first_pass)
    got = head.argmax(hid)
    assert torch.equal(got, model.logits(hid).argmax(-1))
    # measured: about 1.5 (float32) / 2.1 (bf16) survivors per row out of 4096
    assert head.stats.survivors / head.stats.rows < 0.01 * model.args.vocab_size


def _cublas_flags():
    from specpilot.head.bound import _get_flag

    return {name: _get_flag(name) for name in ("allow_bf16_reduced_precision_reduction",
                                                "allow_fp16_reduced_precision_reduction")}


def test_fp32_reduction_scopes_the_cublas_flags():
    """:func:`~specpilot.head.bound.fp32_reduction` turns cuBLAS's reduced-precision bf16 / fp16 reductions off inside
    (a CUDA device) and restores exactly the process's setting on exit, also after an error; off CUDA it touches
    nothing. (The flags are host state: settable without a GPU.)"""
    from specpilot.head.bound import fp32_reduction

    m = torch.backends.cuda.matmul
    before = _cublas_flags()
    try:
        m.allow_bf16_reduced_precision_reduction = True
        m.allow_fp16_reduced_precision_reduction = True
        allowed = _cublas_flags()
        with fp32_reduction(torch.device("cuda")):
            assert not m.allow_bf16_reduced_precision_reduction and not m.allow_fp16_reduced_precision_reduction
        assert _cublas_flags() == allowed
        with pytest.raises(RuntimeError, match="inside"):
            with fp32_reduction("cuda"):
                raise RuntimeError("inside")
        assert _cublas_flags() == allowed
        with fp32_reduction("cpu"):
            assert _cublas_flags() == allowed
    finally:
        for name, value in before.items():
            setattr(m, name, value)
    assert _cublas_flags() == before


def test_exact_head_gemms_run_inside_fp32_reduction_and_flags_are_not_refused(monkeypatch):
    """Every exact-head GEMM of the head (:meth:`exact_logits`, :meth:`full_argmax`, the fallback of :meth:`argmax`)
    runs inside the head's own ``fp32_reduction`` on the weight's device, and a process that allows reduced-precision
    reductions is no longer refused: the head scopes the setting itself and leaves the process's flags as they were."""
    import contextlib
    import types

    from specpilot.head import certified

    scopes, inside = [], [False]

    @contextlib.contextmanager
    def spy(device):
        scopes.append(torch.device(device))
        inside[0] = True
        try:
            yield
        finally:
            inside[0] = False

    def linear(*a, **kw):
        assert inside[0], "an exact-head GEMM outside fp32_reduction"
        return F.linear(*a, **kw)

    monkeypatch.setattr(certified, "fp32_reduction", spy)
    monkeypatch.setattr(certified, "F", types.SimpleNamespace(linear=linear))
    m = torch.backends.cuda.matmul
    before = _cublas_flags()
    try:
        m.allow_bf16_reduced_precision_reduction = True
        allowed = _cublas_flags()
        g = torch.Generator().manual_seed(11)
        w = (torch.randn(500, 32, generator=g) * 0.05).to(torch.bfloat16)
        head = CertifiedInt8Head(w)
        h = torch.randn(6, 32, generator=g).to(torch.bfloat16)
        h[2] = float("nan")  # a row the bound cannot decide: the fallback's full head runs
        want = reference(h, w)
        assert torch.equal(head.argmax(h), want) and head.stats.full_head_calls == 1
        assert torch.equal(head.full_argmax(h), want) and torch.equal(head.exact_logits(h).argmax(-1), want)
        ids, needs = head.argmax_flagged(h)  # the reference path: settled itself, nothing flagged
        assert torch.equal(ids, want) and needs.dtype == torch.bool and not bool(needs.any())
        assert len(scopes) >= 4 and all(d == w.device for d in scopes)
        assert _cublas_flags() == allowed
    finally:
        for name, value in before.items():
            setattr(m, name, value)
