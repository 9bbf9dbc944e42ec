"""The calibrated drafter inside the pilot: the controller salts every timed prompt afresh, so a simulated drafter
can only know the target's greedy continuation if it learns it before the clock starts (``Engine.prepare``, the
deployment's AR run as oracle). Checked: prepare makes an unseen prompt draftable and changes nothing for a real
drafter; a paired run of AR vs a calibrated system drafts on salted prompts with outputs equal to AR; the planner
proposes calibrated candidates with their calibration file; ``--calibration`` with ``--agent`` is refused.
float32 CPU; AR is the oracle."""

from __future__ import annotations

import copy
import random

import pytest

from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.pilot.paired import Req, paired_run
from specpilot.pilot.planner import Planner
from specpilot.pilot.replay import record
from specpilot.spec.calibrated import CalibratedDrafter
from specpilot.spec.calibration import save_calibration

from .test_calibrated import real  # noqa: F401  (the bundled pair's calibration, a module fixture)
from .test_engine import ar_tokens

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def cal_path(real, tmp_path_factory):  # noqa: F811
    cal = copy.deepcopy(real[1])
    cal.cost = None  # acceptance only: these tests time nothing
    return save_calibration(cal, tmp_path_factory.mktemp("cal") / "cal.json")


def calibrated(path, tree="best_first"):
    return SystemConfig(drafter="calibrated", drafter_path=str(path), tree=tree, nodes=10 if tree != "chain" else 6,
                        depth=6, top_k=4 if tree != "chain" else 1)


def test_prepare_learns_an_unseen_prompt_and_only_for_a_simulated_drafter(tiny_dirs, tiny_models, cal_path):
    dep = Deployment(tiny_dirs[0])
    eng = dep.system(calibrated(cal_path), eos_ids=[])
    p = [5, 9, 2, 33, 7, 1, 60, 12]
    cold = eng.generate(p, 30)
    assert cold.tau == 1.0 and eng.drafter.counts["unknown"] > 0  # nothing known: no proposals, still AR
    eng.prepare(p, 30)
    assert len(dep.continuations) == 1
    warm = eng.generate(p, 30)
    assert warm.tokens == cold.tokens == ar_tokens(tiny_models[0], p, 30) and warm.tau > 1.5
    eng.prepare(p, 30)  # known already: the oracle is not asked again
    assert len(dep.continuations) == 1
    ngram = dep.system(SystemConfig.stock("ngram"), eos_ids=[])
    ngram.prepare([1, 2, 3, 4], 20)
    assert len(dep.continuations) == 1  # a real drafter's prepare does nothing


def test_paired_run_drafts_on_salted_prompts(tiny_dirs, cal_path):
    dep = Deployment(tiny_dirs[0])
    systems = {}

    def make(name, cfg):
        def build():
            systems[name] = dep.system(cfg, eos_ids=[])
            return systems[name]
        return build

    rng = random.Random(3)
    reqs = [Req(b, i, tuple(rng.randrange(64) for _ in range(10)), 24) for b in ("x", "y") for i in range(2)]
    run = paired_run(make("ar", SystemConfig.ar()), make("cal", calibrated(cal_path)), reqs, 64, rng=rng)
    assert not run.outputs_differ and run.outputs_a == run.outputs_b
    counts = systems["cal"].drafter.counts
    assert counts["proposed"] > 10 and counts["unknown"] == 0, counts  # every salted prompt was known in time
    assert len(dep.continuations) >= 2 * len(reqs)  # each fresh variant's continuation came from the oracle


def test_planner_proposes_calibrated_candidates_with_their_file(tiny_models, real, cal_path):  # noqa: F811
    target = tiny_models[0]
    prompts = [[3, 8, 1, 9, 4, 4, 2], [7, 7, 1, 30, 2, 5]]
    ar = [ar_tokens(target, p, 24) for p in prompts]
    drafter = CalibratedDrafter(real[1], 64, top_k=8)
    for p, a in zip(prompts, ar):
        drafter.expect(p, a)
    rec = record(drafter, prompts, ar, 8, 8)
    rec.drafter_path = str(cal_path)
    p = Planner({("calibrated", 8): rec}, {1: 1.0, 8: 1.1, 64: 1.5}, 1.2)
    props = p.propose(SystemConfig.ar(), "tree", set(), k=3)
    assert props and all(c.drafter == "calibrated" and c.drafter_path == str(cal_path) for c, _ in props)
    assert all(pred.tau > 1 for _, pred in props)


def test_calibration_with_an_agent_is_refused(tmp_path, cal_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "specpilot", "pilot", "--calibration", str(cal_path), "--agent",
                           "run {worktree}", "--out", str(tmp_path / "r")], cwd=tmp_path, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)
    assert proc.returncode == 2 and "--calibration and --agent" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "r").exists()


def test_calibrate_command_writes_a_usable_calibration(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from specpilot.spec.calibration import load_calibration

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "specpilot", "calibrate", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    proc = cli("--out", str(tmp_path / "c.json"), "--per-benchmark", "1", "--max-new-tokens", "12", "--depth", "4",
               "--top-k", "4")
    assert proc.returncode == 0, proc.stderr
    cal = load_calibration(tmp_path / "c.json")
    assert (cal.depth, cal.top_k) == (4, 4) and cal.cost["kind"] == "draft_model"
    qa = cal.q_agreement  # the pair's Q-view agreement along the same outputs (TLV's simulated Q pass)
    assert qa["weights"] == "view8" and len(qa["reached"]) == 5 and qa["reached"][0] == 4 * 11
    assert "Q agreement" in proc.stdout
    bad = cli("--drafter", "eagle3", "--out", str(tmp_path / "e.json"))
    assert bad.returncode == 2 and "calibrate one of" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "e.json").exists()


@pytest.mark.parametrize("cost", [None, {"kind": "block", "layers": 1, "block_size": 8}])
def test_the_pilot_records_a_calibrated_drafter_of_any_cost(tiny_dirs, tiny_models, real, tmp_path, cost):  # noqa: F811
    """The pilot's cost model records the calibrated drafter along Phase 0's AR outputs; with a block network's cost
    (a calibration of a block drafter, `specpilot calibrate --drafter block`) the recording needs the target, whose
    hidden states that network reads (a first version passed none and the documented command crashed)."""
    from specpilot.pilot.costinputs import record_calibrated

    cal = copy.deepcopy(real[1])
    cal.cost = cost
    path = save_calibration(cal, tmp_path / "cal.json")
    dep = Deployment(tiny_dirs[0])
    prompts = [[3, 8, 1, 9, 4, 4, 2], [7, 7, 1, 30, 2, 5]]
    ar = [ar_tokens(tiny_models[0], p, 20) for p in prompts]
    key, rec = record_calibrated(dep, path, prompts, ar, [20, 20])
    assert key == ("calibrated", cal.top_k) and rec.drafter_path == str(path)
    cfg = SystemConfig(drafter="calibrated", drafter_path=str(path), tree="best_first", nodes=8, depth=6, top_k=4)
    assert Planner({key: rec}, {1: 1.0, 8: 1.1}, 1.2).predict(cfg).tau > 1.5


def test_bench_batch_with_the_calibrated_drafter(monkeypatch, capsys, tmp_path, cal_path):
    """`specpilot bench --batch --drafter calibrated --drafter-path FILE`: the drafter is told AR's outputs of the
    bench's prompts, drafts in every batch (counts recorded), outputs stay AR's, the JSON says it is a simulation."""
    import json

    import torch

    from specpilot.zoo import bundled_target_dir

    from .conftest import run_cli

    n = torch.get_num_threads()
    try:
        code, out, err = run_cli(monkeypatch, capsys, "bench", "--target", str(bundled_target_dir()), "--batch", "1,2",
                                 "--device", "cpu", "--dtype", "float32", "--prefix", "16", "--new-tokens", "12",
                                 "--drafter", "calibrated", "--drafter-path", str(cal_path), "--tree", "best_first",
                                 "--nodes", "8", "--depth", "4", "--top-k", "4", "--out", str(tmp_path))
    finally:
        torch.set_num_threads(n)
    assert code == 0, err
    (path,) = tmp_path.glob("batch_bench_*.json")
    res = json.loads(path.read_text())
    assert "SIMULATED" in res["simulated"].upper() and "simulat" in out.lower()
    for b in (1, 2):
        r = res["runs"][f"spec@{b}"]
        assert r["outputs_equal_batch1"] == 1.0 and r["drafter_counts"]["proposed"] > 0, r["drafter_counts"]
    code, _, err = run_cli(monkeypatch, capsys, "bench", "--target", str(bundled_target_dir()), "--batch", "1",
                           "--drafter", "calibrated", "--device", "cpu")
    assert code == 2 and "needs --drafter-path" in err
