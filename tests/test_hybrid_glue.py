"""The hybrid static pass's fused glue kernels (GDN pre-mix with the gates, gated RMS norm, zero-centred RMS norm)
against their PyTorch references, and the references against the model's own modules; Triton's interpreter on the
CPU, compiled on CUDA."""

from __future__ import annotations

import pytest
import torch

from .tritonutil import CUDA, DEV, triton  # noqa: F401  (sets up the interpreter on the CPU)

from specpilot.kernels.hybrid_glue import (gated_rmsnorm, gated_rmsnorm_reference, gdn_premix,  # noqa: E402
                                           gdn_premix_reference, zc_rmsnorm, zc_rmsnorm_reference)
from specpilot.model.args import ModelArgs  # noqa: E402
from specpilot.model.gdn import GatedDeltaNet, conv_index  # noqa: E402
from specpilot.model.hybrid import ZeroCentredRMSNorm  # noqa: E402
from specpilot.model.hybrid_static import conv_index_on_device  # noqa: E402

#: float32 bounds (values O(1) to O(10)). In the interpreter the kernels differ from the references only by float32
#: reassociation (sums of squares, rsqrt as 1/sqrt, the conv's sum, log1p); the max abs differences measured over
#: these tests' shapes (and d_k = d_v = 128, D = 5120) are in each test's docstring; compiled (other sum order, FMAs)
#: not measured here, hence looser bounds on CUDA
TOL = dict(atol=2e-5, rtol=2e-5) if CUDA else dict(atol=1e-6, rtol=1e-6)

#: bfloat16 (the model dtype on the GPU) only where compiled: the interpreter's bfloat16 arithmetic is not torch's
#: (NaN and one-ulp differences seen on the CPU); the kernels round to the model dtype where the references do, so a
#: compiled run should differ by at most a bf16 ulp or two of an intermediate (test_fused.py's bound)
DTYPES = [torch.float32] + ([torch.bfloat16] if CUDA else [])
BF16_TOL = dict(atol=2e-2, rtol=2e-2)

TREES = {"chain": list(range(-1, 7)), "tree": [-1, 0, 1, 0, 3, 2, 5, 1], "forest": [-1, -1, 0, 1, -1],
         "one": [-1]}


def gdn_layer(hk=2, hv=4, dk=16, dv=32, kern=4, seed=0, fused=True, dtype=torch.float32) -> GatedDeltaNet:
    args = ModelArgs(model_type="qwen3_5_text", vocab_size=32, hidden_size=48, intermediate_size=64, num_layers=1,
                     n_heads=2, n_kv_heads=1, head_dim=16, layer_types=["linear_attention"],
                     linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk,
                     linear_value_head_dim=dv, linear_conv_kernel_dim=kern)
    torch.manual_seed(seed)
    layer = GatedDeltaNet(args).float()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    if fused:
        layer.fuse()
    return layer.to(dtype).requires_grad_(False)


def premix_inputs(layer, parents, gen):
    """The layer's raw projections of random rows (column views of one fused GEMM's output), a random committed
    window and the pass's conv index."""
    r = len(parents)
    dt = layer.A_log.dtype
    x = torch.randn(r, 48, generator=gen).to(dt)
    mixed, z, b, a = layer.project(x)
    window = torch.randn(layer.kernel - 1, layer.conv_dim, generator=gen).to(dt)
    idx = conv_index_on_device(torch.tensor(parents), layer.kernel)
    return x, mixed, z, b, a, window, idx


def run_premix(layer, mixed, window, idx, b, a):
    r, h = b.shape
    dev = lambda t: t.to(DEV)  # noqa: E731
    k, v = torch.full((r, h, layer.dk), 7.0, device=DEV), torch.full((r, h, layer.dv), 7.0, device=DEV)
    g, beta = torch.full((r, h), 7.0, device=DEV), torch.full((r, h), 7.0, device=DEV)
    mixed_out = torch.zeros(r, layer.conv_dim, dtype=mixed.dtype, device=DEV)
    q = gdn_premix(dev(mixed), dev(window), dev(idx), dev(layer.conv1d.weight), dev(b), dev(a), dev(layer.A_log),
                   dev(layer.dt_bias), layer.hk, layer.dk, k, v, g, beta, mixed_out)
    return [t.cpu() for t in (q, k, v, g, beta, mixed_out)]


@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(TREES))
@pytest.mark.parametrize("heads", [(2, 4, 16, 32, 4), (2, 2, 32, 16, 2), (1, 4, 16, 16, 3)],
                         ids=["rep2", "rep1_k2", "rep4_k3"])
def test_premix_kernel_equals_its_reference_and_writes_the_record(name, heads, dtype):
    """q, k, v, g, β within float32 reassociation of the reference (interpreter: max abs 3e-8, 1.2e-7, 4.8e-7, 4.8e-7, 6e-8 measured), the record's
    conv inputs an exact copy, every output element written."""
    hk, hv, dk, dv, kern = heads
    layer = gdn_layer(hk, hv, dk, dv, kern, dtype=dtype)
    gen = torch.Generator().manual_seed(len(TREES[name]))
    _, mixed, _, b, a, window, idx = premix_inputs(layer, TREES[name], gen)
    assert mixed.stride(0) != mixed.shape[1] and b.stride(0) != b.shape[1]  # views of the fused output
    ref = gdn_premix_reference(mixed, window, idx, layer.conv1d.weight, b, a, layer.A_log, layer.dt_bias, hk, dk)
    got = run_premix(layer, mixed, window, idx, b, a)
    for what, x, y in zip("q k v g beta".split(), got, ref):
        torch.testing.assert_close(x, y, **(TOL if dtype == torch.float32 else BF16_TOL), msg=what)
    assert torch.equal(got[5], mixed)


@torch.inference_mode()
def test_premix_gates_at_softplus_extremes():
    """``a + dt_bias`` past softplus's threshold (20) and far below 0 (log1p of tiny values), β near 0 and 1: g to
    1e-6 relative in the interpreter (1e-5 compiled, whose exp / log are approximate)."""
    layer = gdn_layer()
    gen = torch.Generator().manual_seed(3)
    _, mixed, _, b, a, window, idx = premix_inputs(layer, TREES["tree"], gen)
    a, b = a.clone(), b.clone()
    a[:, 0], a[:, 1], a[:, 2], b[:, 0], b[:, 1] = 30.0, -30.0, 19.9, 40.0, -40.0
    a[0, 3], a[1, 3] = -60.0, -1e-4  # e^-60 stays a normal float32 (no flush to zero compiled)
    ref = gdn_premix_reference(mixed, window, idx, layer.conv1d.weight, b, a, layer.A_log, layer.dt_bias, 2, 16)
    got = run_premix(layer, mixed, window, idx, b, a)
    torch.testing.assert_close(got[3], ref[3], atol=0, rtol=1e-5 if CUDA else 1e-6)  # g: relative, to e^-60
    torch.testing.assert_close(got[4], ref[4], **TOL)


@torch.inference_mode()
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "four_projections"])
def test_premix_reference_is_the_layers_own_math(fused):
    """The reference gives exactly what :class:`GatedDeltaNet` computes (inputs, conv along root paths, qkv)."""
    layer = gdn_layer(fused=fused)
    parents = TREES["tree"]
    gen = torch.Generator().manual_seed(5)
    x, mixed, z, b, a, window, idx = premix_inputs(layer, parents, gen)
    m2, z2, g2, beta2 = layer.inputs(x)
    q2, k2, v2 = layer.qkv(layer.conv(window, m2, parents))
    assert torch.equal(idx, conv_index(parents, layer.kernel))
    ref = gdn_premix_reference(mixed, window, idx, layer.conv1d.weight, b, a, layer.A_log, layer.dt_bias, 2, 16)
    for x1, x2 in zip(ref, (q2, k2, v2, g2, beta2)):
        assert torch.equal(x1, x2)
    assert torch.equal(z, z2) and torch.equal(mixed, m2)


@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dv", [16, 64])
def test_gated_rmsnorm_kernel_equals_reference_and_the_module(dv, dtype):
    """Kernel within float32 reassociation of the reference (interpreter: max abs 9.5e-7 measured at d_v = 128); the reference is
    exactly :class:`GatedRMSNorm` of the output cast to the model dtype, flattened per row."""
    layer = gdn_layer(hv=4, dv=dv, dtype=dtype)
    gen = torch.Generator().manual_seed(dv)
    r, h = 7, layer.hv
    o = torch.randn(r, h, dv, generator=gen) * 3
    _, _, z, _, _, _, _ = premix_inputs(layer, list(range(-1, r - 1)), gen)
    assert not z.is_contiguous()  # a view of the fused projection's output
    ref = gated_rmsnorm_reference(o, z, layer.norm.weight, layer.norm.eps)
    assert torch.equal(ref, layer.norm(o.to(z.dtype), z).reshape(r, -1))
    got = gated_rmsnorm(o.to(DEV), z.to(DEV), layer.norm.weight.to(DEV), layer.norm.eps).cpu()
    torch.testing.assert_close(got, ref, **(TOL if dtype == torch.float32 else BF16_TOL))


@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 96])
@pytest.mark.parametrize("add", [False, True], ids=["norm", "add_norm"])
def test_zc_rmsnorm_kernel_equals_reference_and_the_module(d, add, dtype):
    """Kernel within float32 reassociation of the reference (interpreter: max abs 4.8e-7 measured, D up to 5120), the residual sum exact;
    the reference is exactly :class:`ZeroCentredRMSNorm` of ``x + delta``. ``d = 96``: a masked tail."""
    torch.manual_seed(d)
    norm = ZeroCentredRMSNorm(d, 1e-6)
    with torch.no_grad():
        norm.weight.add_(torch.randn(d) * 0.3)
    norm.to(dtype)
    x, delta = (torch.randn(5, d) * 2).to(dtype), (torch.randn(5, d).to(dtype) if add else None)
    ref, ref_x = zc_rmsnorm_reference(x, delta, norm.weight, norm.eps)
    assert torch.equal(ref, norm(x + delta if add else x))
    got, got_x = zc_rmsnorm(x.to(DEV), None if delta is None else delta.to(DEV), norm.weight.to(DEV), norm.eps)
    torch.testing.assert_close(got.cpu(), ref, **(TOL if dtype == torch.float32 else BF16_TOL))
    assert torch.equal(got_x.cpu(), ref_x)


def test_bad_shapes_are_one_line_errors():
    layer = gdn_layer()
    gen = torch.Generator().manual_seed(0)
    _, mixed, z, b, a, window, idx = premix_inputs(layer, TREES["chain"], gen)
    with pytest.raises(ValueError, match="k_out"):
        gdn_premix(mixed, window, idx, layer.conv1d.weight, b, a, layer.A_log, layer.dt_bias, 2, 16,
                   torch.empty(8, 4, 8), torch.empty(8, 4, 32), torch.empty(8, 4), torch.empty(8, 4),
                   torch.empty(8, layer.conv_dim))
    with pytest.raises(ValueError, match="gated_rmsnorm"):
        gated_rmsnorm(torch.randn(8, 4, 32, dtype=torch.float64), z, layer.norm.weight, 1e-6)
    with pytest.raises(ValueError, match="delta"):
        zc_rmsnorm(torch.randn(3, 8), torch.randn(3, 9), torch.zeros(8), 1e-6)
