"""The batched engine (continuous batching, one exact pass per step): whatever shares its batch, a request's output
equals AR greedy (float32, CPU) for every drafter and tree builder (R4, R12, R18); one exact pass per step; each
cache equals a fresh prefill of its committed tokens after every step (R8); slots come back (R14)."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.engine.batch import BatchEngine, Request
from specpilot.engine.engine import Engine
from specpilot.errors import DrafterError, PromptError
from specpilot.spec.block import BlockDrafter, BlockNet
from specpilot.spec.draft_model import DraftModelDrafter
from specpilot.spec.drafter import SlotFanout
from specpilot.spec.ngram import NgramDrafter
from specpilot.spec.trees import BUILDERS

from .blockutil import tiny_config

V = 64


def ar(target, prompt, n, stops=()):
    return Engine(target, SystemConfig.ar(), None, eos_ids=[]).generate(prompt, n, stop_ids=list(stops)).tokens


def drafter_of(kind, target, small, slots, cfg):
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramDrafter(cfg.ngram_max, cfg.ngram_min, max_matches=cfg.top_k, max_slots=slots)
    if kind == "draft_model":
        return SlotFanout([DraftModelDrafter(small, cfg.top_k, static=False) for _ in range(slots)])
    return BlockDrafter(BlockNet(tiny_config(target)), target, top_k=cfg.top_k, max_len=16, max_slots=slots)


def random_requests(rng, n, repeats=True):
    """Prompts of random length (some with repeats so n-gram lookup finds matches), budgets 1..24, a few stop ids."""
    out = []
    for _ in range(n):
        base = [rng.randrange(V) for _ in range(rng.randint(2, 8))]
        prompt = (base * rng.randint(1, 3))[: rng.randint(3, 20)] if repeats else base
        out.append((prompt, rng.choice([1, 1, 2, 5, 13, 24]), frozenset(rng.sample(range(V), rng.choice([0, 0, 2])))))
    return out


def cache_matches_prefill(eng: BatchEngine):
    """Every running request's slot holds exactly a fresh prefill of its committed tokens but the last (R8)."""
    t = eng.target
    for r in eng._running.values():
        c = eng.pool.cache(r.slot)
        n = len(r.committed) - 1
        assert c.length == n
        fresh = t.new_cache(n + 1)
        t.forward(torch.tensor(r.committed[:-1]), torch.arange(n), fresh, 0)
        torch.testing.assert_close(c.k[:, :n], fresh.k[:, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c.v[:, :n], fresh.v[:, :n], atol=1e-5, rtol=1e-5)


CASES = [("none", "chain")] + [("ngram", b) for b in sorted(BUILDERS)] + [("draft_model", "best_first"),
                                                                          ("draft_model", "chain"), ("block", "best_first"),
                                                                          ("block", "eagle2_topk")]


PADDED = [("none", "chain"), ("ngram", "best_first"), ("draft_model", "chain"), ("block", "eagle2_topk")]


@pytest.mark.parametrize("kind,tree,padded", [(k, t, False) for k, t in CASES] + [(k, t, True) for k, t in PADDED])
def test_batched_output_equals_ar_whatever_the_batch(tiny_models, kind, tree, padded):
    """``padded``: decode passes through the BatchRunner's (requests, rows) buckets and the Triton batched tree
    attention (in the interpreter here), padding rows writing to the scratch slot: the CUDA-graph path, eagerly."""
    target, small = tiny_models
    rng = random.Random(zlib.crc32(f"{kind}|{tree}".encode()))  # stable across processes (hash() is salted)
    cfg = (SystemConfig.ar() if kind == "none" else
           SystemConfig(drafter=kind, tree=tree, nodes=rng.choice([3, 6, 10]), depth=rng.choice([3, 5]),
                        top_k=1 if tree == "chain" else 3))
    slots = rng.choice([2, 3, 5])
    eng = BatchEngine(target, cfg, drafter_of(kind, target, small, slots, cfg), eos_ids=[], max_num_seqs=slots,
                      padded=padded)
    assert (eng.runner is not None) == padded
    eng.step_hook = cache_matches_prefill
    reqs = random_requests(rng, 9)  # more requests than slots: they queue, join and leave
    passes = []
    real = target.forward_prepared
    target.forward_prepared = lambda *a, **k: passes.append(1) or real(*a, **k)
    try:
        for i, (p, n, stops) in enumerate(reqs):
            eng.add_request(Request(f"r{i}", p, n, stops))
        got = {f"r{i}": [] for i in range(len(reqs))}
        steps = 0
        while eng.has_work():
            before = eng.exact_passes
            for o in eng.step():
                got[o.request_id] += o.new_tokens
            assert eng.exact_passes - before <= 1  # one exact pass per step, whatever the batch size
            steps += 1
    finally:
        del target.forward_prepared
    assert len(passes) == eng.exact_passes + eng.prefill_passes
    if padded:  # every decode step fits a bucket here (rows per request <= 1 + nodes)
        assert eng.runner.passes == eng.exact_passes > 0
    for i, (p, n, stops) in enumerate(reqs):
        assert got[f"r{i}"] == ar(target, p, n, stops), (i, p, n, sorted(stops))
    assert eng.free_slots() == slots and not eng.has_work()
    assert all(c.length == 0 for c in (eng.pool.cache(s) for s in range(slots)))


def test_generate_all_gives_each_request_its_batch_1_output(tiny_models):
    target, small = tiny_models
    cfg = SystemConfig(drafter="draft_model", tree="best_first", nodes=6, depth=4, top_k=2)
    rng = random.Random(7)
    reqs = random_requests(rng, 6)
    eng = BatchEngine(target, cfg, drafter_of("draft_model", target, small, 4, cfg), eos_ids=[], max_num_seqs=4)
    gens = eng.generate_all([p for p, _, _ in reqs], [n for _, n, _ in reqs])
    one = Engine(target, cfg, DraftModelDrafter(small, 2, static=False), eos_ids=[])
    for g, (p, n, _) in zip(gens, reqs):
        alone = one.generate(p, n)
        assert g.tokens == alone.tokens and g.steps == len(g.accepted) and sum(g.accepted) + 1 == len(g.tokens)
        assert g.stop_reason == alone.stop_reason == "length"


def test_abort_frees_the_slot_and_others_go_on(tiny_models):
    target, _ = tiny_models
    eng = BatchEngine(target, SystemConfig.ar(), None, eos_ids=[], max_num_seqs=2)
    p = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    for i, q in enumerate(p):
        eng.add_request(Request(f"r{i}", q, 10))
    first = eng.step()  # r0 and r1 prefilled and decoded once; r2 waits
    assert eng.free_slots() == 0 and {o.request_id for o in first} == {"r0", "r1"}
    eng.abort_request("r0")  # running: its slot goes to the waiting r2
    eng.abort_request("nope")  # unknown: nothing
    got = {"r1": [t for o in first if o.request_id == "r1" for t in o.new_tokens], "r2": []}
    while eng.has_work():
        for o in eng.step():
            assert o.request_id != "r0"
            got[o.request_id] += o.new_tokens
    assert got["r1"] == ar(target, p[1], 10) and got["r2"] == ar(target, p[2], 10)
    assert eng.free_slots() == 2


def test_bad_requests_are_refused_and_the_engine_stays_usable(tiny_models):
    target, _ = tiny_models
    eng = BatchEngine(target, SystemConfig.ar(), None, eos_ids=[], max_num_seqs=2, max_len=32)
    eng.add_request(Request("a", [1, 2], 3))
    for bad, msg in ((Request("a", [1], 2), "already in the engine"), (Request("b", [], 2), "empty"),
                     (Request("c", [1] * 30, 5), "exceeds the context"), (Request("d", [1, V], 2), "lie in"),
                     (Request("e", [1], 0), ">= 1"), (Request("f", [1], 2, frozenset({V + 3})), "outside the vocab")):
        with pytest.raises(PromptError, match=msg):
            eng.add_request(bad)
    out = []
    while eng.has_work():
        out += eng.step()
    assert [t for o in out for t in o.new_tokens] == ar(target, [1, 2], 3)


def test_a_drafter_with_fewer_slots_than_the_batch_is_refused(tiny_models):
    target, small = tiny_models
    with pytest.raises(DrafterError, match="holds 1 requests, the batch 4"):
        BatchEngine(target, SystemConfig(drafter="draft_model"), DraftModelDrafter(small, 2), max_num_seqs=4)


def test_stop_and_one_token_requests_in_a_batch(tiny_models):
    """R1, R4: a stop id accepted mid-block ends only its request; max_new_tokens 1 finishes at the prefill."""
    target, small = tiny_models
    cfg = SystemConfig(drafter="ngram", tree="best_first", nodes=6, depth=4, top_k=2)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    full = ar(target, prompt, 12)
    stop = full[5]
    eng = BatchEngine(target, cfg, drafter_of("ngram", target, small, 3, cfg), eos_ids=[], max_num_seqs=3)
    eng.add_request(Request("stop", prompt, 12, frozenset({stop})))
    eng.add_request(Request("one", prompt, 1))
    eng.add_request(Request("free", prompt, 12))
    got, reasons = {"stop": [], "one": [], "free": []}, {}
    while eng.has_work():
        for o in eng.step():
            got[o.request_id] += o.new_tokens
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    assert got["stop"] == full[: full.index(stop) + 1] and reasons["stop"] == "stop"
    assert got["one"] == full[:1] and reasons["one"] == "length"
    assert got["free"] == full and reasons["free"] == "length"


def test_bench_batch_writes_json_with_equal_outputs(monkeypatch, capsys, tmp_path):
    """``specpilot bench --batch``: every size of both systems measured (open and closed loop, steps with rows),
    batched outputs equal to the single-request engine's in float32, token forcing against batch-1 AR passed."""
    import json

    from specpilot.zoo import bundled_target_dir

    from .conftest import run_cli

    n = torch.get_num_threads()
    try:
        code, out, err = run_cli(monkeypatch, capsys, "bench", "--target", str(bundled_target_dir()), "--batch", "1,3",
                                 "--device", "cpu", "--dtype", "float32", "--prefix", "16", "--new-tokens", "6",
                                 "--out", str(tmp_path))
    finally:
        torch.set_num_threads(n)
    assert code == 0, err
    (path,) = tmp_path.glob("batch_bench_*.json")
    res = json.loads(path.read_text())
    assert set(res["runs"]) == {"ar@1", "ar@3", "spec@1", "spec@3"}
    for r in res["runs"].values():
        assert r["outputs_equal_batch1"] == r["outputs_equal_single_engine"] == 1.0
        assert r["open"]["tokens"] > 0 and r["closed"]["requests"] >= 2
        assert r["open"]["steps"] and all(s["rows"] >= s["requests"] >= 1 for s in r["open"]["steps"])
    assert res["forcing_ar_at_3"]["passed"] and res["forcing_spec_at_3"]["passed"]
    assert res["forcing_batch1_ar_vs_single_engine_ar"]["passed"] and "passed" not in res["forcing_single_engine_ar"]
    assert (tmp_path / path.name.replace(".json", ".png")).is_file()
    code, _, err = run_cli(monkeypatch, capsys, "bench", "--target", str(bundled_target_dir()), "--batch", "1,x")
    assert code == 2 and err.strip().startswith("error: --batch takes")


def test_reset_after_a_failed_step_frees_every_slot(tiny_models, monkeypatch):
    """A step that raises between taking a request's slot and recording it would leak the slot; ``reset`` drops every
    request and frees every slot, and the engine serves again."""
    target, _ = tiny_models
    eng = BatchEngine(target, SystemConfig.ar(), None, eos_ids=[], max_num_seqs=2)
    eng.add_request(Request("a", [1, 2, 3], 4))
    eng.add_request(Request("b", [4, 5], 4))
    eng.add_request(Request("c", [6], 4))
    monkeypatch.setattr(eng, "_prefill", lambda rs: (_ for _ in ()).throw(RuntimeError("planted")))
    with pytest.raises(RuntimeError, match="planted"):
        eng.step()
    assert eng.free_slots() == 0 and eng.num_waiting() == 1  # two slots taken by requests nobody records
    monkeypatch.undo()
    eng.reset()
    assert eng.free_slots() == 2 and eng.num_waiting() == 0 and not eng.has_work()
    gens = eng.generate_all([[1, 2, 3]], 4)
    assert gens[0].tokens == ar(target, [1, 2, 3], 4)


@pytest.mark.parametrize("kind,tree", [("none", "chain"), ("ngram", "best_first"), ("ngram", "chain")])
def test_llama_target_batched_output_equals_ar(tmp_path, kind, tree):
    """A Llama target (no q/k norm: its fused projection rotates q and k in one RoPE call, the batched pass places
    its rows with ``batch_sdpa``): outputs equal AR greedy whatever the batch, caches equal a fresh prefill."""
    from specpilot.model.checkpoint import load_model

    from .conftest import save_tiny

    target = load_model(save_tiny(tmp_path / "llama", "llama", hidden=96, layers=2, heads=6, kv_heads=2, seed=4))
    assert not target.args.qk_norm and hasattr(target.model.layers[0].self_attn, "qkv_proj")
    rng = random.Random(zlib.crc32(f"llama|{kind}|{tree}".encode()))
    cfg = SystemConfig.ar() if kind == "none" else SystemConfig(drafter=kind, tree=tree, nodes=4, depth=3,
                                                                top_k=1 if tree == "chain" else 3)
    eng = BatchEngine(target, cfg, drafter_of(kind, target, None, 3, cfg), eos_ids=[], max_num_seqs=3)
    eng.step_hook = cache_matches_prefill
    reqs = random_requests(rng, 7)
    got = {f"r{i}": [] for i in range(len(reqs))}
    for i, (p, n, stops) in enumerate(reqs):
        eng.add_request(Request(f"r{i}", p, n, stops))
    while eng.has_work():
        for o in eng.step():
            got[o.request_id] += o.new_tokens
    for i, (p, n, stops) in enumerate(reqs):
        assert got[f"r{i}"] == ar(target, p, n, stops), (i, p, n, sorted(stops))


def test_cpu_batched_head_runs_every_row_count_unpadded_and_matches_reference(tiny_models):
    """On the CPU a batched pass's LM head (prepacked, :mod:`specpilot.kernels.cpu_linear`) runs on exactly the
    pass's rows, and its argmax equals plain ``F.linear``'s, the reference, at every row count."""
    target = tiny_models[0]
    seen = []
    hook = target.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].shape[0]))
    try:
        gen = torch.Generator().manual_seed(7)
        for r in (1, 2, 3, 4, 5, 9):
            h = torch.randn(r, target.args.hidden_size, generator=gen)
            seen.clear()
            got = target.batch_greedy(h, False)
            assert seen == [r]
            want = torch.nn.functional.linear(h, target.lm_head.weight).argmax(dim=-1)
            assert torch.equal(got, want), r
    finally:
        hook.remove()


@pytest.mark.parametrize("kind", ["ngram", "block"])
def test_speculation_off_above_spec_max_requests_stays_lossless(tiny_models, kind):
    """``spec_max_requests=2``: steps with more running requests draft nothing (an AR step for each), steps with at
    most 2 draft; every output equals AR. The drafters keep their state across the steps they sit out."""
    target, small = tiny_models
    cfg = SystemConfig(drafter=kind, tree="best_first", nodes=6, depth=4, top_k=2)
    rng = random.Random(zlib.crc32(kind.encode()))
    reqs = [(p, 24, s) for p, _, s in random_requests(rng, 5)] + [([3, 4, 5, 3, 4, 5, 3, 4], 24, frozenset())]
    eng = BatchEngine(target, cfg, drafter_of(kind, target, small, 5, cfg), eos_ids=[], max_num_seqs=5,
                      spec_max_requests=2)
    for i, (p, n, stops) in enumerate(reqs):
        eng.add_request(Request(f"r{i}", p, n, stop_ids=stops))
    got, drafted_small = {f"r{i}": [] for i in range(len(reqs))}, 0
    while eng.has_work():
        running = len(eng._running)
        outs = eng.step()
        if running > 2:
            assert all(o.drafted == 0 for o in outs), running
        else:
            drafted_small += sum(o.drafted for o in outs)
        for o in outs:
            got[o.request_id] += o.new_tokens
    assert drafted_small > 0  # the tail of the run, at 1-2 requests, drafted
    for i, (p, n, stops) in enumerate(reqs):
        assert got[f"r{i}"] == ar(target, p, n, stops), i
    with pytest.raises(ValueError, match="spec_max_requests"):
        BatchEngine(target, cfg, drafter_of(kind, target, small, 5, cfg), spec_max_requests=0, max_num_seqs=5)
