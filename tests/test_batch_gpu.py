"""The batched engine on a GPU: decode steps replay one CUDA graph per (requests, rows) bucket through the compiled
Triton batched tree attention; every bucket is captured before the first request, none later; graphed outputs equal
the same padded passes run eagerly bit for bit, and AR greedy in float32. Skipped without CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.engine.batch import Request
from specpilot.engine.deployment import Deployment
from specpilot.zoo import bundled_drafter_dir, bundled_target_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _serve(eng, reqs) -> dict[str, list[int]]:
    """Requests joining over time (a third up front, one more after each step), run to the end."""
    got = {q.request_id: [] for q in reqs}
    pending = list(reqs)
    for q in pending[: len(pending) // 3]:
        eng.add_request(q)
    pending = pending[len(pending) // 3:]
    while eng.has_work() or pending:
        if pending:
            eng.add_request(pending.pop(0))
        for o in eng.step():
            got[o.request_id] += o.new_tokens
    return got


SHARED = SystemConfig(drafter="ngram", tree="best_first", nodes=6, depth=4, top_k=2, row_selection="shared_budget",
                      shared_budget=(12, 3, 20, 8, 5))  # one request may take 12 or 20 rows


@pytest.mark.parametrize("cfg", [SystemConfig.ar(), SystemConfig(drafter="ngram", tree="best_first", nodes=6,
                                                                 depth=4, top_k=2), SHARED],
                         ids=["ar", "ngram_tree", "shared_budget"])
def test_graphed_batches_equal_eager_padded_and_ar(cfg):
    dep = Deployment(bundled_target_dir(), bundled_drafter_dir(), dtype="float32", device="cuda")
    rng = random.Random(3)
    base = [[rng.randrange(1, 500) for _ in range(rng.randint(3, 9))] for _ in range(12)]
    reqs = [Request(f"r{i}", (b * 4)[: rng.randint(5, 40)], rng.choice([1, 3, 17, 40])) for i, b in enumerate(base)]
    graphed = dep.batch_system(cfg, max_num_seqs=5, eos_ids=[])
    assert graphed.runner is not None and graphed.runner.graphs
    captured = graphed.capture_graphs()
    before = dict(graphed.runner._graphs)
    out = _serve(graphed, reqs)
    assert graphed.runner._graphs == before and captured == len(before)  # nothing captured after the build
    assert graphed.runner.replays == graphed.exact_passes > 0
    eager = dep.batch_system(cfg, max_num_seqs=5, eos_ids=[])
    eager.runner.graphs = False  # the same padded passes, launched one by one
    assert _serve(eager, [Request(q.request_id, q.prompt_ids, q.max_new_tokens) for q in reqs]) == out
    single = dep.system(SystemConfig.ar(), eos_ids=[])
    for q in reqs:
        assert out[q.request_id] == single.generate(q.prompt_ids, q.max_new_tokens).tokens, q.request_id
    assert graphed.free_slots() == 5


@pytest.mark.parametrize("cfg", [SystemConfig.ar(), SystemConfig(drafter="ngram", tree="best_first", nodes=6,
                                                                 depth=4, top_k=2)], ids=["ar", "ngram_tree"])
def test_bf16_batched_outputs_equal_batch_1_bit_for_bit(cfg):
    """Batch invariance (the default ``KernelConfig.batch_invariant``): in bf16, where cuBLAS rounds differently
    at every row count, each request served among others of other lengths equals the same request served alone
    by the same engine, token for token."""
    dep = Deployment(bundled_target_dir(), bundled_drafter_dir(), dtype="bfloat16", device="cuda")
    rng = random.Random(5)
    base = [[rng.randrange(1, 500) for _ in range(rng.randint(3, 9))] for _ in range(12)]
    reqs = [Request(f"r{i}", (b * 6)[: rng.randint(5, 60)], rng.choice([3, 17, 64])) for i, b in enumerate(base)]
    batched = dep.batch_system(cfg, max_num_seqs=6, eos_ids=[])
    assert batched.target.kernels.batch_invariant and batched.runner is not None
    batched.capture_graphs()
    out = _serve(batched, reqs)
    alone = dep.batch_system(cfg, max_num_seqs=1, eos_ids=[])
    alone.capture_graphs()
    for q in reqs:
        got = _serve(alone, [Request(q.request_id, q.prompt_ids, q.max_new_tokens)])[q.request_id]
        assert got == out[q.request_id], q.request_id


@pytest.mark.parametrize("cfg", [SystemConfig(drafter="ngram", tree="chain", nodes=6, depth=6),
                                 SystemConfig(drafter="ngram", tree="best_first", nodes=6, depth=4, top_k=2)],
                         ids=["ngram_chain", "ngram_tree"])
def test_bf16_speculation_reproduces_ar_on_random_weights(tmp_path, cfg):
    """Verification that reproduces AR's bits: a random-weight target in bf16 (near ties everywhere, so one bit of
    difference parts the outputs within a few tokens) served by the batched engine. With the keys walked in
    position-aligned blocks (kernels/batch_attention.py, "Aligned to AR") and batch-invariant GEMMs, a chain's
    accepted rows carry AR's bits, so n-gram chain speculation equals AR token for token. A tree's rows off its
    first-child path see their ancestors at other lanes: its outputs are compared and the first difference reported,
    not asserted. Prefix reuse is on in both (the same aligned walk gives a reused prompt its whole-prefill bits)."""
    from .conftest import save_tiny

    target = save_tiny(tmp_path / "t", vocab=2048, hidden=256, layers=4, heads=4, kv_heads=2, seed=7)
    dep = Deployment(target, None, dtype="bfloat16", device="cuda")
    rng = random.Random(9)
    base = [[rng.randrange(1, 2048) for _ in range(rng.randint(3, 9))] for _ in range(8)]
    reqs = [Request(f"r{i}", (b * 6)[: rng.randint(5, 60)], 96) for i, b in enumerate(base)]
    outs = {}
    for name, c in (("ar", SystemConfig.ar()), ("spec", cfg)):
        eng = dep.batch_system(c, max_num_seqs=4, eos_ids=[], prefix_caching=True)
        eng.capture_graphs()
        outs[name] = _serve(eng, [Request(q.request_id, q.prompt_ids, q.max_new_tokens) for q in reqs])
    if cfg.tree == "chain":
        assert outs["spec"] == outs["ar"]
    else:
        first = {r: next((i for i, (a, b) in enumerate(zip(outs["ar"][r], outs["spec"][r])) if a != b), None)
                 for r in outs["ar"]}
        print("first difference per request (tree):", first)


@pytest.mark.parametrize("tree", ["chain", "best_first"])
def test_batched_block_drafter_runs_its_graphed_batch_step_and_equals_ar(tree):
    """On CUDA a batch of several slots drafts with the block drafter's batched static step (a CUDA graph per
    requests and width bucket, all captured when it is built): float32 outputs equal AR."""
    from specpilot.zoo import bundled_block_dir

    dep = Deployment(bundled_target_dir(), dtype="float32", device="cuda", block_dirs=[bundled_block_dir()])
    cfg = SystemConfig(drafter="block", drafter_path=str(bundled_block_dir()), tree=tree,
                       nodes=12 if tree == "best_first" else 6, depth=6, top_k=16 if tree == "best_first" else 1)
    eng = dep.batch_system(cfg, max_num_seqs=5, eos_ids=[])
    step = eng.drafter._batch
    assert step is not None and step.graphs
    captured = dict(step._graphs)
    rng = random.Random(7)
    reqs = [Request(f"r{i}", [rng.randrange(1, 500) for _ in range(rng.randint(3, 30))], rng.choice([3, 17, 40]))
            for i in range(9)]
    out = _serve(eng, reqs)
    assert step._graphs == captured  # no capture after the build
    single = dep.system(SystemConfig.ar(), eos_ids=[])
    for q in reqs:
        assert out[q.request_id] == single.generate(q.prompt_ids, q.max_new_tokens).tokens, q.request_id
