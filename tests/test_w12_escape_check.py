"""Value checks of a caller's W12 escape table (specpilot.w12.escapes.check_escape_table), run by w12_gemm once per
table: an out-of-range row_ptr or column would read out of bounds on the GPU, a table of another weight of the same
shape would give wrong sums. Small shapes: the CPU runs the kernels in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from .tritonutil import CUDA, DEV, triton  # noqa: F401

from specpilot.w12 import escapes as wg
from specpilot.w12.format import encode
from specpilot.w12.gemm import ESC_SLOTS, W12GemmError, check_escape_table, escape_table, w12_gemm
from specpilot.w12.linear import W12Linear

from .test_w12_gemm import planted_weight

N, K = 128, 192
S = ESC_SLOTS


@pytest.fixture(scope="module")
def weight():
    w = planted_weight(N, K, seed=11)
    t = encode(w, device=DEV)
    rp = escape_table(t)[0].cpu()
    assert int(rp[-1] - rp[0]) >= 4, "the test weight needs a channel with overflow escapes"
    return w, t


def _x(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, K, generator=g).to(DEV)


def _bad_tables(w, t):
    """``(label, table, message pattern)`` for each kind of bad table of ``t``'s shape (fresh tensors each)."""
    rp, ks, d = (e.clone() for e in escape_table(t))
    n_s = N * S
    last = N - 1  # planted_weight's many-escape channel: its overflow ends the table
    assert int(rp[last + 1] - rp[last]) > 0
    out = []

    r = rp.clone()
    r[0] -= 1
    out.append(("row_ptr[0]", (r, ks.clone(), d.clone()), r"row_ptr\[0\] is %d, want N·ESC_SLOTS = %d" % (n_s - 1, n_s)))
    r = rp.clone()
    r[5] = int(r[4]) - 1  # channel 4's overflow would end before it starts
    out.append(("decreasing", (r, ks.clone(), d.clone()), r"row_ptr decreases at entry 5"))
    r = rp.clone()
    r[-1] += 1
    out.append(("last row_ptr", (r, ks.clone(), d.clone()), r"row_ptr\[%d\] is %d, want the table's length" % (N, int(rp[-1]) + 1)))
    k2 = ks.clone()
    k2[3] = K  # channel 0, slot 3
    out.append(("slot column >= K", (rp.clone(), k2, d.clone()), r"slot k\[3\] \(channel 0, slot 3\) is %d, outside \[-1, %d\)" % (K, K)))
    k2 = ks.clone()
    k2[n_s] = -1  # the first overflow entry (channel N - 1's)
    out.append(("overflow column < 0", (rp.clone(), k2, d.clone()), r"overflow k\[%d\] \(channel %d\) is -1, outside \[0, %d\)" % (n_s, last, K)))
    empty = int((escape_table(t)[1][:n_s].view(N, S)[:, 0] < 0).nonzero()[0, 0])  # a channel without escapes
    k2 = ks.clone()
    k2[empty * S + 1] = 7  # a filled slot 1 after an empty slot 0
    out.append(("slot after an empty one", (rp.clone(), k2, d.clone()),
                r"channel %d, slot 1\) is 7 after an empty slot 0" % empty))
    other = encode(planted_weight(N, K, seed=12), device=DEV)  # another weight of the same shape
    out.append(("another weight", tuple(escape_table(other)), r"not escape_table\(w12\) \(a table of another weight\?\)"))
    w2 = w.clone()  # an escape above its channel's window doubled: the same escape places, another delta
    big = (w.float().abs() >= 1) & (w.float().abs() < 1e30)
    c = int(big.any(1).nonzero()[0, 0])
    col = int(big[c].nonzero()[0, 0])
    w2[c, col] = 2 * w[c, col]
    slot = int((ks[c * S:(c + 1) * S] == col).nonzero()[0, 0])
    i = c * S + slot
    same_places = encode(w2, device=DEV)
    assert torch.equal(same_places.esc_idx, t.esc_idx)
    out.append(("another weight, same escape places", tuple(escape_table(same_places)),
                r"entry %d \(channel %d, slot %d\) is k = %d, delta = .*; escape_table\(w12\) has" % (i, i // S, i % S, col)))
    return out


def test_good_table_passes_and_gives_the_escapes_none_output(weight):
    _, t = weight
    esc = escape_table(t)
    check_escape_table(t, esc)
    check_escape_table(t, list(esc))
    for m, over in ((1, {}), (3, dict(gemv=False, split_k=2))):  # the one-row GEMV; the tensor-core kernel, split K
        x = _x(m, m)
        assert torch.equal(w12_gemm(x, t, escapes=esc, **over), w12_gemm(x, t, **over))


def test_each_kind_of_bad_table_is_refused_naming_its_entry(weight):
    w, t = weight
    x = _x(1)
    want = w12_gemm(x, t)
    esc = escape_table(t)
    for label, bad, pattern in _bad_tables(w, t):
        with pytest.raises(W12GemmError, match=pattern):
            check_escape_table(t, bad)
        with pytest.raises(W12GemmError, match=pattern) as err:
            w12_gemm(x, t, escapes=bad)
        assert "\n" not in str(err.value), label
        assert torch.equal(w12_gemm(x, t, escapes=esc), want), label  # still usable after the refusal


def test_bad_table_is_refused_before_the_tensor_core_kernel_too(weight):
    w, t = weight
    x = _x(3, 1)
    want = w12_gemm(x, t, gemv=False)
    for label, bad, pattern in _bad_tables(w, t)[:5]:
        with pytest.raises(W12GemmError, match=pattern):
            w12_gemm(x, t, escapes=bad, gemv=False)
    assert torch.equal(w12_gemm(x, t, escapes=escape_table(t), gemv=False), want)


def test_layout_and_weight_problems_still_raise_before_values(weight):
    _, t = weight
    rp, ks, d = escape_table(t)
    with pytest.raises(W12GemmError, match="escape_table"):
        check_escape_table(t, (rp, ks[:10], d[:10]))
    with pytest.raises(W12GemmError, match="1-D row_ptr"):
        check_escape_table(t, (rp.view(1, -1), ks, d))
    with pytest.raises(W12GemmError, match="W12Tensor"):
        check_escape_table(torch.zeros(N, K), (rp, ks, d))


def test_check_runs_once_per_table_and_again_after_an_in_place_write(weight, monkeypatch):
    _, t = weight
    calls = []
    real = wg.check_escape_table
    monkeypatch.setattr(wg, "check_escape_table", lambda *a: calls.append(1) or real(*a))
    x = _x(1, 2)
    want = w12_gemm(x, t)
    esc = escape_table(t)
    for _ in range(3):
        assert torch.equal(w12_gemm(x, t, escapes=esc), want)
    assert len(calls) == 1
    esc2 = escape_table(t)  # a new table (new memory): checked once
    w12_gemm(x, t, escapes=esc2)
    w12_gemm(x, t, escapes=tuple(esc2))
    assert len(calls) == 2
    keep = int(esc[1][0])
    esc[1][0] = K  # an in-place write bumps the version counter: checked again, refused
    with pytest.raises(W12GemmError, match=r"slot k\[0\]"):
        w12_gemm(x, t, escapes=esc)
    esc[1][0] = keep
    assert torch.equal(w12_gemm(x, t, escapes=esc), want)
    assert len(calls) == 4
    assert torch.equal(w12_gemm(x, t, escapes=esc), want)
    assert len(calls) == 4


def test_w12_linear_passes_its_own_table_unchecked_and_its_views_are_checked_once(weight, monkeypatch):
    w, _ = weight
    lin = torch.nn.Linear(K, N, bias=False)
    lin.weight.data = w.float()
    layer = W12Linear.from_linear(lin).to(DEV)
    layer.use_kernel = True
    calls = []
    real = wg.check_escape_table
    monkeypatch.setattr(wg, "check_escape_table", lambda *a: calls.append(1) or real(*a))
    x = _x(1, 3)
    y = layer(x)
    assert calls == []  # W12Linear's own table: trusted
    for _ in range(2):  # escapes() makes a new float32 view of its int32 buffer each call: same memory, one check
        assert torch.equal(w12_gemm(x, layer.w12(), escapes=layer.escapes()), y)
    assert len(calls) == 1


def test_the_check_cache_stays_bounded(weight, monkeypatch):
    _, t = weight
    monkeypatch.setattr(wg, "_CHECKED_TABLES", {})
    monkeypatch.setattr(wg, "_CHECKED_MAX", 3)
    keep = [escape_table(t) for _ in range(5)]
    for esc in keep:
        wg.check_escapes_once(t, esc)
    assert len(wg._CHECKED_TABLES) == 3


@pytest.mark.skipif(not CUDA, reason="CUDA graphs")
def test_no_check_and_no_sync_while_capturing(weight, monkeypatch):
    _, t = weight
    calls = []
    real = wg.check_escape_table
    monkeypatch.setattr(wg, "check_escape_table", lambda *a: calls.append(1) or real(*a))
    x = _x(1, 4).bfloat16()
    esc = escape_table(t)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        want = w12_gemm(x, t, escapes=esc)  # checked here, eagerly
        fresh = escape_table(t)
    torch.cuda.synchronize()
    assert len(calls) == 1
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        a = w12_gemm(x, t, escapes=esc)
        b = w12_gemm(x, t, escapes=fresh)  # not checked yet: skipped in the capture (a check would sync)
    g.replay()
    torch.cuda.synchronize()
    assert len(calls) == 1 and torch.equal(a, want) and torch.equal(b, want)


def test_non_finite_escapes_pass_their_own_check():
    """NaN deltas (NaN weights) compare equal to escape_table's NaNs; ±inf ones by value."""
    w = planted_weight(N, K, seed=13)
    w[2, 5], w[3, 6], w[4, 7] = float("nan"), float("inf"), -float("inf")
    t = encode(w, device=DEV)
    esc = escape_table(t)
    assert bool(esc[2].isnan().any()) and bool(esc[2].isinf().any())
    check_escape_table(t, esc)
    x = _x(1, 5)
    assert torch.equal(w12_gemm(x, t, escapes=esc).isnan(), w12_gemm(x, t).isnan())


def test_inference_mode_tables_are_checked_once(weight, monkeypatch):
    """Inference-mode tensors have no version counter: checked on first use, then remembered by their memory."""
    _, t = weight
    calls = []
    real = wg.check_escape_table
    monkeypatch.setattr(wg, "check_escape_table", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        esc = escape_table(t)
        bad = (esc[0], esc[1].clone(), esc[2])
        bad[1][0] = K
        for _ in range(2):
            wg.check_escapes_once(t, esc)
        with pytest.raises(W12GemmError, match=r"slot k\[0\]"):
            wg.check_escapes_once(t, bad)
    assert len(calls) == 2
