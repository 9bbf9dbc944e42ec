"""SwiGLU inside the W12 down projection's load (specpilot.w12.swiglu, §4.1).

The fused GEMV must give bit for bit what ``silu_mul`` followed by the same GEMV gives (escapes, bias, split K
summed in the kernel or by the second kernel, a ragged last step), stay within rounding of the plain PyTorch
reference, refuse what it cannot fuse, and leave a fused model's pass unchanged. CPU: the Triton interpreter in
float32; CUDA: compiled, bf16 too.
"""

from __future__ import annotations

import dataclasses

import pytest

from specpilot.model.transformer import KernelConfig
import torch

from .test_w12_gemm import assert_within_rounding, planted_weight
from .tritonutil import CUDA, DEV, triton  # noqa: F401

from specpilot.kernels import fused
from specpilot.w12.gemm import W12GemmError, w12_gemm
from specpilot.w12.linear import W12Linear
from specpilot.w12.swiglu import swiglu_fusable, w12_swiglu_down, w12_swiglu_down_reference
from specpilot.w12.format import encode

DTYPES = [torch.float32] + ([torch.bfloat16] if CUDA else [])


def gate_up_row(k, seed, dtype):
    """One random row ``[1, 2k]`` with gate values where silu saturates or vanishes (±30, ±100, 0, -0)."""
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(1, 2 * k, generator=g) * 2
    gu[0, :6] = torch.tensor([30.0, -30.0, 100.0, -100.0, 0.0, -0.0])
    return gu.to(DEV, dtype)


def w12_layer(n, k, seed, bias):
    t = encode(planted_weight(n, k, seed=seed), device=DEV)
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1)).to(DEV) if bias else None
    layer = W12Linear.from_w12(t, b)
    layer.use_kernel = True  # the interpreter on the CPU
    return layer, t


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,over", [
    (200, 300, dict()),  # default launch, K not a multiple of the 256-column step (masked x loads)
    (192, 512, dict(split_k=2, fused_split=True)),
    (192, 512, dict(split_k=2, fused_split=False)),  # the second kernel adds the escapes
    (130, 640, dict(block_n=32, block_k=128, split_k=5)),
])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_swiglu_is_bitwise_silu_mul_then_the_gemv(dtype, n, k, over, bias):
    layer, t = w12_layer(n, k, seed=n + k, bias=bias)
    gu = gate_up_row(k, seed=k, dtype=dtype)
    b = None if layer.bias is None else layer.bias.to(dtype)
    layer.bias = b
    assert swiglu_fusable(gu, layer)
    want = w12_gemm(fused.silu_mul(gu), t, b, gemv=True, lines=True, **over)
    got = w12_swiglu_down(gu, layer, **over)
    assert got.shape == (1, n) and got.dtype == dtype
    assert torch.equal(got, want), (got - want).abs().max()
    assert torch.equal(w12_swiglu_down(gu, layer, **over), got)  # deterministic
    x = fused.silu_mul_reference(gu.cpu().float())
    if dtype == torch.float32:
        assert_within_rounding(got.cpu(), x, _cpu(t), None if b is None else b.cpu())
    else:
        ref = w12_swiglu_down_reference(gu.float().cpu(), _cpu_layer(layer))
        assert torch.allclose(got.float().cpu(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def _cpu(t):
    from specpilot.w12.format import W12Tensor

    return W12Tensor(t.records.cpu(), t.base.cpu(), t.esc_idx.cpu(), t.esc_val.cpu(), t.shape, t.sha256)


def _cpu_layer(layer):
    c = W12Linear.from_w12(_cpu(layer.w12()), None if layer.bias is None else layer.bias.float().cpu())
    c.use_kernel = False
    return c


def test_fusable_only_for_one_contiguous_row_of_a_w12_layer():
    layer, _ = w12_layer(64, 128, seed=3, bias=False)
    gu = gate_up_row(128, seed=4, dtype=torch.float32)
    assert swiglu_fusable(gu, layer)
    lin = torch.nn.Linear(128, 64).to(DEV)
    two = torch.cat([gu, gu])
    wide = torch.cat([gu, gu], dim=1)[:, : 2 * 128 + 2]
    strided = torch.cat([gu, gu]).t().contiguous().t()[:1]
    for bad_x, bad_layer, why in ((two, layer, r"row gate_up \[1, 256\], got torch.strided \[2, 256\]"),
                                  (gu, lin, "Linear, not a W12Linear"), (wide, layer, r"\[1, 256\], got .*\[1, 258\]"),
                                  (gu[:, :128], layer, "got"), (gu.half(), layer, "float16 gate_up"),
                                  ("gate_up", layer, "str, not a tensor"), (gu.to_sparse_csr(), layer, "sparse_csr"),
                                  (gu.tolist(), layer, "list, not a tensor")):
        assert not swiglu_fusable(bad_x, bad_layer)
        with pytest.raises(W12GemmError, match="no fused SwiGLU: .*" + why) as e:
            w12_swiglu_down(bad_x, bad_layer)
        assert len(str(e.value)) < 200
    assert not strided.is_contiguous() and not swiglu_fusable(strided, layer)
    layer.use_kernel = False  # the reference path: nothing to fuse into
    assert not swiglu_fusable(gu, layer)
    with pytest.raises(W12GemmError, match="use_kernel = True"):
        w12_swiglu_down(gu, layer)
    layer.use_kernel = True
    layer.bias = torch.zeros(65, device=DEV)  # a wrong-shape bias is refused, not truncated
    with pytest.raises(W12GemmError, match=r"bias is \[65\], not \[64\]"):
        w12_swiglu_down(gu, layer)
    layer.bias = None
    with pytest.raises(W12GemmError, match="unknown"):
        w12_swiglu_down(gu, layer, block_z=4)
    assert torch.equal(w12_swiglu_down(gu, layer), w12_gemm(fused.silu_mul(gu), layer.w12()))  # still usable


def w12_tiny(tiny_dirs):
    """The tiny target with bf16-valued weights in W12, on the fused static path with every W12 kernel on (the
    Triton interpreter on the CPU)."""
    from specpilot.model.checkpoint import load_model
    from specpilot.w12.convert import to_w12

    target = load_model(tiny_dirs[0], device=DEV)
    with torch.no_grad():
        for p in target.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # bf16 values (W12 is for bf16 weights)
    w = to_w12(target)
    w.kernels = KernelConfig(fused=True)
    for m in w.modules():
        if isinstance(m, W12Linear):
            m.use_kernel = True
    return w


def test_a_fused_model_pass_is_bitwise_the_unfused_one(tiny_dirs, monkeypatch):
    """The tiny target in W12 on the fused static path (the Triton interpreter on the CPU): one row with
    ``fuse_swiglu`` on (every layer's down projection fused) and off give identical hidden states; three rows never
    take the fused path."""
    import specpilot.w12.swiglu as mod

    w = w12_tiny(tiny_dirs)
    w.kernels = dataclasses.replace(w.kernels, fuse_norm=False)  # otherwise the down projection adds the residual too (tests/test_w12_norm.py)
    calls = []

    def spy(gate_up, layer, **kw):
        calls.append(gate_up.shape[0])
        return mod.__dict__["_real"](gate_up, layer, **kw)

    monkeypatch.setitem(mod.__dict__, "_real", mod.w12_swiglu_down)
    monkeypatch.setattr(mod, "w12_swiglu_down", spy)
    for rows in (1, 3):
        outs = {}
        for on in (True, False):
            w.kernels = dataclasses.replace(w.kernels, fuse_swiglu=on)
            cache = w.new_cache(16)
            tokens = torch.arange(5, 5 + rows, device=DEV)
            pos = torch.arange(4, 4 + rows, device=DEV)
            mask = torch.ones(rows, rows, dtype=torch.bool, device=DEV).tril()
            outs[on] = w.forward_static(tokens, pos, cache, torch.tensor(4, device=DEV), mask)
        assert torch.equal(outs[True], outs[False])
    assert calls == [1] * w.args.num_layers  # one row fused in every layer; three rows never
