"""W12 GEMM (specpilot.w12.gemm, §4.1) against the reference decode + float32 matmul, and W12Linear.

CPU: Triton interpreter with float32 activations (the decoded bf16 weights are exact in float32). CUDA:
compiled, float32 and bf16. The kernel must stay within the accumulation-rounding bound of the module
docstring element by element, propagate non-finite escapes as the reference does, and be bitwise
deterministic.
"""

from __future__ import annotations

import pytest
import torch

from .tritonutil import CUDA, DEV, triton  # noqa: F401

from specpilot.kernels import gemm
from specpilot.w12.format import W12FormatError, W12Tensor, decode, encode
from specpilot.w12.gemm import (ESC_SLOTS, PROGRAMS_PER_SM, WAVE_MAXNREG, W12GemmError, codes_at, default_config,
                                escape_table, one_row_gemv, split_locks, w12_gemm, w12_gemm_reference)
from specpilot.w12.linear import W12Linear

DTYPES = [torch.float32] + ([torch.bfloat16] if CUDA else [])


def planted_weight(n, k, seed):
    """Random bf16 ``[n, k]`` (std 0.02) with zeros, denormals, tiny normals and outliers beyond any window of
    the row planted in several rows (several escapes in one row too)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    plant = [0.0, -0.0, 1e-40, -3e-39, 1e-30, 2.0**-120, 300.0, -5e4, 1e30, -2.5e20]
    for i, v in enumerate(plant):
        for r in ((7 * i + 3) % n, (11 * i + 1) % n):
            w[r, (13 * i + 5 * r) % k] = v
    w[n - 1, :: max(1, k // 9)] = 0.0  # a row with many escapes (the escape loop's longest)
    return w


def code_matrix(t: W12Tensor) -> torch.Tensor:
    """The values the records alone hold (saturated codes at escapes), float64 ``[N, K]``."""
    empty = W12Tensor(t.records, t.base, t.esc_idx[:0], t.esc_val[:0], t.shape, t.sha256)
    return decode(empty, check=False).double()


def assert_within_rounding(out, x, t, bias=None):
    """``|out - ref| <= 2 γ_{K+E+3} (Σ_k |x| (|w| + |c|) + |b|)`` element by element (module docstring), ``ref`` the
    reference; plus one rounding of the output dtype for bf16 outputs."""
    ref = w12_gemm_reference(x, t, bias).double()
    w, c = decode(t, check=False).double(), code_matrix(t)
    k = t.shape[1]
    u = 2.0**-24
    nk = k + t.num_escapes + 3
    gamma = nk * u / (1 - nk * u)
    bound = 2 * gamma * (x.double().abs() @ (w.abs() + c.abs()).T + (0 if bias is None else bias.double().abs()))
    if out.dtype != torch.float32:
        bound = bound + 2.0**-8 * ref.abs() * 2
    err = (out.double() - ref).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"


# (M, N, K, overrides): ragged N / K (not multiples of 128 / 64), split-K 1..3, every BLOCK_M, both operand orders
CASES = [
    (1, 200, 300, dict(block_n=64, block_k=128, gemv=False, words=False)),  # the byte-loading kernel
    (1, 200, 300, dict()),  # one row: the GEMV with its default launch
    (1, 130, 64, dict(block_n=16, block_k=64, w_left=False, gemv=False, words=False)),
    (5, 200, 300, dict(block_n=32, block_k=64, split_k=3, words=False)),
    (17, 128, 200, dict(block_n=64, block_k=128, split_k=2, w_left=False, words=False)),
    (64, 70, 130, dict(block_n=32, block_k=64, split_k=2, words=False)),
    (64, 70, 130, dict(block_n=32, block_k=64, split_k=2)),  # default: tensor cores from record words
    (100, 90, 100, dict(block_n=64, block_k=64, words=False)),
    (100, 90, 100, dict(block_n=64, block_k=64)),
    (1, 300, 700, dict(gemv=True)),  # the one-row FMA kernel: default blocking, K not a multiple of its step
    (1, 300, 700, dict(gemv=True, lines=False)),  # one row on the [BLOCK_N, groups] kernel instead of the lines one
    (1, 300, 700, dict(gemv=True, lines=False, split_k=3, block_k=128)),
    (1, 520, 1100, dict(gemv=True, block_n=32, block_k=512, split_k=2, num_warps=2)),  # lines: a ragged last step
    (1, 130, 64, dict(gemv=True, block_n=64, block_k=64)),
    (1, 300, 700, dict(gemv=True, split_k=3, block_k=128)),  # split K with a ragged last split
    (1, 200, 1000, dict(gemv=True, split_k=2, block_n=8, block_k=64, asm=False)),  # plain decode on the GPU too
    (3, 300, 700, dict(gemv=True)),  # the FMA kernel on a few rows (padded to 4 in registers)
    (8, 130, 640, dict(gemv=True, split_k=2, block_k=128)),  # its largest row count, split K
    (5, 200, 300, dict(words=True, block_n=32, block_k=64, split_k=3)),  # tensor cores from record words
    (17, 130, 700, dict(words=True, block_n=64, block_k=128)),  # ragged N and K, a ragged last step
    (40, 128, 256, dict(words=True, block_n=16, block_k=256, split_k=2, block_m=32)),
    (8, 200, 1000, dict(words=True, block_n=64, block_k=128, asm=False)),  # plain decode on the GPU too
    (17, 130, 700, dict(words=True, block_n=64, block_k=128, x_gather=False)),  # activations permuted after the load
]


@pytest.mark.parametrize("m,k,over", [(3, 700, dict(block_k=128)), (33, 200, dict(split_k=2, block_k=64)),
                                      (40, 256, dict(block_n=16, block_k=256, block_m=32))])
def test_permuted_activation_load_is_bitwise_the_permuted_tile(m, k, over):
    """``x_gather``: the activation tile loaded with its columns already in ``_k_order`` gives the same operands
    in the same places as the tile loaded in column order and permuted after (``x_gather=False``), so the
    outputs are bit for bit equal (ragged K: the masked tail too)."""
    n = 130
    g = torch.Generator().manual_seed(m + k)
    t = encode(planted_weight(n, k, seed=m + 3), device=DEV)
    dtype = torch.bfloat16 if CUDA else torch.float32
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    a = w12_gemm(x, t, gemv=False, x_gather=True, **over)
    b = w12_gemm(x, t, gemv=False, x_gather=False, **over)
    assert torch.equal(a, b)
    assert_within_rounding(a.cpu(), x.cpu(), _cpu(t), None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,over", CASES)
def test_w12_gemm_matches_reference_within_rounding(dtype, m, n, k, over):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    t = encode(planted_weight(n, k, seed=m + n), device=DEV)
    assert t.num_escapes >= 12
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    bias = torch.randn(n, generator=g).to(DEV, dtype) if m % 2 else None
    out = w12_gemm(x, t, bias, **over)
    assert out.shape == (m, n) and out.dtype == dtype
    assert bool(torch.isfinite(out).all())
    assert_within_rounding(out.cpu(), x.cpu(), _cpu(t), None if bias is None else bias.cpu())
    again = w12_gemm(x, t, bias, **over)
    assert torch.equal(again.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       out.view(torch.int16 if dtype != torch.float32 else torch.int32)), "two runs must be bitwise identical"


@pytest.mark.parametrize("m,over", [(5, dict(gemv=False, split_k=2, block_k=64)), (17, dict(gemv=False, split_k=4, block_k=64)),
                                    (1, dict(gemv=True, split_k=2, block_k=64)), (3, dict(gemv=True, split_k=4, block_k=64))])
def test_fused_split_k_equals_the_split_sum_kernel_bitwise(m, over):
    """``fused_split``: the tile's last split adds the partials inside the kernel; the sum (split order, then the
    escapes in list order, then the bias) is the second kernel's, bit for bit, and the tile counters are back
    at zero afterwards (the next call, and a replayed CUDA graph, start from zero)."""
    n, k = 192, 320
    g = torch.Generator().manual_seed(m + 40)
    t = encode(planted_weight(n, k, seed=m + 7), device=DEV)
    esc = escape_table(t)
    dtype = torch.bfloat16 if CUDA else torch.float32
    for bias in (None, torch.randn(n, generator=g).to(DEV, dtype)):
        x = torch.randn(m, k, generator=g).to(DEV, dtype)
        want = w12_gemm(x, t, bias, escapes=esc, fused_split=False, **over)  # the second kernel's sum
        for _ in range(2):
            got = w12_gemm(x, t, bias, escapes=esc, fused_split=True, **over)
            assert torch.equal(got, want)
        assert int(split_locks(x.device, 1).abs().sum()) == 0


@pytest.mark.parametrize("m,over", [(1, dict()), (1, dict(split_k=3, block_k=128)), (3, dict(split_k=2, block_k=64)),
                                    (8, dict(block_k=64)), (1, dict(split_k=5, block_k=64))])  # last: one step a split
def test_gemv_pipelined_k_loop_is_bitwise_the_plain_loop(m, over):
    """The GEMV's ``load_stages`` override (later steps' words copied ahead to shared memory): the same sums in the
    same order as the plain loop, so bitwise equal, with split K
    (a ragged last split), one K step per split, escapes and a bias; and both equal the reference within rounding.
    (The interpreter runs the loop plainly; on a GPU this compares the cp.async pipeline itself.)"""
    n, k = 192, 320
    g = torch.Generator().manual_seed(m * 13 + len(over))
    t = encode(planted_weight(n, k, seed=m + 3), device=DEV)
    esc = escape_table(t)
    dtype = torch.bfloat16 if CUDA else torch.float32
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    bias = torch.randn(n, generator=g).to(DEV, dtype)
    over = over | {"lines": False}  # the [BLOCK_N, groups] kernel (one row defaults to the line-coalesced one)
    plain = w12_gemm(x, t, bias, escapes=esc, gemv=True, load_stages=1, **over)
    assert torch.equal(w12_gemm(x, t, bias, escapes=esc, gemv=True, load_stages=3, **over), plain)
    assert_within_rounding(plain.cpu(), x.cpu(), _cpu(t), bias.cpu())


def _cpu(t: W12Tensor) -> W12Tensor:
    return W12Tensor(t.records.cpu(), t.base.cpu(), t.esc_idx.cpu(), t.esc_val.cpu(), t.shape, t.sha256)


def test_default_config_path_and_reference_order():
    """Default launch (no overrides) at every bucket of M; and without escapes the kernel equals the reference
    exactly on exactly-representable inputs (small integers), whatever the blocking."""
    n, k = 96, 192
    g = torch.Generator().manual_seed(5)
    w = torch.randint(1, 9, (n, k), generator=g).to(torch.bfloat16) * torch.randint(0, 2, (n, k), generator=g).mul(2).sub(1)
    t = encode(w.to(torch.bfloat16), device=DEV)
    assert t.num_escapes == 0
    for m in (1, 5, 17, 64):
        x = torch.randint(-4, 5, (m, k), generator=g).float().to(DEV)
        assert torch.equal(w12_gemm(x, t), w12_gemm_reference(x, t))


def test_one_row_dispatch_follows_the_measured_rule_and_stays_exact():
    # Qwen3-8B qkv / o / gate_up / down, Qwen3-32B qkv / o / gate_up / down (H200 winners, results/w12_double_probe_h200_2026-12-01_7b87fb5.json)
    shapes = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (10240, 5120), (5120, 8192), (51200, 5120),
              (5120, 25600)]
    assert [one_row_gemv(n, k) for n, k in shapes] == [True, True, True, True, False, False, True, False]
    # one row with K > 4096 takes the tensor-core kernel by default: exact on small integers like the GEMV
    n, k = 64, 4160
    g = torch.Generator().manual_seed(3)
    w = torch.randint(-7, 8, (n, k), generator=g).float()
    w[w == 0] = 1.0
    t = encode(w.to(torch.bfloat16), device=DEV)
    x = torch.randint(-4, 5, (1, k), generator=g).float().to(DEV)
    assert not one_row_gemv(n, k)
    assert torch.equal(w12_gemm(x, t), w12_gemm_reference(x, t))
    assert torch.equal(w12_gemm(x, t), w12_gemm(x, t, gemv=True))


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("over", [dict(gemv=True), dict(gemv=True, split_k=2, block_k=64), dict(gemv=False, words=False),
                                  dict(gemv=False, words=True), dict(gemv=False, words=True, split_k=2, block_k=64)])
def test_rows_with_far_apart_windows_are_exact(over, m):
    """The one-row kernel decodes ``w · 2^(112 − B_n)`` and rescales each row's sum once: rows whose windows sit
    anywhere in the bf16 range (scales 2^-100 .. 2^100) must still give the reference exactly when every
    product and partial sum is exact (small integers times a power of two per row)."""
    n, k = 48, 320
    g = torch.Generator().manual_seed(11)
    ints = torch.randint(-15, 16, (n, k), generator=g).float()
    ints[ints == 0] = 3.0
    scale = torch.pow(2.0, torch.linspace(-100, 100, n).round())[:, None]
    t = encode((ints * scale).to(torch.bfloat16), device=DEV)
    assert t.num_escapes == 0 and int(t.base.min()) < 40 and int(t.base.max()) > 210
    x = torch.randint(-4, 5, (m, k), generator=g).float().to(DEV)
    out = w12_gemm(x, t, **over)
    assert torch.equal(out.cpu(), w12_gemm_reference(x.cpu(), _cpu(t)))


def test_nonfinite_escapes_propagate_like_the_reference():
    n, k, m = 64, 128, 5
    g = torch.Generator().manual_seed(9)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    w[1, 3] = float("inf")
    w[2, 4] = float("-inf")
    w[3, 5] = float("nan")
    w[4, 6], w[4, 7] = float("inf"), float("-inf")  # both signs in one row: NaN
    w[5, 8] = float("inf")  # meets x = 0 in row 0 of x: NaN there, inf elsewhere
    t = encode(w, device=DEV)
    x = torch.randn(m, k, generator=g)
    x[0, 8] = 0.0
    x[1, 3] = -1.0  # -inf * ... row 1, channel 1 becomes -inf
    x = x.to(DEV)
    for over in (dict(), dict(split_k=2, block_k=64, block_n=16, words=False), dict(w_left=False, words=False), dict(words=True),
                 dict(words=True, split_k=2, block_k=64, block_n=16)):
        out = w12_gemm(x, t, **over).cpu()
        ref = w12_gemm_reference(x.cpu(), _cpu(t))
        assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())
        assert torch.equal(out[out.isinf()], ref[ref.isinf()])
        assert out[0, 5].isnan() and out[1, 5].isinf() and out[1, 1] == float("-inf") and out[:, 3].isnan().all()
        fin = ref.isfinite()
        torch.testing.assert_close(out[fin], ref[fin], atol=1e-5, rtol=1e-5)
    # infinite activations: non-finite exactly where the reference is, NaN where it is NaN
    xi = x.clone()
    xi[2, 20], xi[3, 5] = float("inf"), float("-inf")
    out, ref = w12_gemm(xi, t).cpu(), w12_gemm_reference(xi.cpu(), _cpu(t))
    assert torch.equal(out.isfinite(), ref.isfinite()) and bool(out[ref.isnan()].isnan().all())
    assert not bool(out[2:4].isfinite().any()) and bool(out[:2].isfinite().any())


def test_escape_table_and_codes():
    w = planted_weight(150, 70, seed=3)
    w[7, ::3] = 0  # channel 7: 24 escapes, 20 of them past the slots
    t = encode(w)
    row_ptr, ks, delta = escape_table(t)
    s_ = ESC_SLOTS
    idx = t.esc_idx.long()
    true_all = t.esc_val.view(torch.bfloat16).float()
    over = int(row_ptr[-1] - row_ptr[0])
    assert row_ptr.shape == (151,) and int(row_ptr[0]) == 150 * s_ and ks.shape == delta.shape == (150 * s_ + over,)
    counts = torch.bincount(idx // 70, minlength=150)
    assert over == int((counts - s_).clamp_min(0).sum()) and over >= 20
    for n in range(150):  # channel n's escapes: its slots then its overflow, in column order, and nothing else
        mine = idx // 70 == n
        slot_k, slot_d = ks[n * s_:(n + 1) * s_], delta[n * s_:(n + 1) * s_]
        filled = min(int(counts[n]), s_)
        assert bool((slot_k[filled:] == -1).all()) and bool((slot_d[filled:] == 0).all())
        listed = torch.cat((slot_k[:filled], ks[row_ptr[n]:row_ptr[n + 1]])).long()
        assert torch.equal(listed, idx[mine] % 70)
        d_true = true_all[mine] - codes_at(t, idx[mine]).float()
        assert torch.equal(torch.cat((slot_d[:filled], delta[row_ptr[n]:row_ptr[n + 1]])), d_true)
    c = codes_at(t, idx)
    assert torch.equal(c, code_matrix(t).view(-1)[idx].to(torch.bfloat16))
    true = t.esc_val.view(torch.bfloat16).float()
    below = true.abs() < c.float().abs()  # saturated codes are the nearest in-window value of the same sign
    assert bool((torch.signbit(c) == torch.signbit(true)).all()) and bool(below.any()) and bool((~below).any())


def test_default_config_fills_the_device_and_divides_k():
    # the splits the H200 sweep found best (results/w12_mma_sweep_h200_2026-12-01_4881152.json)
    assert [default_config(8, n, k)["split_k"] for n, k in [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]] \
        == [4, 8, 1, 8]
    for m, n, k in [(1, 6144, 4096), (1, 4096, 4096), (8, 24576, 4096), (32, 4096, 12288), (256, 10240, 5120),
                    (1, 5120, 25600), (100, 200, 300)]:
        c = default_config(m, n, k)
        kb = -(-(-(-k // 64) * 64) // c["block_k"])
        assert kb % c["split_k"] == 0 and (c["split_k"] == 1 or kb // c["split_k"] >= 4)
        assert c["block_m"] >= min(m, 64) and 128 % c["block_n"] == 0 and c["block_k"] % 64 == 0
        progs = -(-n // c["block_n"]) * -(-m // c["block_m"])
        could_double = kb % (2 * c["split_k"]) == 0 and kb // (2 * c["split_k"]) >= 4
        assert progs * c["split_k"] >= PROGRAMS_PER_SM * 132 or not could_double


def test_default_config_caps_registers_only_where_a_second_wave_shrinks():
    # results/w12_waves_probe_h200_2026-12-02_735344e.json: 32B gate_up (800 programs) at 8 rows 128.9 µs
    # uncapped, 109.2 capped; launches of at most 5 programs an SM were not helped
    assert default_config(8, 51200, 5120)["maxnreg"] == WAVE_MAXNREG
    assert default_config(16, 51200, 5120)["maxnreg"] == WAVE_MAXNREG
    assert default_config(32, 51200, 5120)["maxnreg"] is None  # BLOCK_M 32 spills at the cap
    for n, k in [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (10240, 5120), (5120, 8192),
                 (5120, 25600)]:
        for m in (2, 8, 16, 32, 64):
            assert default_config(m, n, k)["maxnreg"] is None, (m, n, k)
    assert default_config(8, 51200, 5120, num_sms=200)["maxnreg"] is None  # 800 programs fit 200 SMs at 5 each


def test_maxnreg_override_is_checked_and_changes_no_value():
    t = encode((torch.randn(130, 200) * 0.02).to(torch.bfloat16), device=DEV)
    x = torch.randn(9, 200, device=DEV)
    want = w12_gemm(x, t, gemv=False)
    for cap in (0, 24, 80, 255):
        assert torch.equal(w12_gemm(x, t, gemv=False, maxnreg=cap), want)
    for bad in (-1, 1, 23, 256, True, 80.0, "80"):
        with pytest.raises(W12GemmError, match="maxnreg"):
            w12_gemm(x, t, maxnreg=bad)


def test_bad_input_raises():
    t = encode((torch.randn(40, 70) * 0.02).to(torch.bfloat16), device=DEV)
    bad = [torch.randn(0, 70), torch.randn(257, 70), torch.randn(2, 71), torch.randn(2, 70).half()]
    for x in bad:
        with pytest.raises(W12GemmError):
            w12_gemm(x.to(DEV), t)
    with pytest.raises(W12GemmError):
        w12_gemm(torch.randn(2, 70, device=DEV), t, block_n=48)
    with pytest.raises(W12GemmError, match="1..8 rows"):
        w12_gemm(torch.randn(9, 70, device=DEV), t, gemv=True)
    with pytest.raises(W12GemmError):
        w12_gemm(torch.randn(2, 70, device=DEV), t, torch.randn(41, device=DEV))
    with pytest.raises(W12GemmError):
        w12_gemm_reference(torch.randn(2, 69), _cpu(t))
    x = torch.randn(1, 70, device=DEV)
    with pytest.raises(W12GemmError, match="unknown w12_gemm override.*splitk"):
        w12_gemm(x, t, splitk=3)  # a misspelt knob is refused, not ignored
    for key in ("block_k", "block_n", "split_k", "num_warps"):
        with pytest.raises(W12GemmError, match=f"{key} must be a positive integer"):
            w12_gemm(x, t, **{key: 0})
    for key, v in (("fused_split", "no"), ("lines", 0), ("asm", 1)):  # "no" used to read as True
        with pytest.raises(W12GemmError, match=f"{key} must be True or False"):
            w12_gemm(x, t, **{key: v})
    with pytest.raises(W12GemmError, match="W12Tensor"):
        w12_gemm(x, torch.randn(40, 70, device=DEV))
    with pytest.raises(W12GemmError, match="W12Tensor"):
        w12_gemm_reference(x.cpu(), torch.randn(40, 70))
    assert w12_gemm(x, t, split_k=2).shape == (1, 40)  # and the call still works after the refusals


# -- W12Linear ---------------------------------------------------------------------------------------
def exact_linear(n, k, bias, seed):
    """A float32 nn.Linear with bf16-valued weights that make every sum exact: integers in [-8, 8] times 2^-4
    (zeros and ±2^10 outliers planted: escapes), so any summation order gives the same float32 result."""
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        w = torch.randint(-8, 9, (n, k), generator=g).float() / 16
        w[0, :3] = 2.0**10
        w[n // 2, 1] = -(2.0**10)
        lin.weight.copy_(w)
        if bias:
            lin.bias.copy_(torch.randint(-50, 50, (n,), generator=g).float())
    return lin.requires_grad_(False)


@pytest.mark.parametrize("kernel", [False, True])
def test_w12_linear_equals_nn_linear_on_exact_inputs(kernel):
    dev = DEV if kernel else "cpu"  # the compiled kernel on a GPU machine, the interpreter on the CPU
    lin = exact_linear(150, 100, True, seed=1).to(dev)
    w12 = W12Linear.from_linear(lin)
    w12.use_kernel = kernel
    assert w12.esc_idx.numel() > 3 and w12.in_features == 100 and w12.out_features == 150
    g = torch.Generator().manual_seed(2)
    for shape in ((1, 100), (17, 100), (2, 3, 100)):
        x = torch.randint(-6, 7, shape, generator=g).float().to(dev)
        assert torch.equal(w12(x), lin(x)), shape
    assert torch.equal(w12.decoded_weight().float(), lin.weight)


def test_w12_linear_rows_beyond_256_and_reference_bitwise_in_float32():
    """> 256 rows (a prefill) take the dense path (test_w12_dense.py); the CPU reference path is bitwise nn.Linear
    in float32."""
    g = torch.Generator().manual_seed(4)
    lin = torch.nn.Linear(64, 40).requires_grad_(False)
    with torch.no_grad():
        lin.weight.copy_(lin.weight.to(torch.bfloat16).float())
    w12 = W12Linear.from_linear(lin)
    x = torch.randn(300, 64, generator=g)
    assert torch.equal(w12(x), lin(x))  # reference path: F.linear with the same float32 weight
    w12, lin, x = w12.to(DEV), lin.to(DEV), x.to(DEV)
    w12.use_kernel = True
    torch.testing.assert_close(w12(x), lin(x), atol=1e-5, rtol=1e-5)


def test_w12_linear_refuses_non_bf16_weights_and_keeps_buffers_under_dtype_casts():
    lin = torch.nn.Linear(16, 8)
    with pytest.raises(W12FormatError, match="bfloat16"):
        W12Linear.from_linear(lin)
    with torch.no_grad():
        lin.weight.copy_(lin.weight.to(torch.bfloat16).float())
        lin.weight[0, 0] = 0.0
    m = W12Linear.from_linear(lin).to(torch.bfloat16)
    assert m.bias.dtype == torch.bfloat16 and m.records.dtype == torch.uint8
    assert m.esc_delta_bits.dtype == torch.int32 and m.esc_idx.numel() >= 1
    assert torch.equal(m.decoded_weight(), lin.weight.to(torch.bfloat16))
    with pytest.raises(W12GemmError):
        m(torch.randn(2, 15))
    same = W12Linear.from_w12(m.w12(), lin.bias)
    assert torch.equal(same(torch.ones(1, 16)), W12Linear.from_linear(lin)(torch.ones(1, 16)))


def test_gemm_linear_dispatches_w12_layers():
    lin = exact_linear(24, 32, False, seed=6)
    w12 = W12Linear.from_linear(lin)
    x = torch.randint(-3, 4, (3, 32)).float()
    assert torch.equal(gemm.linear(x, w12), lin(x)) and torch.equal(gemm.cublas_linear(x, w12), lin(x))


def test_importing_the_kernels_leaves_tritons_interpreter_alone():
    """A user's own process with TRITON_INTERPRET=1: importing the W12 and shared kernels patches nothing in Triton
    (the numpy >= 2.4 interpreter fix, triton#9171, is the test suite's own: tests/conftest.py)."""
    import subprocess
    import sys

    code = ("from triton.runtime import interpreter as it\nbefore = it._patch_lang_tensor\n"
            "import specpilot.kernels, specpilot.kernels.fused, specpilot.w12.gemm, specpilot.w12.linear\n"
            "import specpilot.head.certified, specpilot.head.kernel\n"
            "print(it._patch_lang_tensor is before and not getattr(before, '_specpilot_shim', False))\n")
    env = dict(__import__("os").environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-1500:]
    assert proc.stdout.strip().splitlines()[-1] == "True"


def test_escape_table_of_another_layout_is_refused():
    """A table of the wrong length, dtype, layout in memory or container is a clear W12GemmError before any launch
    (values, and a table of another weight of the same shape: tests/test_w12_escape_check.py)."""
    w = planted_weight(64, 128, seed=5)
    t = encode(w)
    row_ptr, ks, delta = escape_table(t)
    x = torch.randn(1, 128)
    strided = torch.stack((delta, delta), 1)[:, 0]  # the right values, not contiguous
    for bad in ((row_ptr, ks[:10], delta[:10]), (row_ptr[:-1], ks, delta), (row_ptr, ks, delta[:-1]),
                (row_ptr, ks, delta.view(torch.int32)), (row_ptr, ks.float(), delta), (row_ptr, ks, strided),
                (row_ptr, ks), "table", (row_ptr, ks.tolist(), delta)):
        with pytest.raises(W12GemmError, match="escape_table"):
            w12_gemm(x, t, escapes=bad)
