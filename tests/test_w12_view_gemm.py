"""The Q pass's GEMM over the W12 8-bit view (specpilot.w12.view, §4.1, §4.3) against its reference
(``approx_view`` then a float32 matmul), and ``W12Linear.view_forward``.

CPU: Triton interpreter with float32 activations; CUDA: compiled, float32 and bf16. The kernels must stay within the
rounding bound of specpilot/w12/view.py element by element, be bitwise deterministic, and never read the nibble plane
(records whose nibble bytes are random garbage give the same bits).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from .tritonutil import CUDA, DEV, triton  # noqa: F401

from specpilot.kernels.resources import ptxas_available
from specpilot.w12.escapes import W12GemmError, check_escape_table, codes_at, escape_table
from specpilot.w12.format import VIEW_BYTES, W12Tensor, approx_view, decode, encode
from specpilot.w12.gemm import w12_gemm_reference
from specpilot.w12.linear import W12Linear
from specpilot.w12.view import w12_view_gemm, w12_view_gemm_reference

from .test_w12_gemm import planted_weight

DTYPES = [torch.float32] + ([torch.bfloat16] if CUDA else [])


def _cpu(t: W12Tensor) -> W12Tensor:
    return W12Tensor(t.records.cpu(), t.base.cpu(), t.esc_idx.cpu(), t.esc_val.cpu(), t.shape, t.sha256)


def view_codes(t: W12Tensor) -> torch.Tensor:
    """What the view holds at every position, decoded with the midpoint nibble (saturated codes at escapes),
    float64 ``[N, K]``."""
    return approx_view(W12Tensor(t.records, t.base, t.esc_idx[:0], t.esc_val[:0], t.shape, t.sha256)).double()


def garbage_nibbles(t: W12Tensor, seed: int) -> W12Tensor:
    """``t`` with every nibble byte of every record replaced by random bytes (the views, bases and escapes kept)."""
    rec = t.records.clone()
    g = torch.Generator().manual_seed(seed)
    rec[..., VIEW_BYTES:] = torch.randint(0, 256, rec[..., VIEW_BYTES:].shape, generator=g, dtype=torch.uint8).to(rec.device)
    return W12Tensor(rec, t.base, t.esc_idx, t.esc_val, t.shape, t.sha256)


def view_bound(x, t, bias=None) -> torch.Tensor:
    """The bound of specpilot/w12/view.py, float64 ``[M, N]``: ``2 γ_{K+E+3} (Σ_k |x| (|a| + |c|) + |b|)``."""
    a, c = approx_view(t).double(), view_codes(t)
    nk = t.shape[1] + t.num_escapes + 3
    gamma = nk * 2.0**-24 / (1 - nk * 2.0**-24)
    return 2 * gamma * (x.double().abs() @ (a.abs() + c.abs()).T + (0 if bias is None else bias.double().abs()))


def assert_within_view_bound(out, x, t, bias=None):
    """``out`` (CPU) within the bound of the reference element by element (bf16 outputs: plus their own rounding);
    and the exact weights' output is not (so the check tells the view from the exact weights)."""
    ref = w12_view_gemm_reference(x, t, bias).double()
    bound = view_bound(x, t, bias)
    if out.dtype != torch.float32:
        bound = bound + 2.0**-8 * ref.abs() * 2
    err = (out.double() - ref).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"
    exact = w12_gemm_reference(x.float(), t, None if bias is None else bias.float()).double()
    assert bool(((exact - ref).abs() > bound).any()), "the exact weights would pass this check too"


def _bits(y: torch.Tensor) -> torch.Tensor:
    return y.view(torch.int32 if y.dtype == torch.float32 else torch.int16)


def planted_case(m, n, k, dtype, with_bias):
    """A planted weight ``[n, k]`` encoded on DEV (escapes: planted_weight's), activations ``[m, k]`` and a bias
    ``[n]`` (or None) in ``dtype``, all seeded by the shape."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    bias = torch.randn(n, generator=g).to(DEV, dtype) if with_bias else None
    return encode(planted_weight(n, k, seed=m + n), device=DEV), x, bias


# (M, N, K, overrides): the one-row line-coalesced GEMV, the [BLOCK_N, groups] GEMV (1 and 3 rows, split K), the
# tensor-core kernel at 3 / 16 / 33 rows (split K, ragged N and K, BLOCK_M 16 and 64)
CASES = [
    (1, 200, 300, dict()),
    (1, 130, 200, dict(gemv=True, lines=False, split_k=2, block_k=64)),
    (3, 200, 300, dict(gemv=True)),
    (3, 130, 700, dict(gemv=False, block_n=64, block_k=128)),
    (16, 200, 300, dict(block_n=32, block_k=64, split_k=2)),
    (33, 70, 130, dict(block_n=32, block_k=64)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,over", CASES)
def test_view_gemm_matches_reference_is_deterministic_and_reads_no_nibble(dtype, m, n, k, over):
    t, x, bias = planted_case(m, n, k, dtype, with_bias=bool(m % 2))
    assert t.num_escapes >= 12
    out = w12_view_gemm(x, t, bias, **over)
    assert out.shape == (m, n) and out.dtype == dtype and bool(torch.isfinite(out).all())
    assert_within_view_bound(out.cpu(), x.cpu(), _cpu(t), None if bias is None else bias.cpu())
    assert torch.equal(_bits(w12_view_gemm(x, t, bias, **over)), _bits(out)), "two runs must be bitwise identical"
    junk = garbage_nibbles(t, seed=m + k)
    assert torch.equal(approx_view(junk), approx_view(t))  # the reference reads no nibble either
    assert not torch.equal(decode(junk, check=False), decode(t, check=False))  # the garbage does change the weights
    assert torch.equal(_bits(w12_view_gemm(x, junk, bias, **over)), _bits(out)), "the kernel read the nibble plane"


def test_view_escape_table_and_codes():
    """``escape_table(w12, view=True)``: the exact table's rows and columns, deltas ``true − c_view`` with ``c_view``
    the saturated view byte decoded with the midpoint nibble (not the exact codes); no nibble is read."""
    w = planted_weight(150, 70, seed=3)
    w[7, ::3] = 0  # channel 7: 24 escapes, 20 of them past the slots
    t = encode(w)
    idx = t.esc_idx.long()
    cv = codes_at(t, idx, view=True)
    assert torch.equal(cv.double(), view_codes(t).view(-1)[idx])
    assert not torch.equal(cv, codes_at(t, idx))  # saturated nibbles are 0000b / 1111b, the view's 1000b
    assert torch.equal(codes_at(garbage_nibbles(t, 1), idx, view=True), cv)
    rp, ks, d = escape_table(t)
    rpv, ksv, dv = escape_table(t, view=True)
    assert torch.equal(rp, rpv) and torch.equal(ks, ksv) and not torch.equal(d, dv)
    filled = ksv >= 0
    flat = (torch.searchsorted(rpv, torch.arange(ksv.numel(), dtype=torch.int32), right=True) - 1).long()
    flat[:150 * 4] = torch.arange(150).repeat_interleave(4)  # slot entries: channel = entry // 4
    pos = flat[filled] * 70 + ksv[filled].long()
    true = decode(t, check=False).float().view(-1)[pos]
    assert torch.equal(dv[filled], true - codes_at(t, pos, view=True).float())
    check_escape_table(t, (rpv, ksv, dv), view=True)
    with pytest.raises(W12GemmError, match="escape_table"):
        check_escape_table(t, (rpv, ksv, dv))  # a view table is not the exact kernels' table


def test_view_gemm_refuses_the_exact_table_and_the_byte_kernel():
    t = encode(planted_weight(64, 128, seed=5), device=DEV)
    x = torch.randn(2, 128, device=DEV)
    with pytest.raises(W12GemmError, match="view=True"):
        w12_view_gemm(x, t, escapes=escape_table(t))
    with pytest.raises(W12GemmError, match="words=False"):
        w12_view_gemm(x, t, words=False)
    with pytest.raises(W12GemmError):
        w12_view_gemm(torch.randn(2, 127, device=DEV), t)
    with pytest.raises(W12GemmError, match="W12Tensor"):
        w12_view_gemm_reference(x.cpu(), torch.randn(64, 128))
    esc = escape_table(t, view=True)
    assert torch.equal(w12_view_gemm(x, t, escapes=esc), w12_view_gemm(x, t))


def test_nonfinite_escapes_propagate_like_the_reference():
    n, k, m = 64, 128, 3
    g = torch.Generator().manual_seed(9)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    w[1, 3], w[2, 4], w[3, 5] = float("inf"), float("-inf"), float("nan")
    w[4, 6], w[4, 7] = float("inf"), float("-inf")  # both signs in one row: NaN or ±inf, as x's signs say
    w[5, 8] = float("inf")  # meets x = 0 in row 0 of x: NaN there, inf elsewhere
    t = encode(w, device=DEV)
    x = torch.randn(m, k, generator=g)
    x[0, 8] = 0.0
    x = x.to(DEV)
    ref = w12_view_gemm_reference(x.cpu(), _cpu(t))
    for over in (dict(gemv=True), dict(gemv=False)):
        out = w12_view_gemm(x, t, **over).cpu()
        assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())
        assert torch.equal(out[out.isinf()], ref[ref.isinf()])
        assert out[0, 5].isnan() and out[1, 5].isinf() and out[:, 3].isnan().all() and not out[:, 4].isfinite().any()
        fin = ref.isfinite()
        torch.testing.assert_close(out[fin], ref[fin], atol=1e-5, rtol=1e-5)


def test_view_forward_on_the_cpu_is_x_times_the_approx_view():
    """The reference path: ``x @ approx_view(W)ᵀ (+ b)`` in float32 bit for bit, for any leading shape; its weight is
    kept apart from forward's decoded one, and forward still gives the exact layer."""
    g = torch.Generator().manual_seed(2)
    w = planted_weight(90, 100, seed=4)
    bias = torch.randn(90, generator=g)
    layer = W12Linear(encode(w), bias)
    a = approx_view(layer.w12()).float()
    assert not torch.equal(a, w.float())
    for shape in ((1, 100), (5, 100), (2, 3, 100)):
        x = torch.randn(shape, generator=g)
        assert torch.equal(layer.view_forward(x), F.linear(x, a, bias)), shape
        assert torch.equal(layer(x), F.linear(x, w.float(), bias)), shape
    nobias = W12Linear(encode(w))
    x = torch.randn(4, 100, generator=g)
    assert torch.equal(nobias.view_forward(x), x @ a.T)
    assert layer.view_forward(torch.randn(0, 100)).shape == (0, 90)
    with pytest.raises(W12GemmError):
        layer.view_forward(torch.randn(2, 99))


def test_view_forward_kernel_path_chunks_and_stays_in_bound():
    """``use_kernel`` True (the interpreter on the CPU): the view kernels with the layer's own view table, in
    launches of at most 256 rows (300 rows: two), within the bound of the reference."""
    t, x, bias = planted_case(300, 40, 70, torch.float32, with_bias=True)
    layer = W12Linear(t, bias)
    layer.use_kernel = True
    out = layer.view_forward(x.reshape(3, 100, 70))
    assert out.shape == (3, 100, 40)
    assert_within_view_bound(out.reshape(300, 40).cpu(), x.cpu(), _cpu(t), bias.cpu())
    assert torch.equal(out.reshape(300, 40)[256:], w12_view_gemm(x[256:], t, bias))


def test_view_table_is_rebuilt_by_load_state_dict():
    """The view deltas are derived (not in ``state_dict``) and follow a loaded weight."""
    w = planted_weight(64, 96, seed=6)
    other = w.clone()
    other[w == 0] = 1e-38  # the same escape positions (below the window), other true values
    a, b = W12Linear(encode(w)), W12Linear(encode(other))
    assert "esc_view_delta_bits" not in a.state_dict()
    x = torch.randn(3, 96)
    a.view_forward(x)  # keeps a's approximate weight
    a.load_state_dict(b.state_dict())
    assert torch.equal(a.view_escapes()[2], escape_table(b.w12(), view=True)[2])
    assert torch.equal(a.view_forward(x), b.view_forward(x))


COMPILE_SCRIPT = r"""
import json
from specpilot.kernels.resources import kernel_ptx
from specpilot.w12 import gemv, mma
from specpilot.w12.tiles import WORD_KERNEL_SIGNATURE
common = dict(BLOCK_N=16, SPLIT_K=2, FUSED=True, EVEN=False, X_EVEN=False, HAS_BIAS=True)
out = []
for kern, consts, warps in ((gemv._w12_gemv_lines_kernel, dict(BLOCK_K=256, ASM=False), 1),
                            (gemv._w12_gemv_kernel, dict(BLOCK_K=512, ROWS=4, ASM=False), 4),
                            (mma._w12_mma_kernel, dict(BLOCK_M=16, BLOCK_K=64, FP32=False, ASM=True), 4)):
    rec_q = f"{kern.__name__}_param_{kern.arg_names.index('RecQ')}]"
    ptx = [kernel_ptx(kern, WORD_KERNEL_SIGNATURE, common | consts | dict(VIEW=v), warps, 3) for v in (False, True)]
    out.append([kern.__name__, rec_q in ptx[0], rec_q in ptx[1]])
print(json.dumps(out))
"""


@pytest.mark.skipif(not ptxas_available(), reason="Triton's NVIDIA backend (bundled ptxas) is not installed here")
def test_compiled_view_kernels_never_read_the_nibble_plane():
    """The GPU build (offline sm_90a compile, no GPU): with ``VIEW`` the one-row GEMV, the few-row GEMV and the
    tensor-core kernel (masked K, split K, bias) never refer to their ``RecQ`` argument, the nibble plane's
    address; the exact kernels do (the check can fail). The interpreter runs above cannot see the compiled code."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], capture_output=True, text=True, timeout=600, env=env,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 3 and all(exact and not view for _, exact, view in rows), rows
