"""TLV (§4.3): spec == AR with two-level verification for every drafter and tree builder (float32 CPU, AR is the
oracle), including Q passes whose chains the exact pass rejects at every position; the cache equals a fresh prefill
after every cycle; the Q pass leaves the committed state bit for bit as it was; the Q view's weights."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F

from specpilot.config import SystemConfig
from specpilot.engine.engine import Engine
from specpilot.engine.tlv import QPass, graft, two_level_tree
from specpilot.errors import SpecPilotError
from specpilot.model.qview import QLinear, pack_int6, q_extra_bytes, q_view, quantize_rows, unpack_int6
from specpilot.spec.block import BlockDrafter
from specpilot.spec.draft_model import DraftModelDrafter
from specpilot.spec.eagle3 import Eagle3Drafter
from specpilot.spec.ngram import NgramDrafter
from specpilot.spec.trees import Tree
from specpilot.w12.convert import to_w12
from specpilot.w12.format import approx_view, encode

from .blockutil import trained_pair
from .conftest import random_prompts
from .test_eagle3 import _trained as eagle3_trained
from .test_engine import ar_tokens, cache_matches_prefill

pytestmark = pytest.mark.usefixtures("one_thread")
V = 64
BUILDERS = ["chain", "best_first", "ddtree_marginal", "eagle2_topk", "sequoia"]


def drafter_of(kind, target, small, top_k):
    if kind == "ngram":
        return NgramDrafter(3, 1, max_matches=top_k)
    if kind == "draft_model":
        return DraftModelDrafter(small, top_k=top_k)
    if kind == "eagle3":
        return Eagle3Drafter(eagle3_trained(target)[0], target, top_k=top_k)
    return BlockDrafter(trained_pair(target)[kind][0], target, top_k=top_k)


def cfg_of(tree, weights="view8", nodes=10):
    chain = tree == "chain"
    return SystemConfig(drafter="ngram", tree=tree, nodes=5 if chain else nodes, depth=5, top_k=1 if chain else 3,
                        tlv=True, q_weights=weights)


@pytest.mark.parametrize("kind", ["ngram", "draft_model", "block", "block_markov", "eagle3"])
@pytest.mark.parametrize("tree", BUILDERS)
def test_spec_equals_ar_every_drafter_and_builder(tiny_models, kind, tree):
    target, small = tiny_models
    cfg = cfg_of(tree)
    eng = Engine(target, cfg, drafter_of(kind, target, small, cfg.top_k), eos_ids=[])
    eng.step_hook = cache_matches_prefill
    gens = [eng.generate(p, 30) for p in random_prompts(3, V, length=10, seed=3)]
    for p, g in zip(random_prompts(3, V, length=10, seed=3), gens):
        assert g.tokens == ar_tokens(target, p, 30)
        assert len(g.chains) == g.steps and all(0 <= c <= r - 1 for c, r in zip(g.chains, g.rows))
    assert sum(sum(g.chains) for g in gens) > 0  # the Q pass committed chains that the exact pass verified


@pytest.mark.parametrize("weights", ["view8", "int8", "int6"])
def test_q_weights_variants_lossless_and_chains_mostly_hold(tiny_models, weights):
    target, small = tiny_models
    cfg = cfg_of("best_first", weights, nodes=12)
    eng = Engine(target, cfg, DraftModelDrafter(small, top_k=3), eos_ids=[])
    eng.step_hook = cache_matches_prefill
    single = Engine(target, cfg.model_copy(update={"tlv": False, "q_weights": "view8"}),
                    DraftModelDrafter(small, top_k=3), eos_ids=[])
    taus = []
    for p in random_prompts(3, V, length=10, seed=4):
        g = eng.generate(p, 40)
        assert g.tokens == ar_tokens(target, p, 40)
        taus.append((g.tau, single.generate(p, 40).tau))
    # a Q pass that mostly agrees with the exact pass gives more tokens per exact pass than one pass alone
    assert sum(t for t, _ in taus) > sum(s for _, s in taus)


class LyingQ:
    """A Q pass whose argmax is the exact one shifted by one token at every row: every chain it commits is wrong at
    its first token (``mode="first"``), or right for ``k`` tokens then wrong (``mode="late"``)."""

    def __init__(self, real: QPass, mode: str, k: int = 2):
        self.real, self.mode, self.k, self.features = real, mode, k, None

    def run(self, tok_list, pos_list, start, tree, prof=None, committed=None):
        out = self.real.run(tok_list, pos_list, start, tree, prof, committed)
        self.features = self.real.features
        depth = [0] + list(tree.depths)
        return [(t + 1) % V if self.mode == "first" or depth[r] >= self.k else t for r, t in enumerate(out)]


@pytest.mark.parametrize("mode", ["first", "late"])
@pytest.mark.parametrize("kind", ["draft_model", "block"])
def test_chains_the_exact_pass_rejects_stay_lossless(tiny_models, mode, kind):
    target, small = tiny_models
    cfg = cfg_of("best_first", nodes=12)
    eng = Engine(target, cfg, drafter_of(kind, target, small, cfg.top_k), eos_ids=[])
    eng.tlv = LyingQ(eng.tlv, mode)
    eng.step_hook = cache_matches_prefill
    for p in random_prompts(3, V, length=10, seed=6):
        g = eng.generate(p, 30)
        assert g.tokens == ar_tokens(target, p, 30)
        if mode == "first":  # a chain wrong at its first token: the exact pass keeps only its own bonus
            assert all(a == 1 for a, c in zip(g.accepted, g.chains) if c > 0)


def test_q_pass_changes_no_engine_state(tiny_models):
    target, small = tiny_models
    for buckets in (False, True):
        eng = Engine(target, cfg_of("best_first"), DraftModelDrafter(small, top_k=3), eos_ids=[], buckets=buckets)
        prompt = random_prompts(1, V, length=14, seed=8)[0]
        committed = prompt + eng.generate(prompt, 12).tokens
        eng.cache.commit(0)
        target.forward(torch.tensor(committed[:-1]), torch.arange(len(committed) - 1), eng.cache, 0)
        eng.cache.commit(len(committed) - 1)
        start = len(committed) - 1
        k, v, length = eng.cache.k.clone(), eng.cache.v.clone(), eng.cache.length
        tree = Tree()
        a = tree.add(5, -1, 0.0)
        tree.add(7, a, 0.0)
        tree.add(9, -1, 0.0)
        argmax = eng.tlv.run([committed[-1]] + tree.tokens, [start] + [start + d for d in tree.depths], start, tree)
        assert len(argmax) == 4 and eng.cache.length == length
        assert torch.equal(eng.cache.k[:, :start], k[:, :start]) and torch.equal(eng.cache.v[:, :start], v[:, :start])
        if not buckets:  # the eager Q pass (INSPECT) writes nothing at all, scratch slots included
            assert torch.equal(eng.cache.k, k) and torch.equal(eng.cache.v, v)


def test_static_q_pass_equals_eager_and_stays_lossless(tiny_models):
    """Row buckets (the padded static path, graphs on CUDA) for both passes give AR's tokens and the eager cycle's."""
    target, small = tiny_models
    cfg = cfg_of("best_first")
    eager = Engine(target, cfg, DraftModelDrafter(small, top_k=3), eos_ids=[])
    static = Engine(target, cfg, DraftModelDrafter(small, top_k=3), eos_ids=[], buckets=True)
    for p in random_prompts(2, V, length=10, seed=9):
        a, b = eager.generate(p, 30), static.generate(p, 30)
        assert b.tokens == a.tokens == ar_tokens(target, p, 30)
        assert b.chains == a.chains and b.accepted == a.accepted


def test_two_level_tree_shape_and_budget():
    chain_tree = Tree()
    x = chain_tree.add(11, -1, -0.1)
    chain_tree.add(12, x, -0.2)
    chain_tree.add(13, -1, -0.5)
    calls = []

    def draft(ctx, remaining, nodes):
        calls.append((list(ctx), remaining, nodes))
        if len(calls) == 1:
            return chain_tree
        sub = Tree()
        r = sub.add(21, -1, -0.1)
        sub.add(22, r, -0.2)
        sub.add(23, -1, -0.3)
        return sub.truncate(nodes)

    seen = []
    tree, c = two_level_tree([1, 2, 3], 20, 6, draft, lambda t: [11, 12, 14, 0], seen.append)
    # the Q pass accepts 11, 12 and adds its bonus 14: C = [11, 12, 14]; draft ② after C with 6 - 3 nodes
    assert c == 3 and seen == [[0, 1, 2]] and calls[1] == ([1, 2, 3, 11, 12, 14], 17, 3)
    assert tree.tokens == [11, 12, 14, 21, 22, 23] and tree.parents == [-1, 0, 1, 2, 3, 2]
    assert tree.depths == [1, 2, 3, 4, 5, 4]
    # the request's end caps C and leaves no room for draft ②
    tree, c = two_level_tree([1, 2, 3], 3, 6, lambda *a: chain_tree, lambda t: [11, 12, 14, 0])
    assert c == 2 and tree.tokens == [11, 12]
    # nothing drafted: no Q pass, an empty tree
    assert two_level_tree([1], 9, 6, lambda *a: Tree(), lambda t: pytest.fail("no Q pass"), None) == (Tree(), 0)
    g = graft([], chain_tree)
    assert g.tokens == chain_tree.tokens and g.parents == chain_tree.parents


def test_q_view_weights_and_memory(tiny_models):
    target = tiny_models[0]
    w = target.model.layers[0].mlp.down_proj.weight
    view = QLinear(target.model.layers[0].mlp.down_proj, "view8")
    assert torch.equal(view.approx_weight(), approx_view(encode(w.to(torch.bfloat16))).float())
    for weights, levels in (("int8", 127), ("int6", 31)):
        q = QLinear(target.model.layers[0].mlp.down_proj, weights)
        err = (q.approx_weight() - w).abs().amax(dim=1)
        assert torch.all(err <= w.abs().amax(dim=1) / levels / 2 * (1 + 1e-5))
    codes, _ = quantize_rows(torch.randn(5, 37), 31)
    assert torch.equal(unpack_int6(pack_int6(codes), 37), codes) and pack_int6(codes).shape == (5, 30)
    x = torch.randn(3, w.shape[1])
    torch.testing.assert_close(view(x), x @ view.approx_weight().T)
    q = q_view(target, "int6")
    assert q.model.embed_tokens is target.model.embed_tokens and q.model.norm is target.model.norm
    assert q_extra_bytes(q) > 0 and all(isinstance(m, QLinear) for m in q.model.layers[0].mlp.children())
    assert all(not isinstance(m, QLinear) for m in target.modules())  # the target keeps its own layers


@pytest.mark.parametrize("weights", ["view8", "int8", "int6"])
def test_cpu_q_projection_multiplies_as_the_plain_layer_does(weights):
    """On the CPU in float32 a Q-view projection large enough that the plain layer is prepacked runs the prepacked
    GEMM over its approximate weight too (``F.linear``'s MKL path repacks each call: twice the pass at 3-7 rows), bit
    for bit as that PackedLinear, within float32 rounding of ``F.linear``; the pack is no submodule (state_dict
    unchanged) and its bytes count as the Q view's."""
    from torch import nn

    from specpilot.kernels.cpu_linear import MIN_PACK_WEIGHTS, PackedLinear, packing_available

    if not packing_available():
        pytest.skip("this PyTorch build cannot prepack weights")
    g = torch.Generator().manual_seed(5)
    lin = nn.Linear(256, MIN_PACK_WEIGHTS // 256 * 2, bias=True)  # twice the smallest packed layer
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=g).to(torch.bfloat16).float() / 16)
    q = QLinear(lin, weights)
    keys = set(q.state_dict())
    a = q.approx_weight()
    for rows in (1, 3, 7):
        x = torch.randn(rows, 256, generator=g)
        got = q(x)
        assert torch.equal(got, PackedLinear.of(a, lin.bias.detach().float())(x)), rows
        torch.testing.assert_close(got, F.linear(x, a, lin.bias.detach()), atol=1e-4, rtol=1e-5)
    assert set(q.state_dict()) == keys
    if weights != "view8":  # the decoded copy and its packed twin
        assert q.extra_bytes() == q.codes.numel() + q.scale.numel() * 4 + 2 * a.numel() * 4


def test_view8_of_a_w12_target_shares_its_records(tiny_models):
    from specpilot.w12.linear import W12Linear

    target = tiny_models[0]
    bf = copy.deepcopy(target)
    for prm in bf.parameters():
        prm.data = prm.data.to(torch.bfloat16).float()  # bf16 values, as W12 needs
    w12 = to_w12(bf)
    q = q_view(w12, "view8")
    layer = q.model.layers[0].self_attn
    projs = [m for m in layer.children() if isinstance(m, QLinear)]
    assert projs and all(m.shared and isinstance(m.w12, W12Linear) for m in projs)
    assert q_extra_bytes(q) == 0


def test_config_rules():
    with pytest.raises(ValueError, match="tlv needs a drafter"):
        SystemConfig(drafter="none", tlv=True)
    with pytest.raises(ValueError, match="tlv is off"):
        SystemConfig(q_weights="int8")
    base = SystemConfig(drafter="ngram", tree="best_first", nodes=8, depth=4, top_k=2)
    assert base.apply({"tlv": True}).label().endswith("+tlv")
    assert base.apply({"tlv": True, "q_weights": "int6"}).label().endswith("+tlv:int6")
    assert base.seal() == SystemConfig(**{k: v for k, v in base.model_dump().items()
                                          if k not in ("tlv", "q_weights")}).seal()
    assert base.apply({"tlv": True}).seal() != base.seal()


def test_ngram_index_rolls_back_to_the_shared_prefix():
    """TLV drafts after a chain the exact pass may reject: the index cut back equals the plain definition."""
    from specpilot.spec.ngram import ngram_continuations_reference

    rng = random.Random(0)
    d = NgramDrafter(3, 1, max_matches=4)
    seq = [rng.randrange(6) for _ in range(20)]
    for _ in range(200):
        ctx = seq + [rng.randrange(6) for _ in range(rng.randrange(0, 6))]
        assert d.continuations(ctx, 4) == ngram_continuations_reference(ctx, 4, 3, 1, 4)
        if rng.random() < 0.5:
            seq = seq + [rng.randrange(6) for _ in range(rng.randrange(1, 3))]


def test_batched_engine_refuses_tlv(tiny_models):
    from specpilot.engine.batch import BatchEngine

    with pytest.raises(SpecPilotError, match="single requests only"):
        BatchEngine(tiny_models[0], cfg_of("chain"), NgramDrafter(3, 1, max_matches=1), max_num_seqs=2)
    with pytest.raises(SpecPilotError, match="needs a drafter"):
        Engine(tiny_models[0], SystemConfig.ar().model_copy(update={"tlv": True}), None)


def test_generate_cli_runs_tlv_and_refuses_bad_options(monkeypatch, capsys):
    import json

    from .conftest import run_cli

    args = ["generate", "--prompt", "def add(a, b):", "--drafter", "draft_model", "--tree", "best_first", "--nodes",
            "12", "--max-new-tokens", "24", "--json"]
    code, out, _ = run_cli(monkeypatch, capsys, *args)
    plain = json.loads(out)
    code2, out2, _ = run_cli(monkeypatch, capsys, *args, "--tlv", "--q-weights", "int8")
    tlv = json.loads(out2)
    assert code == code2 == 0 and tlv["output_ids"] == plain["output_ids"] and tlv["system"]["tlv"] is True
    assert tlv["steps"] < plain["steps"]  # the bundled pair's Q chains hold: fewer exact passes for the same output
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--prompt", "x", "--q-weights", "int8")
    assert code == 2 and err.strip() == ("error: invalid option: q_weights int8 is set but tlv is off (the Q pass's "
                                         "weights apply with tlv)")
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--prompt", "x", "--drafter", "none", "--tlv")
    assert code == 2 and "tlv needs a drafter" in err and len(err.strip().splitlines()) == 1


def test_tlv_engines_of_a_deployment_share_one_q_view(tiny_dirs):
    """Every TLV engine a deployment builds runs its Q pass over the deployment's one Q view per weight set (a view8
    copy of an 8B bf16 target is about 12 GB; a pilot that built one per system ran out of an 80 GB GPU), and
    still equals AR."""
    from specpilot.engine.deployment import Deployment

    from .test_engine import ar_tokens

    dep = Deployment(tiny_dirs[0], tiny_dirs[1])
    a = dep.system(SystemConfig(drafter="draft_model", tree="best_first", nodes=6, depth=3, top_k=2, tlv=True),
                   eos_ids=[])
    b = dep.system(SystemConfig(drafter="ngram", tree="chain", nodes=4, depth=4, tlv=True), eos_ids=[])
    c = dep.system(SystemConfig(drafter="ngram", tree="chain", nodes=4, depth=4, tlv=True, q_weights="int8"), eos_ids=[])
    assert a.tlv.q is b.tlv.q is dep.q_target(dep.target, "view8")
    assert c.tlv.q is not a.tlv.q
    p = [3, 9, 4, 3, 9, 4, 3, 9, 1, 2]
    assert a.generate(p, 16).tokens == b.generate(p, 16).tokens == ar_tokens(dep.target, p, 16)
