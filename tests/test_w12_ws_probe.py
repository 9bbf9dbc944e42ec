"""The warp-specialised stream-K W12 GEMM (``probes/w12_ws.py``, a Gluon probe kernel) on an sm_90 GPU: within the
rounding bound of the reference decode + float32 matmul on fresh random weights with planted escapes (zeros,
outliers, inf / NaN) and odd shapes (runs that cross bands, K not a multiple of 64, fewer rows than the tile),
bitwise equal from call to call. Gluon has no CPU interpreter: skipped without an sm_90 GPU. The CPU tests cover
``ws_plan``, ``ws_records`` and the refusals."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from specpilot.w12.gemm import W12GemmError, escape_table, w12_gemm_reference
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from w12_ws import WS_COLUMNS, w12_ws, ws_plan, ws_records  # noqa: E402  (probes/w12_ws.py, a probe kernel)
from specpilot.w12.format import _codes_from_records, encode

sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _bound_ok(out, x, t, w):
    """Finite entries within ``2 γ_{K+E+3} Σ|x|(|w|+|c|)`` + one bf16 rounding; same non-finite pattern."""
    from specpilot.bench.w12 import check, codes
    return check(out, x, t, w.float().abs() + codes(t).abs())


@pytest.mark.gpu
@pytest.mark.skipif(not sm90, reason="needs an sm_90 GPU (Gluon: TMA, wgmma)")
@pytest.mark.parametrize("kw", [{}, {"split_rows": True}, {"overlap": False}, {"split_rows": True, "overlap": False}])
@pytest.mark.parametrize("m,n,k,programs", [(8, 512, 1024, 20), (16, 384, 4160, 33), (32, 1024, 512, 7),
                                            (3, 256, 2048, 64), (32, 6144, 4096, None)])
def test_ws_within_bound_and_deterministic(m, n, k, programs, kw):
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n + k)
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    w[::37, ::53] = 0.0
    w[5, 7] = 3.0e4
    w[9, :5] = 1e-30
    w[n - 1, k - 1] = float("inf")
    w[n // 2, 1] = float("nan")
    t = encode(w, device="cuda")
    esc = escape_table(t)
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    out = w12_ws(x, t, esc, programs=programs, **kw)
    r = _bound_ok(out, x, t, w)
    assert r["within_bound"], r
    bits = out.view(torch.int16)
    for _ in range(5):  # bit patterns: NaN != NaN
        assert torch.equal(w12_ws(x, t, esc, programs=programs, **kw).view(torch.int16), bits)
    assert torch.equal(w12_gemm_reference(x, t).isnan(), out.isnan())


@pytest.mark.parametrize("u,r,p", [(3072, 64, 132), (2048, 64, 132), (128, 64, 7), (4800, 192, 132), (65, 65, 65)])
def test_ws_plan_counts_bands_and_programs(u, r, p):
    maxb, maxc = ws_plan(u, r, p)
    runs = [(c * u // p, (c + 1) * u // p) for c in range(p)]
    touched = [set(range(a // r, (b - 1) // r + 1)) for a, b in runs]
    assert maxb == max(len(s) for s in touched)
    assert maxc == max(sum(b in s for s in touched) for b in range(u // r))
    assert sum(b - a for a, b in runs) == u  # every record in exactly one run


def test_ws_refuses_without_cuda_or_with_bad_rows():
    w = (torch.randn(128, 64) * 0.02).to(torch.bfloat16)
    t = encode(w)
    with pytest.raises(W12GemmError, match="CUDA|Gluon"):
        w12_ws(torch.randn(4, 64).to(torch.bfloat16), t, escape_table(t))


def test_ws_records_permute_each_rows_columns_and_nothing_else():
    w = (torch.randn(256, 320) * 0.02).to(torch.bfloat16)
    w[3, 5] = 0.0
    t = encode(w)
    v, nib = _codes_from_records(t.records)
    v2, nib2 = _codes_from_records(ws_records(t))
    assert sorted(WS_COLUMNS.tolist()) == list(range(64))
    # position p of each record row holds column WS_COLUMNS[p]; thread g of a quad: columns 2g + 8j + e
    assert WS_COLUMNS[16 * 3 + 2 * 5 + 1].item() == 2 * 3 + 8 * 5 + 1
    assert torch.equal(v.reshape(256, 5, 64)[..., WS_COLUMNS].reshape(256, 320), v2)
    assert torch.equal(nib.reshape(256, 5, 64)[..., WS_COLUMNS].reshape(256, 320), nib2)
