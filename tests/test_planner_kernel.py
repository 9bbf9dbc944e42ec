"""The planner's kernel direction (§3.2, §4.1): W12 and the certified INT8 head toggled on the incumbent on
CUDA with a bf16 target; elsewhere no candidates and a reason."""

from __future__ import annotations

from specpilot.config import SystemConfig
from specpilot.spec.ngram import NgramDrafter
from specpilot.pilot.planner import Planner
from specpilot.pilot.replay import record


def planner(device):
    prompts = [[1, 2, 3, 4, 1, 2], [5, 6, 7, 5, 6]]
    ar = [[3, 4, 1, 2, 3, 4], [7, 5, 6, 7, 5]]
    rec = record(NgramDrafter(4, 1, max_matches=1), prompts, ar, 6, 1)
    return Planner({("ngram", 1): rec}, {1: 1.0, 8: 1.1, 64: 1.5}, 1.2, device=device)


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
    cpu = planner("cpu")
    assert cpu.space(bf16, "kernel") == [] and cpu.propose(bf16, "kernel", set(), 3) == []
    assert "GPU kernels" in cpu.kernel_why_not(bf16) and "cpu" in cpu.kernel_why_not(bf16)
    f32 = SystemConfig.stock("ngram")
    cuda = planner("cuda")
    assert cuda.space(f32, "kernel") == [] and "bf16 target" in cuda.kernel_why_not(f32)


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
