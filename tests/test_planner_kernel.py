"""The planner's kernel direction (§3.2, §4.1): W12 and the certified INT8 head toggled on the incumbent on
CUDA with a bf16 target, the certified head on the CPU with a float32 one; elsewhere no candidates and a reason."""

from __future__ import annotations

from specpilot.config import SystemConfig
from specpilot.spec.ngram import NgramDrafter
from specpilot.pilot.planner import Planner
from specpilot.pilot.replay import record, replay_steps


def planner(device, cpu_head=False):
    prompts = [[1, 2, 3, 4, 1, 2], [5, 6, 7, 5, 6]]
    ar = [[3, 4, 1, 2, 3, 4], [7, 5, 6, 7, 5]]
    rec = record(NgramDrafter(4, 1, max_matches=1), prompts, ar, 6, 1)
    return Planner({("ngram", 1): rec}, {1: 1.0, 8: 1.1, 64: 1.5}, 1.2, device=device, cpu_head=cpu_head)


def test_kernel_direction_on_cuda_bf16():
    p = planner("cuda:0")
    stock = SystemConfig.stock("ngram", dtype="bfloat16")
    assert p.kernel_why_not(stock) is None
    space = p.space(stock, "kernel")
    assert [c.delta(stock) for c in space] == [{"w12": True}, {"lm_head_int8": True}]
    inc = stock.apply({"w12": True})
    assert [c.delta(inc) for c in p.space(inc, "kernel")] == [{"w12": False}, {"lm_head_int8": True}]
    props = p.propose(stock, "kernel", {stock.seal()}, k=3)
    assert {c.label() for c, _ in props} == {stock.label() + " +w12", stock.label() + " +int8head"}
    base = p.predict(stock)
    assert all(pred.tau == base.tau and pred.c == base.c for _, pred in props)  # τ and modelled c unchanged


def test_kernel_direction_elsewhere_says_why():
    bf16 = SystemConfig.stock("ngram", dtype="bfloat16")
    cpu = planner("cpu", cpu_head=True)
    assert cpu.space(bf16, "kernel") == [] and cpu.propose(bf16, "kernel", set(), 3) == []
    assert "float32 target" in cpu.kernel_why_not(bf16)
    f32 = SystemConfig.stock("ngram")
    cuda = planner("cuda")
    assert cuda.space(f32, "kernel") == [] and "bf16 target" in cuda.kernel_why_not(f32)


def test_kernel_direction_on_the_cpu_is_the_certified_head_where_it_pays():
    """On the CPU a float32 target's certified head has a fast path (its bf16 first pass) where the head is large
    enough (``cpu_head``, :func:`specpilot.head.cpu.worth`: SmolLM2's, not the bundled target's); W12 has none."""
    import torch

    from specpilot.head.cpu import MIN_HEAD_WEIGHTS, applies, worth
    from specpilot.zoo import bundled_target_dir

    f32 = SystemConfig.stock("ngram")
    small = planner("cpu")
    assert small.space(f32, "kernel") == [] and "2^24 weights" in small.kernel_why_not(f32)
    cpu = planner("cpu", cpu_head=True)
    assert cpu.kernel_why_not(f32) is None
    assert [c.delta(f32) for c in cpu.space(f32, "kernel")] == [{"lm_head_int8": True}]
    big = torch.ones(1, 1).expand(49152, 576)  # SmolLM2's head shape, no memory
    assert worth(big) == applies(big) and big.numel() >= MIN_HEAD_WEIGHTS
    from specpilot.model.checkpoint import load_model

    assert not worth(load_model(bundled_target_dir()).lm_head.weight)  # 4096 x 256: the pass cannot pay there


def test_kernel_direction_on_an_ar_incumbent():
    """Round 0 often approves AR (stock loses to it): the kernel toggles of AR must still be proposed (AR was
    not replayable, so every toggle was dropped and the H200 8B pilot never judged W12). AR is τ = 1, c = 1."""
    p = planner("cuda:0")
    ar = SystemConfig.ar(dtype="bfloat16")
    pred = p.predict(ar)
    assert (pred.tau, pred.c, pred.speedup) == (1.0, 1.0, 1.0)
    props = p.propose(ar, "kernel", {ar.seal()}, k=3)
    assert sorted(c.label() for c, _ in props) == sorted([ar.label() + " +w12", ar.label() + " +int8head"])


def test_tree_direction_has_no_equivalent_duplicates():
    """A best-first tree of N nodes is at most N deep, so (N, D > N) is the system (N, N): the planner must not
    propose both (otherwise N=4 with D=4, 8 and 10 are judged as three candidates)."""
    p = planner("cpu")
    stock = SystemConfig.stock("ngram")
    space = [c for c in p.space(stock, "tree") if c.tree == "best_first"]
    assert space and all(c.depth <= c.nodes for c in space)
    keys = [(c.drafter, c.nodes, c.top_k, c.depth) for c in space]
    assert len(keys) == len(set(keys))


def test_w12_priced_by_rows_when_its_pass_was_measured():
    """W12 wins at one row and can lose at tree sizes (its exact pass at 33 rows measured 1.18x bf16's on the
    H200): with the W12 pass timed by rows, a +w12 candidate is priced at its own rows, so AR + w12 gains and a
    tree + w12 can lose, and the planner's kernel toggle says which."""
    prompts = [[1, 2, 3, 4, 1, 2], [5, 6, 7, 5, 6]]
    ar = [[3, 4, 1, 2, 3, 4], [7, 5, 6, 7, 5]]
    rec = record(NgramDrafter(4, 1, max_matches=1), prompts, ar, 6, 1)
    bf16 = {1: 1.0, 8: 1.1, 64: 1.5}
    p = Planner({("ngram", 1): rec}, bf16, 1.2, device="cuda", w12_verify_ms={1: 0.8, 8: 1.2, 64: 2.4})
    plain = Planner({("ngram", 1): rec}, bf16, 1.2, device="cuda")
    assert p.w12_factor(1) == 0.8 and abs(p.w12_factor(64) - 1.6) < 1e-12 and plain.w12_factor(64) == 1.0
    ar_w12 = p.predict(SystemConfig.ar(dtype="bfloat16").apply({"w12": True}))
    assert ar_w12.c == 0.8 and ar_w12.speedup == 1 / 0.8
    stock = SystemConfig.stock("ngram", dtype="bfloat16")
    base, w12 = p.predict(stock), p.predict(stock.apply({"w12": True}))
    assert plain.predict(stock.apply({"w12": True})).c == plain.predict(stock).c  # unmeasured: priced as bf16
    assert w12.tau == base.tau
    rows = [r for _, r in replay_steps(rec, stock)]
    assert max(rows) > 1  # the chain verifies several rows, where this W12 pass is the slower
    extra = sum(p.verify_time(r, w12=True) - p.verify_time(r) for r in rows) / len(rows)
    assert abs((w12.c - base.c) * 1.2 - extra) < 1e-9  # exactly the pass-time difference at the replayed rows


def test_best_first_budgets_beyond_the_lattice_are_one_system():
    """best_first N=12 D=4 k=1 is a chain of at most 4 nodes: the planner proposes it as N=4 (once), not as a
    different candidate for every N above what a depth-D, top-K lattice holds; TLV's two drafts hold more."""
    from specpilot.pilot.planner import _canonical

    assert _canonical(SystemConfig(drafter="ngram", tree="best_first", nodes=12, depth=4, top_k=1)).nodes == 4
    assert _canonical(SystemConfig(drafter="ngram", tree="best_first", nodes=12, depth=2, top_k=2)).nodes == 6
    tlv = SystemConfig(drafter="ngram", tree="best_first", nodes=12, depth=4, top_k=1, tlv=True)
    assert _canonical(tlv) == tlv
    p = planner("cpu")
    for direction in ("tree", "outside"):
        space = p.space(SystemConfig(drafter="ngram", tree="best_first", nodes=16, depth=6, top_k=2), direction)
        plain = [c for c in space if c.tree == "best_first" and not c.tlv]
        assert plain and len({_canonical(c) for c in plain}) == len(plain)  # no two of them are one system
        assert len({c.seal() for c in space}) == len(space)
