"""The prepacked CPU projection (specpilot.kernels.cpu_linear) against its F.linear reference, and its bookkeeping."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specpilot.kernels.cpu_linear import PackedLinear, pack_linears, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="this PyTorch build has no oneDNN weight packing")


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 7, 33, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_reference(rows, bias):
    torch.manual_seed(rows)
    lin = nn.Linear(96, 160, bias=bias)
    packed = PackedLinear.from_linear(lin)
    x = torch.randn(rows, 96)
    with torch.no_grad():
        got, want = packed(x), F.linear(x, lin.weight, lin.bias)
        assert packed.uses_pack(x)
    assert got.shape == want.shape == (rows, 160)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_leading_dims_and_strided_input():
    lin = nn.Linear(64, 48)
    packed = PackedLinear.from_linear(lin)
    x = torch.randn(3, 5, 64)
    xt = torch.randn(64, 6).t()  # not contiguous
    with torch.no_grad():
        torch.testing.assert_close(packed(x), packed.reference(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed(xt), packed.reference(xt), rtol=1e-5, atol=1e-5)


def test_follows_in_place_weight_writes():
    lin = nn.Linear(32, 16, bias=False)
    packed = PackedLinear.from_linear(lin)
    x = torch.randn(4, 32)
    with torch.no_grad():
        before = packed(x)
        lin.weight.mul_(2.0)  # the shared Parameter: the pack must be rebuilt
        after = packed(x)
    torch.testing.assert_close(after, 2.0 * before, rtol=1e-5, atol=1e-5)


def test_dtype_change_and_autograd_fall_back_to_reference():
    lin = nn.Linear(32, 16)
    packed = PackedLinear.from_linear(lin)
    x = torch.randn(4, 32, requires_grad=True)
    y = packed(x)  # the weight requires grad: F.linear, so gradients flow
    assert not packed.uses_pack(x)
    y.sum().backward()
    assert lin.weight.grad is not None and x.grad is not None
    frozen = PackedLinear.from_linear(nn.Linear(32, 16).requires_grad_(False))  # a frozen target's head
    h = torch.randn(4, 32, requires_grad=True)  # a drafter's output being trained through it
    assert not frozen.uses_pack(h)
    frozen(h).square().sum().backward()
    torch.testing.assert_close(h.grad, (2 * frozen.reference(h.detach())) @ frozen.weight)
    packed = packed.to(torch.bfloat16)
    xb = torch.randn(4, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        assert not packed.uses_pack(xb)
        assert torch.equal(packed(xb), F.linear(xb, packed.weight, packed.bias))


def test_pack_linears_keeps_ties_and_skips_others():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 16)
            self.proj = nn.Linear(16, 16)
            self.head = nn.Linear(16, 50, bias=False)
            self.head.weight = self.emb.weight
            self.bf16 = nn.Linear(16, 16).to(torch.bfloat16)

    m = M()
    assert pack_linears(m) == 0  # all below MIN_PACK_WEIGHTS: oneDNN's call overhead loses there
    assert pack_linears(m, min_weights=0) == 2
    assert isinstance(m.proj, PackedLinear) and isinstance(m.head, PackedLinear)
    assert m.proj._pack is not None and m.head._pack is not None  # packed at load, not on the first request
    assert type(m.bf16) is nn.Linear
    assert m.head.weight is m.emb.weight
    assert pack_linears(m, min_weights=0) == 0  # idempotent
    h = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(m.head(h), h @ m.emb.weight.T, rtol=1e-5, atol=1e-5)
    assert set(m.state_dict()) == {"emb.weight", "proj.weight", "proj.bias", "head.weight", "bf16.weight",
                                   "bf16.bias"}


def test_load_model_packs_on_cpu_float32_and_logits_agree():
    from specpilot.model.checkpoint import load_model
    from specpilot.zoo import bundled_target_dir

    packed = load_model(bundled_target_dir(), "float32", "cpu")
    plain = load_model(bundled_target_dir(), "float32", "cpu", pack=False)
    assert isinstance(packed.lm_head, PackedLinear) and type(plain.lm_head) is nn.Linear
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) > 1
    assert not any(isinstance(m, PackedLinear) for m in load_model(bundled_target_dir(), "bfloat16").modules())
    ids, pos = torch.randint(0, packed.args.vocab_size, (12,)), torch.arange(12)
    with torch.no_grad():
        a = packed.logits(packed.forward(ids, pos, packed.new_cache(16), 0))
        b = plain.logits(plain.forward(ids, pos, plain.new_cache(16), 0))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_deepcopy_and_pickle_drop_the_pack():
    import copy
    import pickle

    lin = PackedLinear.from_linear(nn.Linear(16, 8))
    x = torch.randn(2, 16)
    with torch.no_grad():
        want = lin(x)  # builds the pack
        for other in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
            assert other._pack is None and other.weight is not lin.weight
            torch.testing.assert_close(other(x), want, rtol=0, atol=0)
