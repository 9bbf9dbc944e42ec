"""The calibrated drafter in the batched engine: it follows the batched engine's own AR continuations (asked for a
whole batch run at once), and a batch of one request runs a block drafter's static step. float32 CPU; AR is the
oracle."""

from __future__ import annotations

import copy

import pytest

from specpilot.config import SystemConfig
from specpilot.engine.batch import BatchEngine
from specpilot.engine.deployment import Deployment
from specpilot.pilot.batch_runs import timed_batch
from specpilot.spec.block import BlockDrafter
from specpilot.spec.calibrated import CalibratedDrafter, Continuations
from specpilot.spec.calibration import save_calibration

from .blockutil import trained_pair
from .conftest import random_prompts
from .test_calibrated import real  # noqa: F401  (the bundled pair's calibration, a module fixture)
from .test_engine import ar_tokens

pytestmark = pytest.mark.usefixtures("one_thread")


def test_ensure_all_asks_the_batch_oracle_once_for_the_unknown_prompts():
    calls = []

    def batch(prompts, n):
        calls.append([list(p) for p in prompts])
        return [[p[-1] + 1 + i for i in range(n)] for p in prompts]

    c = Continuations(batch_oracle=batch)
    c.add([1, 2], [3, 4, 5, 6])
    assert c.ensure_all([[1, 2], [7], [7], [8, 9]], 3) == [True] * 4
    assert calls == [[[7], [8, 9]]]  # known and repeated prompts not asked
    assert c.find([8, 9, 10]) == (2, [8, 9, 10, 11, 12])
    assert c.ensure_all([[7], [8, 9]], 2) == [True, True] and len(calls) == 1  # now known
    assert c.ensure_all([[1, 2]], 6) == [True] and calls[-1] == [[1, 2]]  # known, but too short: asked again

    single = []
    c = Continuations(oracle=lambda p, n: single.append(list(p)) or [0] * n)
    assert c.ensure_all([[5], [6]], 2) == [True, True] and single == [[5], [6]]
    bare = Continuations()
    bare.add([5], [1, 2])
    assert bare.ensure_all([[5], [6]], 2) == [True, False] and bare.ensure([6], 1) is False


@pytest.mark.parametrize("tree", ["chain", "best_first"])
def test_batched_calibrated_drafter_learns_the_batched_ar(tiny_dirs, tiny_models, real, tmp_path, tree):  # noqa: F811
    """Before a timed batch run the drafter learns every prompt's continuation from the batched engine's AR, one
    oracle run for the batch; the run then proposes for every request (none unknown) and equals AR."""
    cal = copy.deepcopy(real[1])
    cal.cost = {"kind": "ngram"}
    path = save_calibration(cal, tmp_path / "cal.json")
    dep = Deployment(tiny_dirs[0])
    asked = []
    oracle = dep.batch_continuations.batch_oracle
    dep.batch_continuations.batch_oracle = lambda ps, n: asked.append(len(ps)) or oracle(ps, n)
    cfg = SystemConfig(drafter="calibrated", drafter_path=str(path), tree=tree, nodes=4 if tree == "chain" else 10,
                       depth=4 if tree == "chain" else 6, top_k=1 if tree == "chain" else 3)
    eng = dep.batch_system(cfg, max_num_seqs=3, eos_ids=[])
    assert isinstance(eng.drafter, CalibratedDrafter) and eng.drafter.continuations is dep.batch_continuations
    prompts = random_prompts(5, length=9, seed=31)
    tokens, _, _ = timed_batch(eng, prompts, 24)
    assert asked == [5]
    assert [list(t) for t in tokens] == [ar_tokens(dep.target, p, 24) for p in prompts]
    c = eng.drafter.counts
    assert c["unknown"] == 0 and c["proposed"] > 0, c
    assert dep.system(cfg).drafter.continuations is dep.continuations  # the single-request engine keeps its own


@pytest.mark.parametrize("tree", ["chain", "best_first"])
def test_one_slot_batch_with_a_static_block_step_equals_ar(tiny_models, tree):
    """A batched engine of one slot with a block drafter's static step (what a GPU batch of one builds; run
    eagerly here): spec == AR, drafts accepted."""
    target = tiny_models[0]
    net = trained_pair(target)["block"][0]
    cfg = SystemConfig(drafter="block", tree=tree, nodes=12 if tree == "best_first" else 6, depth=6,
                       top_k=16 if tree == "best_first" else 1)
    eng = BatchEngine(target, cfg, BlockDrafter(net, target, static_step=True), max_num_seqs=1, eos_ids=[])
    prompts = random_prompts(3, length=10, seed=23)
    gens = eng.generate_all(prompts, 30)
    assert [g.tokens for g in gens] == [ar_tokens(target, p, 30) for p in prompts]
    assert max(a for g in gens for a in g.accepted) > 1
