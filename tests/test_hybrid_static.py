"""The hybrid target's static (row-bucket / CUDA-graph) exact pass and its commit (§4.2): equal to the eager pass
(logits within 1e-5) for a chain, a tree and a padded bucket, qwen3_5 and qwen3_next; the commit of a static pass
equals the eager commit; spec == AR through the Engine on the static path with the cache equal to a fresh prefill
after every step; the GDN path / commit kernels (Triton's interpreter on the CPU) equal the reference; on CUDA,
graphed == eager == AR."""

from __future__ import annotations

import dataclasses
import tempfile

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.engine.engine import Engine
from specpilot.errors import SpecPilotError
from specpilot.model.checkpoint import load_model
from specpilot.model.hybrid_static import conv_index_on_device, parents_on_device
from specpilot.model.gdn import conv_index, parents_from_mask
from specpilot.spec.draft_model import DraftModelDrafter
from specpilot.spec.lattice import TrieLattice

from .conftest import random_prompts
from .hybridutil import ar_tokens, state_matches_prefill, tiny_target, tree_config
from .test_engine import ScriptedDrafter

transformers = pytest.importorskip("transformers")
from .test_hybrid import tiny_hybrid  # noqa: E402
from .test_qwen3_next import tiny_next  # noqa: E402

#: a tree of 8 rows (row 0 the root; branches at rows 1 and 3) and a chain
TREE = [-1, 0, 1, 0, 3, 2, 5, 1]
CHAIN = list(range(-1, 7))
P = 20  # committed prompt tokens


def load(kind, **over):
    with tempfile.TemporaryDirectory() as d:
        (tiny_hybrid if kind == "qwen3_5" else tiny_next)(d, seed=4, **over)
        return load_model(d, dtype="float32").requires_grad_(False)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def model(request):
    return load(request.param)


def ancestors(parents, b):
    anc = torch.eye(b, dtype=torch.bool)
    for j, p in enumerate(parents):
        if p >= 0:
            anc[j] |= anc[p]
    return anc


def prefilled(model, prompt):
    c = model.new_cache(P + 64)
    model.forward(prompt, torch.arange(P), c, 0)
    c.commit(P)
    return c


def test_parents_and_conv_index_on_device_equal_the_host_forms():
    for parents in (TREE, CHAIN, [-1, -1, 1, 0, 3]):
        r = len(parents)
        anc = ancestors(parents, r)
        mask = torch.cat((torch.ones(r, 5, dtype=torch.bool), anc), 1)
        assert parents_on_device(anc).tolist() == parents_from_mask(mask, 5, r) == parents
        for k in (1, 2, 4):
            assert torch.equal(conv_index_on_device(torch.tensor(parents), k), conv_index(parents, k))


@torch.inference_mode()
@pytest.mark.parametrize("parents,bucket", [(CHAIN, 8), (TREE, 8), (TREE, 12)], ids=["chain", "tree", "padded"])
def test_static_pass_and_commit_equal_eager(model, parents, bucket):
    check_static(model, parents, bucket)


def check_static(model, parents, bucket, kernels=False):
    """Logits of the static pass (padded to ``bucket`` rows) equal the eager pass's within 1e-5; committing a
    branch (rows 0, 3, 4 of the tree; 0..3 of the chain) gives the eager commit's state, window and K/V."""
    r, v = len(parents), model.args.vocab_size
    g = torch.Generator().manual_seed(r + bucket)
    prompt, toks = torch.randint(0, v, (P,), generator=g), torch.randint(0, v, (r,), generator=g)
    anc = ancestors(parents, bucket)
    pos = P + anc[:r, :r].sum(1) - 1
    eager_c, static_c = prefilled(model, prompt), prefilled(model, prompt)
    mask = torch.cat((torch.ones(r, P, dtype=torch.bool), anc[:r, :r]), 1)
    eager = model.logits(model.forward(toks, pos, eager_c, P, mask))
    tk, ps = torch.zeros(bucket, dtype=torch.long), torch.full((bucket,), P)
    tk[:r], ps[:r] = toks, pos
    static_c.gdn_kernels = kernels
    static_c.begin_pass(P, r, bucket)
    static = model.logits(model.forward_static(tk, ps, static_c, torch.tensor(P), anc))
    torch.testing.assert_close(static[:r], eager, atol=1e-5, rtol=0)
    rows = torch.tensor([0, 3, 4] if parents == TREE else [0, 1, 2, 3])
    for c in (eager_c, static_c):
        if rows[-1] != len(rows) - 1:
            c.compact(P, rows)
        c.commit(P + len(rows))
    torch.testing.assert_close(static_c.state, eager_c.state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(static_c.window, eager_c.window, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(static_c.k[:, : P + len(rows)], eager_c.k[:, : P + len(rows)], atol=1e-5, rtol=1e-5)


class PartialDrafter(ScriptedDrafter):
    """``half``: the first branch right for half its positions, then wrong (a chain accepts part of it), the fully
    right branch second (a tree accepts that one: never the first branch)."""

    def draft(self, committed, depth):
        lat = super().draft(committed, depth)
        if lat is None or self.mode != "half":
            return lat
        done = len(committed) - self.p
        right = self.ar[done : done + depth]
        h = (len(right) + 1) // 2
        return TrieLattice([right[:h] + [(t + 1) % 64 for t in right[h:]], right], depth)


def run_static(target, tree, script, every, n=24, kernels=False):
    """spec == AR through the Engine on the static path (row buckets; no graphs on the CPU), the cache checked
    against a fresh prefill after every step; returns the per-step accepted counts."""
    prompt = random_prompts(1, target.args.vocab_size, seed=7)[0]
    ar = ar_tokens(target, prompt, n)
    eng = Engine(target, tree_config(tree, 5), PartialDrafter(len(prompt), ar, script, every=every), eos_ids=[],
                 buckets=True, max_len=128)
    eng.cache.gdn_kernels = kernels
    calls = []
    real = eng.runner.run

    def counted(*a, **kw):
        out = real(*a, **kw)
        calls.append(out is not None)
        return out

    eng.runner.run = counted
    eng.step_hook = state_matches_prefill
    gen = eng.generate(prompt, n)
    assert gen.tokens == ar
    assert calls and all(calls)  # every verify pass went through the static path
    return gen.accepted


@pytest.mark.parametrize("tree", ["chain", "best_first"])
@pytest.mark.parametrize("script,every", [("right", 2), ("wrong", 1), ("half", 3)],
                         ids=["full_and_zero_drafts", "zero", "partial"])
def test_spec_equals_ar_on_the_static_path(tree, script, every):
    target = tiny_target()
    target.verify = "replay"
    try:
        accepted = run_static(target, tree, script, every)
    finally:
        target.verify = "snapshot"
    assert set(accepted) == {1} if script == "wrong" else max(accepted) > 1
    if every > 1:
        assert 1 in accepted


def test_qwen3_next_spec_equals_ar_on_the_static_path(model):
    if model.args.num_experts == 0:
        pytest.skip("qwen3_next only")
    assert max(run_static(model, "best_first", "half", 2, n=16)) > 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is the CPU's check of the kernel path")
@pytest.mark.parametrize("wy", [False, True], ids=["path_kernel", "wy_kernel"])
def test_kernel_path_in_the_interpreter_equals_the_reference(wy):
    """The GDN path (or WY) and commit kernels (Triton's interpreter, d_k = d_v = 16) inside the static pass: logits
    and commit equal the eager pass's (chain, tree, padded), spec == AR with the cache equal to a fresh prefill
    after every step (tree, partial acceptance)."""
    pytest.importorskip("triton")
    from . import tritonutil  # noqa: F401  (the interpreter's numpy fix)

    target = load("qwen3_5", linear_key_head_dim=16, linear_value_head_dim=16)
    target.kernels = dataclasses.replace(target.kernels, gdn_wy=wy)
    with torch.inference_mode():
        for parents, bucket in ((CHAIN, 8), (TREE, 8), (TREE, 12)):
            check_static(target, parents, bucket, kernels=True)
    assert max(run_static(target, "best_first", "half", 2, n=10, kernels=True)) > 1


def test_hybrid_draft_model_refuses_the_static_loop():
    with pytest.raises(SpecPilotError, match="static"):
        DraftModelDrafter(tiny_target(), static=True)


def cuda_state_matches_prefill(engine, committed):
    """:func:`state_matches_prefill` for a target on CUDA."""
    n, c, m = len(committed) - 1, engine.cache, engine.target
    fresh = m.new_cache(n + 1)
    m.forward(torch.tensor(committed[:-1], device="cuda"), torch.arange(n, device="cuda"), fresh, 0)
    fresh.commit(n)
    assert c.length == n
    for a, b in ((c.state, fresh.state), (c.window, fresh.window), (c.k[:, :n], fresh.k[:, :n])):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def graphed_vs_eager(target, device: str) -> None:
    """The engine with row buckets (graphed on CUDA: path / commit kernels, tree attention) == the eager engine == AR,
    the cache checked after every step, and drafted tokens accepted: a chain gets a branch right for half its
    positions (it follows the first branch), a tree a wrong branch first and the right one second."""
    prompt = random_prompts(1, target.args.vocab_size, seed=7)[0]
    ar = Engine(target, SystemConfig.ar(), None, eos_ids=[]).generate(prompt, 24).tokens
    hook = cuda_state_matches_prefill if device == "cuda" else state_matches_prefill
    for tree, mode in (("chain", "half"), ("best_first", "both")):
        target.verify = "replay"
        try:
            eager = Engine(target, tree_config(tree, 5), PartialDrafter(len(prompt), ar, mode, every=3),
                           eos_ids=[]).generate(prompt, 24)
            eng = Engine(target, tree_config(tree, 5), PartialDrafter(len(prompt), ar, mode, every=3),
                         eos_ids=[], buckets=True, max_len=128)
            if device == "cuda":
                assert eng.cache.gdn_kernels and eng.runner.graphs
            eng.step_hook = hook
            graphed = eng.generate(prompt, 24)
        finally:
            target.verify = "snapshot"
        assert graphed.tokens == eager.tokens == ar
        assert graphed.accepted == eager.accepted and max(graphed.accepted) > 1, (tree, graphed.accepted)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_equals_eager_equals_ar_on_cuda():
    """On CUDA in float32: the graphed engine == the eager engine == AR, drafted tokens accepted."""
    graphed_vs_eager(load("qwen3_5", linear_key_head_dim=16, linear_value_head_dim=16).cuda(), "cuda")


@pytest.mark.parametrize("tree", ["chain", "best_first"])
@pytest.mark.parametrize("kind", ["ngram", "draft_dense", "draft_hybrid", "block", "block_markov", "eagle3"])
def test_every_drafter_on_the_static_path(kind, tree):
    """Every drafter kind (the feature-reading ones get the static pass's features: prompt from the eager prefill,
    then the runner's buffer) on the static path: spec == AR; the first request drafts nothing every third step and
    checks the cache after every step."""
    from .hybridutil import Skipping, drafter_nets, make_drafter, requests

    target, nets = tiny_target(), drafter_nets()
    name, drafter = make_drafter(kind, target, nets)
    cfg = SystemConfig(drafter=name, tree=tree, nodes=12, depth=5, top_k=4)
    accepted = []
    target.verify = "replay"
    try:
        for i, (p, n) in enumerate(requests(target.args.vocab_size)):
            eng = Engine(target, cfg, Skipping(drafter, 3) if i == 0 else drafter, eos_ids=[], buckets=True,
                         max_len=128)
            if i == 0:
                eng.step_hook = state_matches_prefill
            gen = eng.generate(p, n)
            assert gen.tokens == ar_tokens(target, p, n), (kind, tree, i)
            accepted += gen.accepted
    finally:
        target.verify = "snapshot"
    assert 1 in accepted and max(accepted) > 1
