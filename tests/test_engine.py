"""Engine correctness: logit parity with transformers, spec == AR, and the fault kinds of RELIABILITY.md.

AR greedy decoding is the oracle; everything runs in float32 on the CPU, where speculative output must
equal it token for token.
"""

from __future__ import annotations

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.spec.draft_model import DraftModelDrafter
from specpilot.spec.lattice import PositionalLattice, TrieLattice
from specpilot.spec.ngram import NgramDrafter
from specpilot.model.checkpoint import load_model
from specpilot.engine.engine import Engine
from specpilot.errors import PromptError, SpecPilotError
from specpilot.spec.drafter import OneSlotDrafter, propose_one

from .conftest import random_prompts, save_tiny

V = 64


def ar_tokens(target, prompt, n, stops=None):
    return Engine(target, SystemConfig.ar(), None, eos_ids=[]).generate(prompt, n, stop_ids=stops).tokens


class ScriptedDrafter(OneSlotDrafter):
    """Proposes from a known AR continuation: ``right`` (greedy), ``wrong`` (greedy+1), or ``both`` (wrong
    branch first, right second: the accepted path is never the first branch)."""

    def __init__(self, prompt_len, ar, mode, every=1):
        self.p, self.ar, self.mode, self.every, self.calls = prompt_len, ar, mode, every, 0

    def clear(self):
        self.calls = 0

    def draft(self, committed, depth):
        self.calls += 1
        if self.calls % self.every:
            return None  # R10: sometimes the drafter proposes nothing
        done = len(committed) - self.p
        right = self.ar[done : done + depth]
        if not right:
            return None
        wrong = [(t + 1) % V for t in right]
        if self.mode == "right":
            return TrieLattice([right], depth)
        if self.mode == "wrong":
            return TrieLattice([wrong], depth)
        return TrieLattice([wrong, right], depth)


def cache_matches_prefill(engine, committed):
    """The cache equals a fresh prefill of every committed token but the last (R8, R2)."""
    L = len(committed) - 1
    assert engine.cache.length == L
    m = engine.target
    fresh = m.new_cache(L + 1)
    m.forward(torch.tensor(committed[:-1]), torch.arange(L), fresh, 0)
    torch.testing.assert_close(engine.cache.k[:, :L], fresh.k[:, :L], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(engine.cache.v[:, :L], fresh.v[:, :L], atol=1e-5, rtol=1e-5)


# -- parity ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type,extra", [
    ("qwen3", {}),
    ("qwen2", {"tie_word_embeddings": True}),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
])
def test_logit_parity_with_transformers(tmp_path, model_type, extra):
    from transformers import AutoModelForCausalLM

    d = save_tiny(tmp_path / model_type, model_type=model_type, vocab=97, seed=3, **extra)
    ref_model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ours = load_model(d)
    ids = torch.randint(0, 97, (50,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = ref_model(ids[None]).logits[0]
        got = ours.logits(ours(ids, torch.arange(50), ours.new_cache(64), 0))
    assert (ref - got).abs().max().item() < 1e-4
    # tree rows: a random ancestor mask with explicit positions must match per-path causal runs
    cache = ours.new_cache(80)
    with torch.no_grad():
        ours(ids[:30], torch.arange(30), cache, 0)
        tree_tok = torch.tensor([ids[30], 5, 6, 7])  # root, child a, child b (sibling), grandchild of a
        pos = torch.tensor([30, 31, 31, 32])
        mask = torch.ones(4, 34, dtype=torch.bool)
        mask[:, 30:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        tree_logits = ours.logits(ours(tree_tok, pos, cache, 30, mask))
        path = torch.cat([ids[:31], torch.tensor([5, 7])])
        ref_path = ref_model(path[None]).logits[0]
        path_b = torch.cat([ids[:31], torch.tensor([6])])
        ref_b = ref_model(path_b[None]).logits[0]
    assert (tree_logits[3] - ref_path[-1]).abs().max() < 1e-4
    assert (tree_logits[1] - ref_path[-2]).abs().max() < 1e-4
    assert (tree_logits[2] - ref_b[-1]).abs().max() < 1e-4


# -- spec == AR ------------------------------------------------------------------------------------
SYSTEMS = [
    SystemConfig.stock("ngram"),
    SystemConfig(drafter="ngram", tree="best_first", nodes=12, depth=6, top_k=4),
    SystemConfig.stock("draft_model"),
    SystemConfig(drafter="draft_model", tree="best_first", nodes=16, depth=5, top_k=4),
]


def make_drafter(cfg, drafter_model):
    if cfg.drafter == "ngram":
        return NgramDrafter(cfg.ngram_max, cfg.ngram_min, max_matches=cfg.top_k)
    return DraftModelDrafter(drafter_model, top_k=cfg.top_k)


@pytest.mark.parametrize("cfg", SYSTEMS, ids=lambda c: c.label())
def test_spec_equals_ar_random_prompts(tiny_models, cfg):
    target, drafter_model = tiny_models
    eng = Engine(target, cfg, make_drafter(cfg, drafter_model), eos_ids=[])
    eng.step_hook = cache_matches_prefill
    for prompt in random_prompts(4, V, length=10, seed=7):
        assert eng.generate(prompt, 40).tokens == ar_tokens(target, prompt, 40)


# -- RELIABILITY.md kinds ----------------------------------------------------------------------------
def test_r1_r2_stop_in_middle_of_block(tiny_models):
    target, _ = tiny_models
    prompt = random_prompts(1, V, seed=11)[0]
    ar = ar_tokens(target, prompt, 40)
    stop = ar[5]  # a token accepted in the middle of a drafted block
    want = ar_tokens(target, prompt, 40, stops=[stop])
    assert want[-1] == stop and len(want) <= 6
    eng = Engine(target, SystemConfig.stock("ngram", depth=8), ScriptedDrafter(len(prompt), ar, "right"), eos_ids=[])
    gen = eng.generate(prompt, 40, stop_ids=[stop])
    assert gen.tokens == want and gen.stop_reason == "stop"
    assert gen.cache_length == len(prompt) + len(want) - 1  # R2: cache counts only kept tokens
    assert sum(gen.accepted) == len(want) - 1  # statistics count only kept tokens (prefill token excluded)
    # R2: a follow-up request on the same engine equals one on a fresh engine
    other = random_prompts(1, V, seed=12)[0]
    eng.drafter = NgramDrafter()
    fresh = Engine(target, SystemConfig.stock("ngram", depth=8), NgramDrafter(), eos_ids=[])
    assert eng.generate(other, 30).tokens == fresh.generate(other, 30).tokens


def test_eos_from_config_ends_output(tiny_models):
    target, _ = tiny_models
    prompt = random_prompts(1, V, seed=13)[0]
    ar = ar_tokens(target, prompt, 30)
    eng = Engine(target, SystemConfig.stock("ngram"), ScriptedDrafter(len(prompt), ar, "right"), eos_ids=[ar[3]])
    gen = eng.generate(prompt, 30)
    assert gen.tokens == ar[: ar.index(ar[3]) + 1] and gen.stop_reason == "eos"


@pytest.mark.parametrize("limit", [1, 2, 3, 7])
@pytest.mark.parametrize("depth", [1, 2, 3, 6])
def test_r3_r4_max_new_tokens_never_exceeded(tiny_models, limit, depth):
    target, _ = tiny_models
    prompt = random_prompts(1, V, seed=21)[0]
    ar = ar_tokens(target, prompt, limit)
    eng = Engine(target, SystemConfig.stock("ngram", depth=depth), ScriptedDrafter(len(prompt), ar_tokens(target, prompt, 20), "right"), eos_ids=[])
    gen = eng.generate(prompt, limit)
    assert gen.tokens == ar and len(gen.tokens) == limit


def test_r5_always_wrong_drafter(tiny_models):
    target, _ = tiny_models
    for depth in (1, 4):
        prompt = random_prompts(1, V, seed=31 + depth)[0]
        ar = ar_tokens(target, prompt, 25)
        eng = Engine(target, SystemConfig.stock("ngram", depth=depth), ScriptedDrafter(len(prompt), ar, "wrong"), eos_ids=[])
        gen = eng.generate(prompt, 25)
        assert gen.tokens == ar
        assert all(a == 1 for a in gen.accepted)  # zero drafted tokens accepted


def test_r6_identical_drafter_accepts_everything(tiny_dirs):
    target = load_model(tiny_dirs[0])
    same = load_model(tiny_dirs[0])
    prompt = random_prompts(1, V, seed=41)[0]
    eng = Engine(target, SystemConfig.stock("draft_model", depth=5), DraftModelDrafter(same, top_k=1), eos_ids=[])
    gen = eng.generate(prompt, 31)
    assert gen.tokens == ar_tokens(target, prompt, 31)
    assert gen.accepted == [6] * 5  # 30 tokens after the prefill's one, 5 drafted + bonus each


def test_r7_tree_positions_and_siblings_equal_chain(tiny_models):
    target, drafter_model = tiny_models
    prompt = random_prompts(1, V, seed=51)[0]
    chain = Engine(target, SystemConfig.stock("draft_model", depth=4), DraftModelDrafter(drafter_model, 1), eos_ids=[])
    tree = Engine(target, SystemConfig(drafter="draft_model", tree="best_first", nodes=20, depth=4, top_k=5),
                  DraftModelDrafter(drafter_model, 5), eos_ids=[])
    assert chain.generate(prompt, 30).tokens == tree.generate(prompt, 30).tokens


def test_r8_accepted_branch_not_first(tiny_models):
    target, _ = tiny_models
    prompt = random_prompts(1, V, seed=61)[0]
    ar = ar_tokens(target, prompt, 30)
    cfg = SystemConfig(drafter="ngram", tree="best_first", nodes=12, depth=5, top_k=2)
    eng = Engine(target, cfg, ScriptedDrafter(len(prompt), ar, "both"), eos_ids=[])
    eng.step_hook = cache_matches_prefill
    gen = eng.generate(prompt, 30)
    assert gen.tokens == ar
    assert max(gen.accepted) == 6  # the second branch was accepted whole


def test_r10_drafter_sometimes_proposes_nothing(tiny_models):
    target, _ = tiny_models
    prompt = random_prompts(1, V, seed=71)[0]
    ar = ar_tokens(target, prompt, 30)
    eng = Engine(target, SystemConfig.stock("ngram"), ScriptedDrafter(len(prompt), ar, "right", every=2), eos_ids=[])
    eng.step_hook = cache_matches_prefill
    gen = eng.generate(prompt, 30)
    assert gen.tokens == ar
    assert 1 in gen.accepted and max(gen.accepted) > 1  # plain decode steps and speculative steps mixed


def test_r11_drafter_context_tracks_committed(tiny_models):
    target, drafter_model = tiny_models
    prompt = random_prompts(1, V, seed=81)[0]
    drafter = DraftModelDrafter(drafter_model, top_k=2)
    eng = Engine(target, SystemConfig(drafter="draft_model", tree="best_first", nodes=24, depth=16, top_k=2),
                 drafter, eos_ids=[])

    def check(engine, committed):
        d = engine.drafter
        assert d.n_seen <= len(committed)
        n = d.cache.length
        fresh = d.model.new_cache(n + 1)
        d.model.forward(torch.tensor(committed[:n]), torch.arange(n), fresh, 0)
        torch.testing.assert_close(d.cache.k[:, :n], fresh.k[:, :n], atol=1e-5, rtol=1e-5)
        cache_matches_prefill(engine, committed)

    eng.step_hook = check
    assert eng.generate(prompt, 60).tokens == ar_tokens(target, prompt, 60)


def test_r14_memory_returns_to_start(tiny_models):
    target, drafter_model = tiny_models
    eng = Engine(target, SystemConfig(drafter="draft_model", tree="best_first", nodes=8, depth=4, top_k=3),
                 DraftModelDrafter(drafter_model, 3), eos_ids=[])
    ptrs = (eng.cache.k.data_ptr(), eng.cache.k.shape, eng.drafter.cache.k.data_ptr())
    for prompt in random_prompts(3, V, seed=91):
        eng.generate(prompt, 20)
        assert eng.cache.length == 0  # the request's KV slots are free again
        assert (eng.cache.k.data_ptr(), eng.cache.k.shape, eng.drafter.cache.k.data_ptr()) == ptrs


def test_bad_prompts_raise_clear_errors_and_engine_stays_usable(tiny_models):
    target, _ = tiny_models
    eng = Engine(target, SystemConfig.stock("ngram"), NgramDrafter(), eos_ids=[], max_len=64)
    with pytest.raises(PromptError, match="empty"):
        eng.generate([], 5)
    with pytest.raises(PromptError, match="exceeds the context"):
        eng.generate([1] * 60, 10)
    with pytest.raises(PromptError, match="token ids"):
        eng.generate([1, 999], 5)
    for bad in ([[1, 2], [3]], "hello", torch.ones(2, 3, dtype=torch.long), torch.tensor([1.0, 2.0]), [1, 2.5],
                [True, 2], 7, {3, 1, 2}, {1: 0, 2: 0}):
        with pytest.raises(PromptError, match="prompt"):
            eng.generate(bad, 5)
    for bad_stop in (5, "ab", [None], [1.5], [True], [-1], [7, target.args.vocab_size]):
        with pytest.raises(PromptError, match="stop_ids"):
            eng.generate([1, 2], 3, stop_ids=bad_stop)
    with pytest.raises(SpecPilotError, match="region"):
        eng.generate([1, 2], 3, prof="x")
    import numpy as np

    for bad_stop in (np.array(7), np.array([[7]])):
        with pytest.raises(PromptError, match="stop_ids"):
            eng.generate([1, 2], 3, stop_ids=bad_stop)
    free = eng.generate([1, 2], 8)
    stop = free.tokens[3]
    want = eng.generate([1, 2], 8, stop_ids=[stop]).tokens
    assert len(want) <= 4 and want[-1] == stop
    for same in (iter([stop]), (t for t in [stop]), np.array([stop, 5]), (stop,)):  # iterators and arrays stop too
        assert eng.generate([1, 2], 8, stop_ids=same).tokens == want
    assert eng.generate([1, 2], 8, stop_ids=np.array([], dtype=np.int64)).tokens == free.tokens
    assert eng.generate([1, 2], 3, stop_ids=torch.tensor([7])).tokens == eng.generate([1, 2], 3, stop_ids=[7]).tokens
    for bad_n in (2.5, True, "3"):
        with pytest.raises(PromptError, match="max_new_tokens"):
            eng.generate([1, 2], bad_n)
    assert eng.generate(torch.tensor([1, 2, 3]), 3).tokens == eng.generate([1, 2, 3], 3).tokens
    prompt = random_prompts(1, V, seed=5)[0]
    assert eng.generate(prompt, 10).tokens == ar_tokens(target, prompt, 10)


def test_lattice_and_tree_invariants():
    from specpilot.spec.trees import build_best_first, build_chain

    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        d, k = 6, 4
        lp = torch.log_softmax(torch.randn(d, 10, generator=g), -1)
        top = lp.topk(k)
        lat = PositionalLattice(top.indices, top.values)
        for n in (1, 5, 16, 40):
            t = build_best_first(lat, n)
            assert len(t) <= n and max(t.depths) <= d
            assert all(p < i for i, p in enumerate(t.parents))  # prefix-closed, topological
            # exactly best-first: every frontier candidate scores no higher than the worst included node
            included = set(t.path(i) for i in range(len(t)))
            frontier = [path + (c,) for path in [()] + list(included) if len(path) < d
                        for c, _ in lat.children(path) if path + (c,) not in included]
            score = lambda path: sum(dict(lat.children(path[:j]))[path[j]] for j in range(len(path)))
            if len(t) == n and frontier:
                assert max(score(f) for f in frontier) <= min(t.scores) + 1e-9
            for i in range(len(t)):
                assert abs(score(t.path(i)) - t.scores[i]) < 1e-9
        c = build_chain(lat, 4)
        assert c.tokens == top.indices[:4, 0].tolist() and c.parents == [-1, 0, 1, 2]


# -- row buckets / static path (issue 4, R13) --------------------------------------------------------
@pytest.mark.parametrize("cfg", SYSTEMS, ids=lambda c: c.label())
def test_padded_buckets_equal_unpadded(tiny_models, cfg):
    """Passes padded to row buckets through the static path (the CUDA-graph path, run eagerly on the CPU)
    give the same tokens as unpadded dynamic passes."""
    target, drafter_model = tiny_models
    eng = Engine(target, cfg, make_drafter(cfg, drafter_model), eos_ids=[], buckets=True)
    assert eng.runner is not None
    eng.step_hook = cache_matches_prefill
    for prompt in random_prompts(3, V, length=10, seed=17):
        assert eng.generate(prompt, 30).tokens == ar_tokens(target, prompt, 30)


def test_capture_at_build_takes_the_buckets_a_verify_can_use(tiny_models, monkeypatch):
    """``capture_all`` (run when an engine is built on CUDA) captures the buckets up to ``nodes + 1`` rows, each
    on padding-row inputs: prefix 0, positions 0..B-1, a diagonal mask (no row sees nothing, so no NaN reaches
    the cache). The capture itself is replaced here (CPU); the GPU test is tests/test_graphs_gpu.py."""
    from specpilot.engine.runner import BucketRunner

    target, _ = tiny_models
    seen = {}

    def fake_capture(self, b):
        s = self._static[b]
        assert b not in seen  # each bucket captured once
        seen[b] = (s["start"].item(), s["positions"].tolist(), s["mask01"].clone())
        self._graphs[b] = object()

    monkeypatch.setattr(BucketRunner, "_capture", fake_capture)
    runner = BucketRunner(target, target.new_cache(400), graphs=False)
    assert runner.capture_all() == []  # no graphs (the CPU): nothing to capture
    runner.graphs = True
    assert runner.capture_all(7) == [1, 2, 4, 8]
    assert runner.capture_all(30) == [1, 2, 4, 8, 16, 24, 32]  # the rest, once each
    assert runner.capture_all() == list(runner.buckets)
    start, pos, mask = seen[24]
    assert start == 0 and pos == list(range(24)) and torch.equal(mask, torch.eye(24, dtype=mask.dtype))
    runner._pool = "pool of the dropped graphs"
    runner.drop_graphs()  # graphs and their pool go together (a capture into a freed pool fails on CUDA)
    assert runner._graphs == {} and runner._pool is None
    seen.clear()
    assert runner.capture_all(1) == [1]


def test_r13_rows_outside_buckets_fall_back(tiny_models, monkeypatch):
    from specpilot.engine import runner as graphs

    target, drafter_model = tiny_models
    cfg = SystemConfig(drafter="draft_model", tree="best_first", nodes=12, depth=6, top_k=4)
    eng = Engine(target, cfg, DraftModelDrafter(drafter_model, 4), eos_ids=[], buckets=True)
    eng.runner.buckets = (1, 2, 4)  # trees above 3 nodes exceed every bucket: eager fallback
    calls = {"static": 0, "fallback": 0}
    real_run = eng.runner.run

    def counting(*a, **k):
        out = real_run(*a, **k)
        calls["static" if out is not None else "fallback"] += 1
        return out

    eng.runner.run = counting
    prompt = random_prompts(1, V, seed=19)[0]
    assert eng.generate(prompt, 30).tokens == ar_tokens(target, prompt, 30)
    assert calls["fallback"] > 0
    assert graphs.bucket_for(5, (1, 2, 4)) is None and graphs.bucket_for(3, (1, 2, 4)) == 4


def test_static_draft_model_matches_dynamic(tiny_models):
    """The draft model's static mode (row-bucket catch-up + device-fed drafting loop; CUDA graphs on CUDA)
    proposes the same lattices as the dynamic path, request after request, and the engine output is AR's."""
    target, drafter_model = tiny_models
    dyn, sta = DraftModelDrafter(drafter_model, 3, static=False), DraftModelDrafter(drafter_model, 3, static=True)
    for prompt in random_prompts(2, V, length=9, seed=29):
        committed = list(prompt)
        for step in range(4):
            a, b = propose_one(dyn, committed, 4), propose_one(sta, committed, 4)
            assert [[t for t, _ in row] for row in a._rows] == [[t for t, _ in row] for row in b._rows]
            lp_a = torch.tensor([[p for _, p in row] for row in a._rows])
            lp_b = torch.tensor([[p for _, p in row] for row in b._rows])
            torch.testing.assert_close(lp_a, lp_b, atol=1e-5, rtol=1e-5)
            committed += [row[0][0] for row in a._rows[: step % 3 + 1]]  # accept a varying prefix of the chain
        dyn.reset(), sta.reset()
    cfg = SystemConfig(drafter="draft_model", tree="best_first", nodes=8, depth=4, top_k=3)
    eng = Engine(target, cfg, DraftModelDrafter(drafter_model, 3, static=True), eos_ids=[])
    prompt = random_prompts(1, V, seed=31)[0]
    assert eng.generate(prompt, 25).tokens == ar_tokens(target, prompt, 25)


def test_pipelined_ar_through_buckets_equals_ar(tiny_models, monkeypatch):
    """AR through the row-bucket runner with the next step queued before the host read (the GPU path's
    pipelined AR) gives AR's tokens, keeps the cache equal to a fresh prefill after every step, honours
    stops and max_new_tokens, and really runs the pipelined generator."""
    from specpilot.engine.runner import BucketRunner

    target, _ = tiny_models
    calls = []
    real = BucketRunner.ar_tokens
    monkeypatch.setattr(BucketRunner, "ar_tokens", lambda self, *a: calls.append(a) or real(self, *a))
    eng = Engine(target, SystemConfig.ar(), None, eos_ids=[], buckets=True)
    eng.step_hook = cache_matches_prefill
    for prompt in random_prompts(3, V, length=7, seed=37):
        ref = ar_tokens(target, prompt, 20)
        g = eng.generate(prompt, 20)
        assert g.tokens == ref and g.steps == 19 and g.cache_length == len(prompt) + 19
        stop = ref[9]
        got = eng.generate(prompt, 20, stop_ids=[stop]).tokens
        assert got == ref[: ref.index(stop) + 1]
    assert len(calls) >= 3  # at least every full-length request (a stop at the first token needs no step)


def test_prefill_in_bucket_chunks_equals_one_causal_pass(tiny_models, monkeypatch):
    """With row buckets the prompt is prefilled in chunks of the largest bucket through the static path (CUDA
    graphs on a GPU): chunk i at prefix i·B, causal inside. Its K/V and the tokens equal one eager pass."""
    from specpilot.engine.runner import BucketRunner

    target, _ = tiny_models
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, target.args.vocab_size, (21,), generator=g).tolist()
    eager = Engine(target, SystemConfig.ar(), None, eos_ids=[])
    chunked = Engine(target, SystemConfig.ar(), None, eos_ids=[], buckets=True)
    chunked.runner.buckets = (1, 2, 4, 8)
    calls = []
    real = BucketRunner.run
    monkeypatch.setattr(BucketRunner, "run", lambda self, t, p, s, m: calls.append((len(t), s, p[0])) or real(self, t, p, s, m))
    ref = eager.generate(prompt, 10)
    got = chunked.generate(prompt, 10)
    assert calls[:3] == [(8, 0, 0), (8, 8, 8), (5, 16, 16)]  # the prefill's chunks, then the decode steps
    assert got.tokens == ref.tokens == ar_tokens(target, prompt, 10)
    n = len(prompt)
    torch.testing.assert_close(chunked.cache.k[:, :n], eager.cache.k[:, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked.cache.v[:, :n], eager.cache.v[:, :n], atol=1e-5, rtol=1e-5)


def test_malformed_config_json_gives_a_checkpoint_error(tiny_dirs, tmp_path):
    """A config.json that is a JSON list, or whose shape fields are not positive integers, is refused with a
    CheckpointError naming the file or field (fresh-user run 26 saw AttributeError / TypeError tracebacks)."""
    import json
    import shutil

    from specpilot.model.checkpoint import load_model, read_args
    from specpilot.errors import CheckpointError

    src = tmp_path / "t"
    shutil.copytree(tiny_dirs[0], src)
    good = json.loads((src / "config.json").read_text())
    for cfg, match in (([1, 2], "holds a JSON list"), ({**good, "hidden_size": "big"}, "hidden_size must be"),
                       ({**good, "num_hidden_layers": -1}, "num_hidden_layers must be"),
                       ({**good, "vocab_size": True}, "vocab_size must be")):
        (src / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(CheckpointError, match=match):
            load_model(src)
    (src / "config.json").write_text(json.dumps(good))
    assert read_args(src).hidden_size == good["hidden_size"]


def test_deployment_refuses_what_is_not_a_path_or_a_config(tiny_dirs):
    from specpilot.engine.deployment import Deployment
    from specpilot.errors import CheckpointError, SpecPilotError

    with pytest.raises(CheckpointError, match="checkpoint directory path"):
        Deployment(None)
    dep = Deployment(tiny_dirs[0])
    for bad in (None, {"drafter": "ngram"}):
        with pytest.raises(SpecPilotError, match="takes a SystemConfig"):
            dep.system(bad)
    assert dep.system(SystemConfig.ar()).generate([1, 2, 3], 2).tokens
