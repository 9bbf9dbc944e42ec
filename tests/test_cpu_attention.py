"""The C++ CPU decode attention against its plain PyTorch reference (each request's SDPA over its own keys)."""

import pytest
import torch

from specpilot.kernels import cpu_attention as ca

pytestmark = pytest.mark.skipif(not ca.available(), reason="no C++ toolchain to build the CPU decode attention")


@pytest.mark.parametrize("b,kvh,g,d", [(1, 1, 1, 64), (3, 3, 3, 64), (5, 2, 4, 128), (9, 4, 2, 32), (40, 3, 3, 64)])
def test_decode_attention_matches_the_reference(b, kvh, g, d):
    torch.manual_seed(b * 100 + d)
    slots_n, layers, slot_len = b + 3, 3, 37
    kp, vp = torch.randn(slots_n, layers, slot_len, kvh, d), torch.randn(slots_n, layers, slot_len, kvh, d)
    q = torch.randn(b, kvh * g, d)
    slots = torch.randperm(slots_n)[:b]
    lens = torch.randint(1, slot_len + 1, (b,))
    lens[0] = 1  # a request that sees one key
    for layer in range(layers):
        got = ca.decode_attention(q, kp, vp, layer, slots, lens)
        want = ca.decode_attention_reference(q, kp, vp, layer, slots, lens)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


def test_keys_past_a_requests_length_are_never_read():
    torch.manual_seed(1)
    kp, vp = torch.randn(4, 2, 16, 2, 64), torch.randn(4, 2, 16, 2, 64)
    q, slots, lens = torch.randn(2, 4, 64), torch.tensor([2, 0]), torch.tensor([5, 9])
    before = ca.decode_attention(q, kp, vp, 1, slots, lens)
    kp[2, 1, 5:], vp[2, 1, 5:], kp[0, 1, 9:], vp[0, 1, 9:] = float("nan"), float("nan"), float("nan"), float("nan")
    kp[1], vp[1] = float("nan"), float("nan")  # a slot no request holds
    torch.testing.assert_close(ca.decode_attention(q, kp, vp, 1, slots, lens), before, rtol=0, atol=0)


def test_bad_layouts_raise():
    kp = torch.randn(2, 1, 8, 1, 64)
    q, slots, lens = torch.randn(1, 1, 64), torch.tensor([0]), torch.tensor([3])
    with pytest.raises(RuntimeError, match="float32"):
        ca.decode_attention(q.double(), kp, kp, 0, slots, lens)
    with pytest.raises(RuntimeError, match="contiguous"):
        ca.decode_attention(q, kp[:, :, ::2], kp[:, :, ::2], 0, slots, lens)
    with pytest.raises(RuntimeError, match="int64"):
        ca.decode_attention(q, kp, kp, 0, slots.int(), lens)
    with pytest.raises(RuntimeError, match="layer"):
        ca.decode_attention(q, kp, kp, 1, slots, lens)
