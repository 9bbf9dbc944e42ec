"""The batched engine on hybrid targets (tiny qwen3_5 and qwen3_next, CPU float32): whatever shares its batch, a
request's output equals AR greedy and its output run alone (scripted drafters with steps drafting nothing, the n-gram
drafter, a hybrid draft model, a block drafter reading target features; chain and best_first, snapshot and replay);
one exact pass per step over every running request's rows; after every step and when a request ends, each slot's
GDN states, conv windows and K/V equal a fresh prefill of its committed tokens (R8, R9, R12, R14), and the features a
drafter got equal a causal pass over the request alone; the shared budget, prompt admission and the drafter block
select rows through the same pool; the padded (CUDA-graph) path and the batched kernel are one-line refusals."""

from __future__ import annotations

import dataclasses
import random
import zlib

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.engine.batch import BatchEngine, Request
from specpilot.engine.engine import Engine
from specpilot.errors import SpecPilotError
from specpilot.model.batch import BatchRows
from specpilot.model.checkpoint import load_model
from specpilot.spec.block import BlockDrafter, BlockNet
from specpilot.spec.draft_model import DraftModelDrafter
from specpilot.spec.drafter import SlotFanout
from specpilot.spec.lattice import TrieLattice
from specpilot.spec.ngram import NgramDrafter

from .blockutil import tiny_config
from .hybridutil import LAYERS, ar_tokens, near_copy, tiny_target, tree_config, verify_mode
from .test_qwen3_next import tiny_next

V = 96  # both tiny targets' vocabulary


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next_batch")
    tiny_next(path, seed=4)
    return {"qwen3_5": tiny_target(), "qwen3_next": load_model(path, dtype="float32").requires_grad_(False)}


class ScriptedBatch:
    """A drafter of many slots that knows each request's AR output (looked up by its committed tokens) and, per
    request and step, at random drafts nothing, the AR tokens, a wrong chain, a wrong then a right branch (the
    accepted path never the first), or AR tokens up to a random depth then wrong ones (partial acceptance)."""

    kind, target_layers, vocab_size, max_context = "custom", (), V, None

    def __init__(self, known: dict[tuple[int, ...], list[int]], slots: int, seed: int):
        self.known, self.max_slots, self.rng, self.nothing, self.calls = known, slots, random.Random(seed), 0, 0

    def reset(self, slot: int = 0) -> None:
        pass

    def observe(self, slot, features, start) -> None:
        pass

    def propose(self, batch):
        return [self._one(q.committed, q.depth) for q in batch]

    def _one(self, committed, depth):
        for prompt, ar in self.known.items():
            done = len(committed) - len(prompt)
            if done >= 0 and tuple(committed[: len(prompt)]) == prompt and committed[len(prompt):] == ar[:done]:
                right = ar[done : done + depth]
                break
        else:
            raise AssertionError("a committed sequence off every request's AR output")
        self.calls += 1  # every fifth proposal drafts nothing, whatever order the engine asks in
        how = "nothing" if self.calls % 5 == 0 else self.rng.choice(["nothing", "right", "wrong", "both", "partial",
                                                                       "partial"])
        if how == "nothing" or not right:
            self.nothing += 1
            return None
        wrong = [(t + 1) % V for t in right]
        cut = self.rng.randrange(len(right))
        paths = {"right": [right], "wrong": [wrong], "both": [wrong, right], "partial": [right[:cut] + wrong[cut:]]}
        return TrieLattice(paths[how], depth)


def random_requests(rng: random.Random, n: int) -> list[tuple[list[int], int, frozenset]]:
    """Distinct prompts of 2..30 tokens (some repeating, for the n-gram drafter), budgets 1..24, a few stop ids."""
    out, seen = [], set()
    while len(out) < n:
        base = [rng.randrange(V) for _ in range(rng.randint(2, 8))]
        prompt = (base * rng.randint(1, 4))[: rng.randint(2, 30)]
        if tuple(prompt) not in seen:
            seen.add(tuple(prompt))
            out.append((prompt, rng.choice([1, 2, 5, 13, 24, 24]), frozenset(rng.sample(range(V), rng.choice([0, 0, 2])))))
    return out


def expected(target, prompt, n, stops) -> list[int]:
    """AR greedy's output: ``n`` tokens, cut after the first stop id."""
    ar = ar_tokens(target, prompt, n)
    cut = next((i + 1 for i, t in enumerate(ar) if t in stops), n)
    return ar[:cut]


def check_slot(target, cache, committed: list[int]) -> None:
    """A slot's cache equals a fresh prefill of every committed token but the last: length, GDN states and windows,
    attention K/V (within 1e-5)."""
    n = len(committed) - 1
    assert cache.length == n
    fresh = target.new_cache(n + 1)
    target.forward(torch.tensor(committed[:-1]), torch.arange(n), fresh, 0)
    fresh.commit(n)
    for got, want in ((cache.state, fresh.state), (cache.window, fresh.window), (cache.k[:, :n], fresh.k[:, :n]),
                      (cache.v[:, :n], fresh.v[:, :n])):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def checked_engine(target, cfg, drafter, slots) -> tuple[BatchEngine, list[int]]:
    """A BatchEngine whose every running slot is checked after every decode pass, and every request's slot when it
    ends (before it is freed); the list counts the checks."""
    eng = BatchEngine(target, cfg, drafter, eos_ids=[], max_num_seqs=slots)
    checks, release = [0], eng._release

    def at_end(r):
        check_slot(target, eng.pool.cache(r.slot), r.committed)
        checks[0] += 1
        release(r)

    def every_step(e):
        for r in e._running.values():
            check_slot(target, e.pool.cache(r.slot), r.committed)
            checks[0] += 1

    eng._release, eng.step_hook = at_end, every_step
    return eng, checks


def run(eng: BatchEngine, reqs) -> tuple[dict[str, list[int]], list[int], dict[str, int]]:
    """All of ``reqs`` through the queue; returns each request's tokens, the accepted draft tokens of every request
    and decode step, and counts: ``widest`` (most requests one decode pass served), ``rides`` (steps whose admitted
    prompts rode in the decode pass). Asserts one exact pass per step and every slot free at the end."""
    for i, (p, n, stops) in enumerate(reqs):
        eng.add_request(Request(f"r{i}", p, n, stops))
    got = {f"r{i}": [] for i in range(len(reqs))}
    accepted, stats = [], {"widest": 0, "rides": 0}
    while eng.has_work():
        passes, prefills, running = eng.exact_passes, eng.prefill_passes, bool(eng._running)
        outs = eng.step()
        assert eng.exact_passes - passes <= 1
        decoded = [o for o in outs if got[o.request_id]]
        stats["widest"] = max(stats["widest"], len(decoded))
        stats["rides"] += running and len(decoded) < len(outs) and eng.prefill_passes == prefills
        accepted += [o.accepted for o in decoded]
        for o in outs:
            got[o.request_id] += o.new_tokens
    assert eng.free_slots() == eng.num_slots and all(eng.pool.cache(s).length == 0 for s in range(eng.num_slots))
    assert eng.pool.state.abs().sum() == 0  # freed slots hold no state (R14)
    return got, accepted, stats


def drafter_of(kind, target, cfg, slots, known, seed):
    if kind == "scripted":
        return ScriptedBatch(known, slots, seed)
    if kind == "ngram":
        return NgramDrafter(cfg.ngram_max, cfg.ngram_min, max_matches=cfg.top_k, max_slots=slots)
    net = near_copy(target, 2e-3)  # a hybrid draft model that agrees with the target often, not always
    return SlotFanout([DraftModelDrafter(net, cfg.top_k, static=False) for _ in range(slots)])


CASES = [("qwen3_5", kind, mode, tree) for kind in ("scripted", "ngram", "draft_model")
         for mode, tree in (("snapshot", "chain"), ("replay", "chain"), ("replay", "best_first"))] + \
        [("qwen3_next", "scripted", "snapshot", "chain"), ("qwen3_next", "scripted", "replay", "best_first"),
         ("qwen3_next", "ngram", "replay", "best_first")]


@pytest.mark.parametrize("model,kind,mode,tree", CASES)
def test_batched_spec_equals_ar_and_state_equals_prefill(targets, model, kind, mode, tree):
    target = targets[model]
    rng = random.Random(zlib.crc32("|".join((model, kind, mode, tree)).encode()))  # stable across processes
    reqs = random_requests(rng, 7)  # more requests than slots: they queue, join and leave mid-run
    known = {tuple(p): ar_tokens(target, p, n) for p, n, _ in reqs}
    slots = rng.choice([2, 3, 4])
    with verify_mode(target, mode):
        cfg = tree_config(tree, rng.choice([3, 5]), nodes=rng.choice([4, 8]), top_k=3)
        drafter = drafter_of(kind, target, cfg, slots, known, rng.randrange(99))
        eng, checks = checked_engine(target, cfg, drafter, slots)
        assert all(eng.pool.cache(s).mode == mode for s in range(slots))
        got, accepted, stats = run(eng, reqs)
    for i, (p, n, stops) in enumerate(reqs):
        assert got[f"r{i}"] == expected(target, p, n, stops), (i, p, n, sorted(stops))
    assert stats["widest"] >= 2 and checks[0] >= len(reqs) + eng.exact_passes
    if kind != "ngram":  # the n-gram drafter accepts a drafted token only now and then on random targets
        assert max(accepted) >= 2
    if kind == "scripted":
        assert drafter.nothing > 0 and 0 in accepted


def test_batched_equals_each_request_alone(targets):
    """generate_all's outputs and accepted counts equal the single-request Engine's with the same (hybrid) draft
    model, request by request; a 140-token prompt runs the chunked prefill inside a batched pass."""
    target = targets["qwen3_5"]
    rng = random.Random(3)
    reqs = random_requests(rng, 5)
    reqs[2] = ([rng.randrange(V) for _ in range(140)], 13, frozenset())
    cfg = SystemConfig(drafter="draft_model", tree="best_first", nodes=6, depth=4, top_k=2)
    net = near_copy(target, 2e-3)
    with verify_mode(target, "replay"):
        eng, checks = checked_engine(target, cfg, SlotFanout([DraftModelDrafter(net, 2, static=False)
                                                              for _ in range(3)]), 3)
        gens = eng.generate_all([p for p, _, _ in reqs], [n for _, n, _ in reqs])
        for g, (p, n, _) in zip(gens, reqs):
            alone = Engine(target, cfg, DraftModelDrafter(net, 2, static=False), eos_ids=[]).generate(p, n)
            assert g.tokens == alone.tokens == ar_tokens(target, p, n)
            assert g.accepted == alone.accepted
    assert max(max(g.accepted) for g in gens) >= 3 and checks[0] > 0


@pytest.mark.parametrize("selection,admission,block", [("shared_budget", 0, ()), ("per_request", 40, ()),
                                                       ("per_request", 0, (5, 3, 1)), ("shared_budget", 40, (5, 2))])
def test_row_selection_mechanisms_on_a_hybrid(targets, selection, admission, block):
    """The shared node budget, prompt admission (prompts prefilled inside a decode pass) and the per-request
    drafter block choose rows for a hybrid batch as for a dense one: outputs equal AR, caches equal a prefill."""
    target = targets["qwen3_5"]
    rng = random.Random(len(block) + admission + len(selection))
    reqs = random_requests(rng, 7)
    known = {tuple(p): ar_tokens(target, p, n) for p, n, _ in reqs}
    cfg = SystemConfig(drafter="ngram", tree="best_first", nodes=4, depth=5, top_k=3, row_selection=selection,
                       prompt_admission=admission, drafter_block=block)
    with verify_mode(target, "replay"):
        eng, checks = checked_engine(target, cfg, ScriptedBatch(known, 3, 5), 3)
        got, accepted, stats = run(eng, reqs)
    for i, (p, n, stops) in enumerate(reqs):
        assert got[f"r{i}"] == expected(target, p, n, stops), (i, p, n, sorted(stops))
    assert max(accepted) >= 2 and checks[0] > 0
    assert (stats["rides"] > 0) == bool(admission)  # admitted prompts prefilled inside a decode pass


class FeatureLog:
    """A feature-reading drafter that also keeps, per slot, every feature row the engine hands it (by position)."""

    def __init__(self, inner, slots: int, width: int):
        self.inner, self.rows = inner, torch.zeros(slots, 600, width)
        self.kind, self.target_layers, self.vocab_size = inner.kind, inner.target_layers, inner.vocab_size
        self.max_context, self.max_slots = inner.max_context, inner.max_slots

    def reset(self, slot: int = 0) -> None:
        self.rows[slot].zero_()
        self.inner.reset(slot)

    def observe(self, slot, features, start) -> None:
        self.rows[slot, start : start + features.shape[0]] = features
        self.inner.observe(slot, features, start)

    def propose(self, batch):
        return self.inner.propose(batch)


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_next"])
def test_a_feature_drafter_gets_each_request_its_own_committed_features(targets, model):
    """A block drafter (random weights) reading a GDN, the attention and the last layer: after every step, the
    features the batched engine handed it for each running request's committed positions equal a causal pass over
    that request's committed tokens alone (within 1e-5); outputs equal AR."""
    target = targets[model]
    rng = random.Random(8)
    reqs = random_requests(rng, 6)
    cfg = SystemConfig(drafter="block", tree="best_first", nodes=6, depth=4, top_k=3)
    torch.manual_seed(0)
    net = BlockNet(dataclasses.replace(tiny_config(target), target_layers=list(LAYERS))).eval()
    log = FeatureLog(BlockDrafter(net, target, top_k=3, max_slots=3), 3, len(LAYERS) * target.args.hidden_size)
    compared = [0]

    def features_match(e):
        for r in e._running.values():
            n = e.pool.cache(r.slot).length
            feats = []
            target.forward(torch.tensor(r.committed[:n]), torch.arange(n), target.new_cache(n), 0, features=feats,
                           feature_layers=LAYERS)
            torch.testing.assert_close(log.rows[r.slot, :n], torch.cat(feats, -1), atol=1e-5, rtol=1e-5)
            compared[0] += 1

    with verify_mode(target, "replay"):
        eng = BatchEngine(target, cfg, log, eos_ids=[], max_num_seqs=3)
        eng.step_hook = features_match
        got, _, stats = run(eng, reqs)
    for i, (p, n, stops) in enumerate(reqs):
        assert got[f"r{i}"] == expected(target, p, n, stops)
    assert compared[0] > 0 and stats["widest"] >= 2


def test_padded_path_and_kernel_are_refused_and_a_pass_must_start_at_the_length(targets):
    target = targets["qwen3_5"]
    with pytest.raises(SpecPilotError, match="padded=False") as e:
        BatchEngine(target, SystemConfig.ar(), None, eos_ids=[], max_num_seqs=2, padded=True)
    assert "\n" not in str(e.value)
    eng = BatchEngine(target, SystemConfig.ar(), None, eos_ids=[], max_num_seqs=2)
    assert eng.runner is None and not eng.pool.padded_passes
    pool = eng.pool
    assert pool.cache(1).state.data_ptr() == pool.state[1].data_ptr()  # a slot's cache is a view of the pool
    rows = BatchRows([0, 1], [0, 0], [3, 2], [None, None])
    with pytest.raises(SpecPilotError, match="batched kernel"):
        target.forward_batch(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 1, 2, 0, 1]), pool, rows, kernel=True)
    target.forward_batch(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 1, 2, 0, 1]), pool, rows)
    pool.cache(0).commit(3)
    pool.cache(1).commit(2)
    check_slot(target, pool.cache(0), [1, 2, 3, 0])
    check_slot(target, pool.cache(1), [4, 5, 0])
    assert pool.state[2].abs().sum() == 0  # untouched slots stay zero
    with pytest.raises(ValueError, match="committed length 2"):
        target.forward_batch(torch.tensor([6]), torch.tensor([1]), pool, BatchRows([1], [1], [1], [None]))
    pool.cache(0).commit(0)
    assert pool.state[0].abs().sum() == 0 and pool.window[0].abs().sum() == 0


def test_replay_batch_equals_the_hybrid_engine(targets):
    """Exact replay of the batched engine (shared budget, prompt admission, drafter block) from a recording of a
    hybrid draft model's lattices along the AR outputs: step by step, each request's verified nodes, accepted and
    kept tokens equal the hybrid BatchEngine's."""
    from specpilot.pilot.replay import record
    from specpilot.pilot.replay_batch import replay_batch

    target = targets["qwen3_5"]
    rng = random.Random(6)
    reqs = [(p, n, frozenset()) for p, n, _ in random_requests(rng, 6)]
    outs = [ar_tokens(target, p, n) for p, n, _ in reqs]
    cfg = SystemConfig(drafter="draft_model", tree="best_first", nodes=4, depth=4, top_k=2, row_selection="shared_budget",
                       prompt_admission=24, drafter_block=(4, 2))
    net = near_copy(target, 2e-3)
    rec = record(DraftModelDrafter(net, 2, static=False), [p for p, _, _ in reqs], outs, 4, 2)
    steps = replay_batch(rec, cfg, 3, 2048)
    with verify_mode(target, "replay"):
        eng = BatchEngine(target, cfg, SlotFanout([DraftModelDrafter(net, 2, static=False) for _ in range(3)]),
                          eos_ids=[], max_num_seqs=3)
        for i, (p, n, _) in enumerate(reqs):
            eng.add_request(Request(f"r{i}", p, n))
        seen, per = set(), {i: [] for i in range(len(reqs))}
        while eng.has_work():
            for o in eng.step():
                if o.request_id in seen:  # a request's first output is its prefill's
                    per[int(o.request_id[1:])].append((o.drafted, o.accepted, len(o.new_tokens)))
                seen.add(o.request_id)
    got = {i: [] for i in range(len(reqs))}
    for s in steps:
        for i, n, a, k in zip(s.requests, s.nodes, s.accepted, s.kept):
            got[i].append((n, a, k))
    assert len(steps) == eng.exact_passes and got == per
    assert max(a for v in per.values() for _, a, _ in v) >= 2
