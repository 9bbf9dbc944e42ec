"""GDN tree verification kernels (path recompute, commit replay) against their PyTorch references and each other; the
Triton interpreter on the CPU, compiled on CUDA."""

from __future__ import annotations

import pytest
import torch

from .tritonutil import CUDA, DEV, triton  # noqa: F401  (sets up the interpreter on the CPU)

from specpilot.kernels.gdn_tree import (PAD, gdn_commit, gdn_commit_reference, gdn_tree,  # noqa: E402
                                        gdn_tree_reference, root_paths)
from specpilot.model.args import ModelArgs  # noqa: E402
from specpilot.model.gdn import GatedDeltaNet  # noqa: E402

H, DK, DV = 4, 16, 32
#: max abs difference allowed against the eager reference (outputs and states O(1)). In the interpreter (float32 numpy,
#: the reference's order of operations, numpy's sums) these shapes measure 0, d_k = d_v = 128 up to 6e-8 and the
#: probe's --tiny run up to 2.4e-7; compiled (other sum order, FMAs) not measured here, hence the looser bound
TOL = 2e-5 if CUDA else 1e-6

TREES = {
    "one": [-1],
    "chain": list(range(-1, 11)),  # 12 rows
    "star": [-1, 0, 0, 0, 0, 0, 0],
    "forest": [-1, -1, 0, 1, -1],  # several roots over the committed state
    "deep_branch": [-1, 0, 1, 2, 3, 4, 5, 2, 7, 8, 9, 3],  # depth 7 and a second branch of depth 6
    "bushy": [-1, 0, 0, 1, 1, 2, 3, 3, 5, 8],
    "padded": [-1, 0, PAD, 1, 0, PAD, PAD],  # padding rows in between and at the end
}


def step_inputs(gen, r, layers=None):
    """Random delta-rule inputs as gdn.py makes them: q, k L2-normalised (q scaled by d_k^-½), g < 0, β in (0, 1)."""
    lead = (r,) if layers is None else (layers, r)
    q = torch.nn.functional.normalize(torch.randn(*lead, H, DK, generator=gen), dim=-1) * DK**-0.5
    k = torch.nn.functional.normalize(torch.randn(*lead, H, DK, generator=gen), dim=-1)
    v = torch.randn(*lead, H, DV, generator=gen)
    g = -2 * torch.rand(*lead, H, generator=gen)
    beta = torch.rand(*lead, H, generator=gen)
    return q, k, v, g, beta


def dev(*ts):
    return [t.to(DEV) for t in ts]


def i32(x):
    return torch.tensor(x, dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("name", sorted(TREES))
def test_path_kernel_matches_reference_and_leaves_the_state(name):
    parents = TREES[name]
    gen = torch.Generator().manual_seed(len(parents))
    s0 = torch.randn(H, DK, DV, generator=gen)
    inputs = step_inputs(gen, len(parents))
    ref = gdn_tree_reference(s0, *inputs, parents)
    s0_dev = s0.to(DEV)
    before = s0_dev.clone()
    out = gdn_tree(s0_dev, *dev(*inputs), i32(parents), block_v=16)
    assert torch.equal(s0_dev, before)  # the committed state is read only
    assert (out.cpu() - ref).abs().max().item() <= TOL
    pads = [j for j, p in enumerate(parents) if p == PAD]
    assert not out[pads].any()  # padding rows write nothing but their zero output
    if pads:  # and change nothing: the same tree without them gives the same bits
        keep = [j for j, p in enumerate(parents) if p != PAD]
        renum = {j: i for i, j in enumerate(keep)}
        bare = [renum.get(parents[j], -1) for j in keep]
        alone = gdn_tree(s0_dev, *(t[keep] for t in dev(*inputs)), i32(bare), block_v=16)
        assert torch.equal(alone, out[keep])


def test_root_paths_are_the_rows_root_paths_root_first():
    parents = TREES["deep_branch"] + [PAD, 4]
    want = []
    for j, p in enumerate(parents):
        path, a = [], (j if p != PAD else -1)
        while a >= 0:
            path.append(a)
            a = parents[a]
        want.append(path[::-1] + [-1] * (16 - len(path)))
    assert root_paths(i32(parents)).tolist() == want


def test_one_root_paths_table_serves_every_layer():
    gen = torch.Generator().manual_seed(3)
    parents = TREES["bushy"]
    paths = root_paths(i32(parents))
    for _ in range(2):  # two layers: their own state and inputs, the same paths
        s0 = torch.randn(H, DK, DV, generator=gen)
        inputs = step_inputs(gen, len(parents))
        out = gdn_tree(s0.to(DEV), *dev(*inputs), paths=paths, block_v=16)
        assert torch.equal(out, gdn_tree(s0.to(DEV), *dev(*inputs), i32(parents), block_v=16))
        assert (out.cpu() - gdn_tree_reference(s0, *inputs, parents)).abs().max().item() <= TOL


def test_path_kernel_random_trees_and_tiles():
    gen = torch.Generator().manual_seed(7)
    for trial in range(4):
        r = 1 + 3 * trial
        parents = [-1] + [int(torch.randint(-1, j, (1,), generator=gen)) for j in range(1, r)]
        s0 = torch.randn(H, DK, DV, generator=gen)
        inputs = step_inputs(gen, r)
        ref = gdn_tree_reference(s0, *inputs, parents)
        for block_v in (16, 32):
            out = gdn_tree(s0.to(DEV), *dev(*inputs), i32(parents), block_v=block_v, num_warps=2)
            assert (out.cpu() - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("layers", [None, 3])
def test_commit_kernel_matches_replay(layers):
    gen = torch.Generator().manual_seed(11)
    parents = TREES["deep_branch"]
    s0 = torch.randn(*(() if layers is None else (layers,)), H, DK, DV, generator=gen)
    _, k, v, g, beta = step_inputs(gen, len(parents), layers)
    for rows in ([0], [0, 1, 2, 7, 8], [0, 1, 2, 3, 11, -1, -1, -1], list(range(7))):
        want = gdn_commit_reference(s0, k, v, g, beta, rows)
        s = s0.to(DEV).clone()
        assert gdn_commit(s, *dev(k, v, g, beta), i32(rows), block_v=16) is s  # in place
        assert (s.cpu() - want).abs().max().item() <= TOL
    s = s0.to(DEV).clone()
    gdn_commit(s, *dev(k, v, g, beta), i32([-1, -1]), block_v=16)  # all padding: nothing accepted
    assert torch.equal(s.cpu(), s0)


@pytest.mark.parametrize("accepted", [[0], [0, 1, 2, 3], [0, 1, 2, 7, 8, 9]])
def test_commit_equals_the_path_kernels_own_state(accepted):
    """After committing an accepted path, the next pass's outputs equal the path kernel's outputs for the same rows
    hung below the accepted row in the old pass, bit for bit: the commit replays the path kernel's arithmetic."""
    gen = torch.Generator().manual_seed(len(accepted))
    parents = TREES["deep_branch"]
    last = accepted[-1]
    nxt = [-1, 0, 0, 1]  # the next pass's rows, over the new committed state
    both = parents + [last if p < 0 else len(parents) + p for p in nxt]  # the same rows below the accepted row
    s0 = torch.randn(H, DK, DV, generator=gen)
    inputs = dev(*step_inputs(gen, len(both)))
    long = gdn_tree(s0.to(DEV), *inputs, i32(both), block_v=16)
    s = s0.to(DEV).clone()
    gdn_commit(s, *inputs[1:], i32(accepted + [-1] * 3), block_v=16)
    again = gdn_tree(s, *(t[len(parents):] for t in inputs), i32(nxt), block_v=16)
    assert torch.equal(again, long[len(parents):])


def tiny_gdn(seed=0):
    args = ModelArgs(model_type="qwen3_5_text", vocab_size=32, hidden_size=48, intermediate_size=64, num_layers=1,
                     n_heads=2, n_kv_heads=1, head_dim=16, layer_types=["linear_attention"], linear_num_key_heads=2,
                     linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                     linear_conv_kernel_dim=4)
    torch.manual_seed(seed)
    layer = GatedDeltaNet(args).float()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return layer


@torch.no_grad()
def test_kernel_takes_what_the_model_feeds_its_steps():
    """The kernel on the step inputs a GDN layer records gives the layer's own output (after its norm, gate and
    out projection): the kernel's inputs are exactly the reference's."""
    layer = tiny_gdn()
    parents = [-1, 0, 1, 0, 3, 1, 5]
    x = torch.randn(len(parents), 48)
    state, window = torch.randn(4, 16, 16), torch.randn(3, layer.conv_dim)
    seen = {}
    want = layer(x, state, window, parents, lambda mixed, steps, states: seen.update(steps=steps))
    o = gdn_tree(state.to(DEV), *dev(*seen["steps"]), i32(parents), block_v=16).cpu()
    z = layer.in_proj_z(x).reshape(len(parents), 4, 16)
    got = layer.out_proj(layer.norm(o, z).reshape(len(parents), -1))
    assert (got - want).abs().max().item() <= 10 * TOL


def test_bad_inputs_are_clear_errors():
    gen = torch.Generator().manual_seed(0)
    s0 = torch.randn(H, DK, DV, generator=gen).to(DEV)
    q, k, v, g, beta = dev(*step_inputs(gen, 3))
    with pytest.raises(ValueError, match="float32"):
        gdn_tree(s0, q.double(), k, v, g, beta, i32([-1, 0, 1]))
    with pytest.raises(ValueError, match="parents int32"):
        gdn_tree(s0, q, k, v, g, beta, torch.tensor([-1, 0, 1], device=DEV))
    with pytest.raises(ValueError, match="one of the two"):
        gdn_tree(s0, q, k, v, g, beta)
    with pytest.raises(ValueError, match="powers of two"):
        gdn_tree(s0, q, k, v, g, beta, i32([-1, 0, 1]), block_v=24)
    with pytest.raises(ValueError, match="v must be"):
        gdn_commit(s0, k, v[:, :, :8], g, beta, i32([0]))
    with pytest.raises(ValueError, match="earlier real row"):
        gdn_tree_reference(s0.cpu(), *(t.cpu() for t in (q, k, v, g, beta)), [-1, 2, 0])
