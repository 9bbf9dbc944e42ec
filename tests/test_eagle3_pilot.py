"""EAGLE-3 drafters in the pilot (``--eagle3``): recorded once per top-K, proposed by the planner with their
checkpoint, replayed exactly (τ equal to the live engine's), their drafting priced by depth. float32 CPU, the tiny
target; AR is the oracle."""

from __future__ import annotations

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.pilot.planner import EAGLE3_TOP_K, Planner
from specpilot.pilot.replay import record
from specpilot.spec.eagle3 import save_eagle3

from .conftest import random_prompts, run_cli
from .test_eagle3 import _trained

pytestmark = pytest.mark.usefixtures("one_thread")

DEPTH, NEW = 8, 24


@pytest.fixture(scope="module")
def eagle3_dir(tiny_models, tmp_path_factory):
    return save_eagle3(_trained(tiny_models[0])[0], tmp_path_factory.mktemp("e3") / "eagle3", dtype=torch.float32)


@pytest.fixture(scope="module")
def setup(tiny_dirs, eagle3_dir):
    """The deployment, its prompts and AR outputs, and a planner over the eagle3 recordings as the pilot keys them
    (``("eagle3:<dir>", K)`` for each K of :data:`EAGLE3_TOP_K`) beside an n-gram one."""
    dep = Deployment(tiny_dirs[0], eagle3_dirs=[eagle3_dir])
    prompts = random_prompts(3, length=12, seed=6)
    ar = [dep.system(SystemConfig.ar(), eos_ids=[]).generate(p, NEW).tokens for p in prompts]
    recs = {}
    for k in EAGLE3_TOP_K:
        drafter = dep.system(SystemConfig(drafter="eagle3", drafter_path=str(eagle3_dir), top_k=k, depth=DEPTH,
                                          nodes=DEPTH)).drafter
        recs[(f"eagle3:{eagle3_dir}", k)] = rec = record(drafter, prompts, ar, DEPTH, k, target=dep.target)
        rec.drafter_path = str(eagle3_dir)
    recs[("ngram", 1)] = record(dep.system(SystemConfig.stock("ngram")).drafter, prompts, ar, DEPTH, 1)
    return dep, prompts, ar, Planner(recs, {1: 1.0, 2: 1.05, 9: 1.2, 33: 1.5, 64: 2.0}, 1.2)


def test_planner_proposes_eagle3_with_its_checkpoint_and_recorded_top_k(setup, eagle3_dir):
    planner = setup[3]
    eagles = [c for c in planner.space(SystemConfig.stock("ngram"), "tree") if c.drafter == "eagle3"]
    assert eagles and all(c.drafter_path == str(eagle3_dir) and c.depth <= DEPTH for c in eagles)
    assert {c.top_k for c in eagles} == set(EAGLE3_TOP_K) and {c.tree for c in eagles} == {"chain", "best_first"}
    inc = next(c for c in eagles if c.tree == "best_first" and c.nodes == 12)
    outside = planner.space(inc, "outside")  # cheaper steps keep the checkpoint and its K
    assert any(c.drafter == "eagle3" and c.nodes < 12 for c in outside)
    assert all(c.drafter_path == str(eagle3_dir) and c.top_k == inc.top_k for c in outside if c.drafter == "eagle3")


@pytest.mark.parametrize("tree,nodes,depth,k", [("chain", 4, 4, 4), ("best_first", 12, 6, 8), ("best_first", 8, 3, 4)])
def test_replayed_tau_equals_the_live_engine(setup, eagle3_dir, tree, nodes, depth, k):
    dep, prompts, ar, planner = setup
    cfg = SystemConfig(drafter="eagle3", drafter_path=str(eagle3_dir), tree=tree, nodes=nodes, depth=depth, top_k=k)
    eng = dep.system(cfg, eos_ids=[])
    gens = [eng.generate(p, NEW) for p in prompts]
    assert [g.tokens for g in gens] == ar
    live = sum(sum(g.accepted) for g in gens) / sum(g.steps for g in gens)
    assert live > 1.2  # the trained drafter is accepted: the comparison is not AR against AR
    assert planner.predict(cfg).tau == pytest.approx(live)
    assert planner.predict(cfg.model_copy(update={"top_k": 2})) is None  # a K not recorded is not replayed
    assert planner.predict(cfg.model_copy(update={"drafter_path": "elsewhere"})) is None


def test_drafting_is_priced_by_depth(setup, eagle3_dir):
    """One drafter pass per depth level: the recording times one position too, and deeper drafts cost more."""
    planner = setup[3]
    assert all(rec.draft1_ms is not None and rec.draft1_ms < rec.draft_ms
               for (kind, _), rec in planner.recordings.items() if kind.startswith("eagle3:"))
    cfg = SystemConfig(drafter="eagle3", drafter_path=str(eagle3_dir), tree="chain", nodes=2, depth=2, top_k=4)
    assert planner.draft_time(cfg) < planner.draft_time(cfg.model_copy(update={"nodes": 8, "depth": 8}))


def test_pilot_learned_drafter_flags_refuse_wrong_paths_in_one_line(monkeypatch, capsys, tmp_path, eagle3_dir):
    """``--eagle3`` / ``--block`` given a drafter of the other kind, a missing path or a file: one line naming the
    flag (and the flag the drafter goes to), exit 2, before anything loads."""
    from specpilot.zoo import bundled_block_dir

    cases = [(("--eagle3", str(bundled_block_dir())), "give it with --block"),
             (("--block", str(eagle3_dir)), "give it with --eagle3"),
             (("--eagle3", str(tmp_path / "missing")), "no such directory"),
             (("--eagle3", str(eagle3_dir / "config.json")), "a file, not a drafter directory")]
    for args, want in cases:
        code, _, err = run_cli(monkeypatch, capsys, "pilot", *args, "--out", str(tmp_path / "r"))
        assert code == 2 and args[0] in err and want in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()


def test_report_curves_of_a_sealed_eagle3_system(setup, eagle3_dir):
    """The report's τ-vs-N curves of a sealed eagle3 system come from its checkpoint at its recorded K (they were all
    None: the curves asked for an eagle3 drafter without its directory)."""
    from types import SimpleNamespace

    from specpilot.pilot.seal import sealed_tau_curves

    pilot = SimpleNamespace(planner=setup[3], plan={"depth_max": DEPTH}, drafter_kind="ngram")
    sealed = SystemConfig(drafter="eagle3", drafter_path=str(eagle3_dir), tree="best_first", nodes=8, depth=4, top_k=4)
    curves = sealed_tau_curves(pilot, sealed)
    assert set(curves) == {"eagle3/chain", "eagle3/best_first", "eagle3/oracle"}
    assert all(v is not None and v >= 1 for name in curves for v in curves[name].values())
    assert curves["eagle3/best_first"][8] == setup[3].predict(sealed.model_copy(update={"depth": DEPTH})).tau
