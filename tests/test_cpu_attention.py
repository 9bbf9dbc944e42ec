"""The C++ CPU decode attention against the plain PyTorch reference of the batched tree attention (each request's SDPA
over its own keys)."""

import pytest
import torch

from specpilot.kernels import cpu_attention as ca
from specpilot.kernels.batch_attention import batch_tree_attention_reference

needs_build = pytest.mark.skipif(not ca.available(), reason="no C++ toolchain to build the CPU decode attention")


@needs_build
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
        ones = torch.ones(b, dtype=torch.long)  # one row a request, seeing every key before its own and itself
        want = batch_tree_attention_reference(q, kp[:, layer], vp[:, layer], slots, lens - 1, ones, torch.arange(b),
                                              torch.ones(b, 1, 1, dtype=torch.bool), d ** -0.5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@needs_build
def test_keys_past_a_requests_length_are_never_read():
    torch.manual_seed(1)
    kp, vp = torch.randn(4, 2, 16, 2, 64), torch.randn(4, 2, 16, 2, 64)
    q, slots, lens = torch.randn(2, 4, 64), torch.tensor([2, 0]), torch.tensor([5, 9])
    before = ca.decode_attention(q, kp, vp, 1, slots, lens)
    kp[2, 1, 5:], vp[2, 1, 5:], kp[0, 1, 9:], vp[0, 1, 9:] = float("nan"), float("nan"), float("nan"), float("nan")
    kp[1], vp[1] = float("nan"), float("nan")  # a slot no request holds
    torch.testing.assert_close(ca.decode_attention(q, kp, vp, 1, slots, lens), before, rtol=0, atol=0)


@needs_build
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


def _tree_mask(c: int, rng: torch.Generator) -> torch.Tensor:
    """A random tree's ``[c, c]`` ancestor-or-self mask (row 0 the root; each later row's parent an earlier row)."""
    m = torch.eye(c, dtype=torch.bool)
    for i in range(1, c):
        parent = int(torch.randint(0, i, (1,), generator=rng))
        m[i] |= m[parent]
    return m


@needs_build
@pytest.mark.parametrize("b,kvh,g,d", [(1, 1, 2, 64), (4, 3, 3, 64), (7, 2, 2, 128), (3, 1, 4, 48)])
def test_tree_rows_match_the_batched_tree_reference(b, kvh, g, d):
    from specpilot.kernels.batch_attention import pack_batch_masks

    rng = torch.Generator().manual_seed(b * 7 + d)
    slots_n, layers, slot_len = b + 2, 2, 48
    kp = torch.randn(slots_n, layers, slot_len, kvh, d, generator=rng)
    vp = torch.randn(slots_n, layers, slot_len, kvh, d, generator=rng)
    counts = torch.randint(1, 9, (b,), generator=rng)
    counts[0] = 1
    starts = torch.stack([torch.randint(0, slot_len - int(c) + 1, (1,), generator=rng)[0] for c in counts])
    starts[-1] = 0  # a request with no committed keys (a prompt's first rows)
    r_max = int(counts.max())
    masks = torch.zeros(b, r_max, r_max, dtype=torch.bool)
    for i, c in enumerate(counts.tolist()):  # trees, and a causal chain
        masks[i, :c, :c] = torch.ones(c, c, dtype=torch.bool).tril() if i % 2 else _tree_mask(c, rng)
    slots = torch.randperm(slots_n, generator=rng)[:b]
    row_off = (counts.cumsum(0) - counts).int()
    q = torch.randn(int(counts.sum()), kvh * g, d, generator=rng)
    for layer in range(layers):
        got = ca.tree_decode_attention(q, kp, vp, layer, slots, starts.int(), counts.int(), row_off,
                                       pack_batch_masks(masks))
        want = batch_tree_attention_reference(q, kp[:, layer], vp[:, layer], slots, starts, counts, row_off, masks,
                                              d ** -0.5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@needs_build
def test_rows_out_of_range_raise_before_reading():
    kp = torch.randn(2, 1, 8, 1, 64)
    words = torch.ones(2, 1, 1, dtype=torch.int32)
    one, slots = torch.ones(2, dtype=torch.int32), torch.tensor([0, 1])
    q = torch.randn(2, 1, 64)
    for starts, row_off, sl in [((7, 8), (0, 1), slots), ((0, 0), (0, 2), slots), ((0, 0), (0, 1), torch.tensor([0, 2]))]:
        with pytest.raises(RuntimeError, match="out of range"):
            ca.tree_decode_attention(q, kp, kp, 0, sl, torch.tensor(starts, dtype=torch.int32), one,
                                     torch.tensor(row_off, dtype=torch.int32), words)
    with pytest.raises(RuntimeError, match="rows"):
        ca.tree_decode_attention(q[:1], kp, kp, 0, slots, torch.zeros(2, dtype=torch.int32), one,
                                 torch.tensor([0, 1], dtype=torch.int32), words)


def test_a_machine_that_cannot_build_it_warns_once_and_the_stack_keeps_its_pytorch_attention(monkeypatch, tiny_models):
    import torch.utils.cpp_extension as ext

    from specpilot.model.compiled_stack import CompiledStack

    def no_compiler(*a, **k):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(ext, "load_inline", no_compiler)
    monkeypatch.setattr(ca, "_BUILT", {})
    with pytest.warns(UserWarning, match="did not build .*Ninja is required"):
        assert not ca.available()
    assert not ca.available()  # no second try, no second warning
    with pytest.raises(RuntimeError, match="not available"):
        ca.decode_attention(torch.zeros(1, 1, 64), torch.zeros(1, 1, 2, 1, 64), torch.zeros(1, 1, 2, 1, 64), 0,
                            torch.tensor([0]), torch.tensor([1]))
    assert not CompiledStack(tiny_models[0]).decode_kernel
