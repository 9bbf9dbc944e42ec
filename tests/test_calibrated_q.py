"""Simulated Q-pass agreement for TLV with the calibrated drafter (§4.3 on a random-weight target): the calibration
stores the real pair's Q-view agreement (round trip; files without it still load and simulate nothing); the engine
keeps running the real Q pass but answers rows on the known path from seeded draws; spec == AR whatever the draws
(chains rejected at every position included); the live engine's TLV τ equals the pilot's replay of the simulated
chains, and the pilot's pricing (``tlv_inputs`` → planner) says the agreement is SIMULATED. float32 CPU, AR the
oracle; the draws are seeded, so nothing here can flake."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest

from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.engine.engine import Engine
from specpilot.engine.tlv import QPass
from specpilot.model.qview import q_view
from specpilot.pilot.replay import Recording, record
from specpilot.pilot.replay_tlv import QRecording, record_q, replay_tlv, replay_tlv_steps
from specpilot.spec.calibrated import CalibratedDrafter
from specpilot.spec.calibrated_q import QSimulation, SimulatedQPass, measure_q_agreement, simulated_chains
from specpilot.spec.calibration import CalibrationError, load_calibration, save_calibration
from specpilot.spec.cost_drafter import cost_drafter

from .conftest import random_prompts
from .test_calibrated import real  # noqa: F401  (the bundled pair's calibration, a module fixture)
from .test_engine import ar_tokens, cache_matches_prefill

pytestmark = pytest.mark.usefixtures("one_thread")
D, K, V, T = 8, 8, 64, 36


def with_q(cal, p: float | list[float], weights="view8"):
    """``cal`` with a Q agreement of probability ``p`` per chain row (1000 rows reached at each)."""
    cal = copy.deepcopy(cal)
    ps = p if isinstance(p, list) else [p] * (cal.depth + 1)
    cal.q_agreement = {"weights": weights, "reached": [1000] * (cal.depth + 1), "hits": [round(1000 * x) for x in ps]}
    return cal


def drafter(cal, prompts, ar, top_k, cost=None):
    d = CalibratedDrafter(cal, V, top_k=top_k, cost=cost, max_slots=1)
    for p, a in zip(prompts, ar):
        d.expect(p, a)
    return d


def cfg_of(tree, path="-"):
    return SystemConfig(drafter="calibrated", drafter_path=str(path), tree=tree, nodes=6 if tree == "chain" else 12,
                        depth=6, top_k=1 if tree == "chain" else 4, tlv=True)


def test_measured_agreement_counts_match_replay_tlv(tiny_models):
    """The stored counts are QRecording.agreement's root figure, conditioned along the chain."""
    target = tiny_models[0]
    prompts = random_prompts(3, V, length=10, seed=21)
    ar = [ar_tokens(target, p, 24) for p in prompts]
    rec = Recording(prompts, ar)
    qrec = record_q(target, q_view(target), rec, D)
    qa = measure_q_agreement(ar, qrec.chains, D, "view8")
    agree = qrec.agreement(rec)
    assert qa["reached"][0] == agree["positions"] == sum(len(a) - 1 for a in ar)
    assert qa["hits"][0] / qa["reached"][0] == pytest.approx(agree["root"])
    assert all(h <= n for h, n in zip(qa["hits"], qa["reached"]))
    assert all(n1 <= h0 for h0, n1 in zip(qa["hits"], qa["reached"][1:]))  # row j+1 reached only after j agreed


def test_calibration_round_trips_q_agreement_and_old_files_load(real, tmp_path):  # noqa: F811
    cal = with_q(real[1], 0.9)
    back = load_calibration(save_calibration(cal, tmp_path / "q.json"))
    assert back == cal and back.q_agreement == cal.q_agreement
    old = load_calibration(save_calibration(real[1], tmp_path / "old.json"))  # written without the field
    assert old.q_agreement is None and "q_agreement" not in json.loads((tmp_path / "old.json").read_text())
    for bad in ({"weights": "int4", "reached": [1] * (D + 1), "hits": [1] * (D + 1)},
                {"weights": "view8", "reached": [1] * D, "hits": [1] * D},
                {"weights": "view8", "reached": [1] * (D + 1), "hits": [2] * (D + 1)}):
        d = cal.to_dict()
        d["q_agreement"] = bad
        (tmp_path / "bad.json").write_text(json.dumps(d))
        with pytest.raises(CalibrationError, match="q_agreement must be"):
            load_calibration(tmp_path / "bad.json")


def test_q_pass_simulated_only_with_a_matching_calibration(tiny_models, real):  # noqa: F811
    target, small = tiny_models
    p = random_prompts(1, V, seed=1)
    kinds = []
    for cal, weights in ((with_q(real[1], 0.9), "view8"), (real[1], "view8"), (with_q(real[1], 0.9), "int8")):
        cfg = cfg_of("best_first").model_copy(update={"q_weights": weights})
        kinds.append(type(Engine(target, cfg, drafter(cal, p, [[1, 2]], 4), eos_ids=[]).tlv))
    from specpilot.spec.draft_model import DraftModelDrafter

    real_drafter = Engine(target, cfg_of("best_first").model_copy(update={"drafter": "draft_model"}),
                          DraftModelDrafter(small, top_k=4), eos_ids=[])
    assert kinds == [SimulatedQPass, QPass, QPass] and type(real_drafter.tlv) is QPass


@pytest.mark.parametrize("tree", ["chain", "best_first"])
@pytest.mark.parametrize("p", [0.0, 0.7, 1.0])
def test_spec_equals_ar_with_simulated_q(tiny_models, real, tree, p):  # noqa: F811
    """Lossless with chains the exact pass rejects at every position (p = 0: every chain wrong at its first token;
    p = 0.7: wrong at later positions too), with a feature-reading cost network (block) and an unknown prompt."""
    target = tiny_models[0]
    cfg = cfg_of(tree)
    prompts = random_prompts(4, V, length=10, seed=31)
    ar = [ar_tokens(target, q, 40) for q in prompts]
    cost = cost_drafter({"kind": "block", "layers": 1, "block_size": 8}, target, cfg.top_k, 1) if p == 0.7 else None
    eng = Engine(target, cfg, drafter(with_q(real[1], p), prompts[:3], ar[:3], cfg.top_k, cost), eos_ids=[])
    eng.step_hook = cache_matches_prefill
    gens = [eng.generate(q, 40) for q in prompts]
    assert [g.tokens for g in gens] == ar
    c = eng.tlv.counts
    assert c["rows"] > 0 and c["agreed"] == (0 if p == 0.0 else c["rows"] if p == 1.0 else c["agreed"])
    chained = [(a, ch) for g in gens[:3] for a, ch in zip(g.accepted, g.chains) if ch > 0]
    assert chained
    if p == 0.0:  # every chain wrong at its first token: the exact pass keeps only its own bonus
        assert all(a == 1 for a, _ in chained)
    if p == 0.7:  # chains rejected after some right tokens, and chains accepted whole
        assert any(1 < a <= ch for a, ch in chained) and any(a > ch for a, ch in chained)


@pytest.mark.parametrize("tree,nodes,depth,k", [("chain", 6, 6, 1), ("best_first", 12, 6, 4),
                                                 ("best_first", 20, 8, 8)])
def test_live_tlv_tau_equals_replay_of_the_simulated_chains(tiny_models, real, tree, nodes, depth, k):  # noqa: F811
    target = tiny_models[0]
    cal = with_q(real[1], [0.9, 0.8, 0.85, 0.7, 0.9, 0.6, 0.8, 0.9, 0.9])
    prompts = random_prompts(3, V, length=12, seed=8)
    ar = [ar_tokens(target, q, T) for q in prompts]
    cfg = SystemConfig(drafter="calibrated", drafter_path="-", tree=tree, nodes=nodes, depth=depth, top_k=k, tlv=True)
    rec = record(drafter(cal, prompts, ar, K), prompts, ar, D, K)
    qrec = QRecording(simulated_chains(prompts, ar, QSimulation(cal.q_agreement, V, 0), D), D)
    eng = Engine(target, cfg, drafter(cal, prompts, ar, k), eos_ids=[])
    gens = [eng.generate(q, T) for q in prompts]
    assert [g.tokens for g in gens] == ar
    steps = replay_tlv_steps(rec, qrec, cfg)
    assert [s[0] for s in steps] == [a for g in gens for a in g.accepted]  # cycle by cycle
    live = sum(sum(g.accepted) for g in gens) / sum(g.steps for g in gens)
    assert replay_tlv(rec, qrec, cfg)["tau"] == pytest.approx(live)
    agree = qrec.agreement(rec)["root"]
    assert 0.8 < agree < 1.0 and any(s[0] <= s[3] for s in steps)  # some chains were rejected


def test_real_q_pass_still_runs(tiny_models, real):  # noqa: F811
    target = tiny_models[0]
    seen = []

    class Prof:
        def region(self, name):
            class Ctx:
                def __enter__(self):
                    seen.append(name)

                def __exit__(self, *exc):
                    pass
            return Ctx()

    prompts = random_prompts(2, V, seed=5)
    ar = [ar_tokens(target, q, 30) for q in prompts]
    eng = Engine(target, cfg_of("best_first"), drafter(with_q(real[1], 0.8), prompts, ar, 4), eos_ids=[])
    real_run, calls = eng.tlv.real.run, []
    eng.tlv.real.run = lambda *a, **kw: calls.append(1) or real_run(*a, **kw)
    gens = [eng.generate(q, 30, prof=Prof()) for q in prompts]
    cycles = sum(1 for g in gens for ch in g.chains if ch > 0)
    assert len(calls) == seen.count("q_pass") == eng.tlv.counts["passes"] >= cycles > 0


def test_pilot_prices_simulated_tlv_as_the_live_engine_runs_it(tiny_dirs, tiny_models, real, tmp_path):  # noqa: F811
    """tlv_inputs of a calibrated deployment: SIMULATED chains (said), the planner's τ of a calibrated TLV config
    equals the live engine's on the recorded prompts; a real drafter's TLV is still priced with the real Q view."""
    from specpilot.pilot.costinputs import record_calibrated, tlv_inputs
    from specpilot.pilot.planner import Planner

    cal = with_q(real[1], [0.9, 0.8, 0.85, 0.7, 0.9, 0.6, 0.8, 0.9, 0.9])
    cal.cost = None
    path = save_calibration(cal, tmp_path / "cal.json")
    dep = Deployment(tiny_dirs[0])
    prompts = random_prompts(3, V, length=10, seed=41)
    ar = [ar_tokens(tiny_models[0], q, 30) for q in prompts]
    key, rec = record_calibrated(dep, path, prompts, ar, [30] * 3)
    said = []
    pilot = SimpleNamespace(dep=dep, o=SimpleNamespace(calibration=path), say=lambda phase, msg: said.append(msg))
    tlv = tlv_inputs(pilot, {key: rec}, D, False)
    assert tlv.simulated is not None and tlv.simulated_path == str(path) and any("SIMULATED" in s for s in said)
    assert tlv.simulated_agreement["root"] != tlv.agreement["root"]
    cfg = SystemConfig(drafter="calibrated", drafter_path=str(path), tree="best_first", nodes=12, depth=6, top_k=4,
                       tlv=True)
    assert tlv.qrec_for(cfg) is tlv.simulated and tlv.qrec_for(cfg.model_copy(update={"drafter_path": "x"})) is tlv.qrec
    planner = Planner({key: rec}, {1: 1.0, 8: 1.1, 16: 1.2}, 1.2, tlv=tlv)
    eng = dep.system(cfg, eos_ids=[])
    assert isinstance(eng.tlv, SimulatedQPass)
    gens = [eng.generate(q, 30) for q in prompts]
    assert [g.tokens for g in gens] == ar
    live = sum(sum(g.accepted) for g in gens) / sum(g.steps for g in gens)
    assert planner.predict(cfg).tau == pytest.approx(live) and live > planner.predict(
        cfg.model_copy(update={"tlv": False})).tau
    from specpilot.pilot.state import Pilot

    o = SimpleNamespace(target="T", drafter=None, device="cpu", dtype="float32", calibration=path, prompts=None)
    assert "TLV Q-pass agreement are SIMULATED" in Pilot.deployment(SimpleNamespace(o=o))["calibration"]
    o.calibration = save_calibration(real[1], tmp_path / "old.json")  # no Q agreement: acceptance alone
    assert Pilot.deployment(SimpleNamespace(o=o))["calibration"].endswith("acceptance is SIMULATED)")
