"""The procedure with real engines: token forcing of a planted defect, exact replay, and the whole pilot on
the bundled models with a tiny plan (controller decisions on real engines: tests/test_adversarial.py)."""

from __future__ import annotations

import json

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.pilot.forcing import Scorer, audit, forcing_verdict
from specpilot.pilot.replay import record, replay
from specpilot.pilot.setup import build_requests
from specpilot.zoo import bundled_drafter_dir, bundled_target_dir


@pytest.fixture(scope="module")
def dep():
    return Deployment(bundled_target_dir(), bundled_drafter_dir())


@pytest.fixture(scope="module")
def reqs(dep):
    return build_requests(dep, per_benchmark=2, max_new_tokens=32)


def test_token_forcing_passes_stock_and_rejects_planted_bias(dep, reqs):
    scorer = Scorer(dep.target)
    stock = dep.system(SystemConfig.stock("ngram"))
    stock_out = [(r.prompt_ids, stock.generate(list(r.prompt_ids), r.max_new_tokens).tokens, r.benchmark) for r in reqs]
    stock_stats = audit(scorer, stock_out, 0.125)
    assert stock_stats.mismatch_rate == 0.0  # float32 on the CPU: stock is exactly the scorer's argmax
    best = dep.system(SystemConfig(drafter="ngram", tree="best_first", nodes=16, depth=8, top_k=4))
    out = [(r.prompt_ids, best.generate(list(r.prompt_ids), r.max_new_tokens).tokens, r.benchmark) for r in reqs]
    assert forcing_verdict(audit(scorer, out, 0.125), stock_stats)[0]
    bias = torch.zeros(dep.target.args.vocab_size)
    bias[torch.arange(0, dep.target.args.vocab_size, 7)] = 1.5  # a small bias on every 7th token id
    defect = dep.system(SystemConfig.stock("ngram"), logits_hook=lambda logits: logits + bias)
    bad = [(r.prompt_ids, defect.generate(list(r.prompt_ids), r.max_new_tokens).tokens, r.benchmark) for r in reqs]
    stats = audit(scorer, bad, 0.125)
    passed, reasons = forcing_verdict(stats, stock_stats)
    assert not passed and stats.mismatches > 0, reasons
    # the controller's side (it is rejected even when faster) is in tests/test_adversarial.py


@pytest.mark.parametrize("cfg", [
    SystemConfig.stock("ngram"),
    SystemConfig(drafter="ngram", tree="best_first", nodes=12, depth=6, top_k=4),
    SystemConfig.stock("draft_model", depth=4),
    SystemConfig(drafter="draft_model", tree="best_first", nodes=10, depth=5, top_k=3),
], ids=lambda c: c.label())
def test_replay_tau_equals_live_tau(dep, reqs, cfg):
    prompts = [list(r.prompt_ids) for r in reqs]
    ar = [dep.system(SystemConfig.ar()).generate(p, 32).tokens for p in prompts]
    depth_max, k_max = 8, (cfg.top_k if cfg.drafter == "ngram" else 4)
    rec = record(dep.system(cfg.model_copy(update={"top_k": k_max})).drafter, prompts, ar, depth_max, k_max)
    tau, steps = replay(rec, cfg)
    eng = dep.system(cfg)
    gens = [eng.generate(p, 32) for p in prompts]
    live_steps = sum(g.steps for g in gens)
    assert steps == live_steps
    assert tau == pytest.approx(sum(sum(g.accepted) for g in gens) / live_steps)


def test_pilot_end_to_end_tiny_plan(tmp_path, capsys):
    from specpilot.pilot.run import PilotOptions, run_pilot

    out = tmp_path / "report"
    opts = PilotOptions(target=bundled_target_dir(), drafter=bundled_drafter_dir(), out=out, quick=True,
                        overrides={"per_benchmark": 2, "max_new_tokens": 24, "rounds": 1, "candidates": 1, "depth_max": 6,
                                   "benchmarks": None})
    rep = run_pilot(opts)
    err = capsys.readouterr().err  # the expected duration is said before Phase 0, the actual one at the end
    assert err.index("expected duration") < err.index("phase 0") and "--quick sized to fit 3 min" in err
    assert "done took " in err and "(expected " in err
    d = rep["duration"]  # the estimate and the wall time, per phase, to compare
    assert d["estimate_s"] > 0 and d["actual_s"] > 0 and d["plan_changes"] == []  # every size was given
    assert set(d["estimate_by_phase_s"]) == set(d["actual_by_phase_s"])
    assert d["actual_s"] == pytest.approx(sum(d["actual_by_phase_s"].values()), rel=0.01)
    for f in ("report.md", "report.json", "system.json", "tau_vs_n.png", "c_vs_n.png", "ceiling.png"):
        assert (out / f).is_file(), f
    data = json.loads((out / "report.json").read_text())
    for key in ("ar_tokens_per_s", "stock_tokens_per_s", "sealed_tokens_per_s", "speedup_vs_ar", "speedup_vs_stock",
                "speedup_ci_low", "tau", "c", "ceiling", "token_forcing", "entries", "device"):
        assert key in data, key
    for f in ("tree", "kernel", "outside"):
        assert data["ceiling"][f] > 0
    for f in ("mismatch_rate", "events", "delta"):
        assert f in data["token_forcing"]
    assert data["token_forcing"]["passed"] and data["reproduction_check"]["ok"]
    from specpilot.pilot.audit import audit_outputs

    tf = data["token_forcing"]  # the audited outputs are kept: re-auditing them gives the pilot's figures
    again = audit_outputs(bundled_target_dir(), out / tf["outputs"], tf["delta"],
                          reference=out / tf["stock_outputs"])
    assert again["audited"]["tokens"] == tf["tokens"] and again["audited"]["mismatches"] == tf["mismatches"]
    assert again["baseline"]["mismatch_rate"] == tf["stock_mismatch_rate"] and again["passed"]
    import shutil
    import subprocess

    if shutil.which("specpilot") and shutil.which("bash"):  # the report's own re-audit line runs as printed
        assert f"- re-audit, from this report's directory: `{tf['reaudit_command']}`" in (out / "report.md").read_text()
        moved = shutil.copytree(out, out.parent / "moved")  # the line still works where the directory was copied
        r = subprocess.run(["bash", "-c", tf["reaudit_command"] + " --json"], capture_output=True, text=True, timeout=300,
                           cwd=moved)
        res = json.loads(r.stdout)
        assert r.returncode == 0 and res["passed"], r.stderr
        assert res["audited"]["mismatches"] == tf["mismatches"] and res["audited"]["tokens"] == tf["tokens"]
    from specpilot.pilot.memory import Memory

    mem = Memory(out / "memory")  # entries in the directory layout of §3.5, each reproducing on its own
    for i in data["reproduction_check"]["entries"]:
        assert (out / "memory" / i / "delta.json").is_file() and mem.reproduce(i).ok, i
    assert data["ar_tokens_per_s"] > 0 and data["sealed_tokens_per_s"] > 0
    for rd in data["rounds"]:  # a round names the direction its candidates came from, or says there were none
        judged = any(c["round"] == rd["round"] for c in data["candidates"])
        if rd["round"] >= 1:
            assert (rd["attacked"] in ("tree", "kernel", "outside")) == judged, (rd, judged)
            assert judged or rd["attacked"].startswith("none (no candidate: "), rd
    system = json.loads((out / "system.json").read_text())
    assert system["seal"] == SystemConfig(**system["config"]).seal() == rep["sealed_seal"]


def test_scorer_dtype_float32_loads_an_unrounded_copy(tmp_path):
    from specpilot.model.checkpoint import load_model
    from specpilot.pilot.phase0 import scorer_model
    from specpilot.pilot.run import PilotOptions
    from specpilot.pilot.state import Pilot

    kw = dict(target=bundled_target_dir(), drafter=None, out=tmp_path / "r", dtype="bfloat16")
    same = Pilot(PilotOptions(**kw))
    assert scorer_model(same) is same.dep.target  # default: the deployment's own target (§3.4)
    assert scorer_model(Pilot(PilotOptions(**kw, scorer_dtype="bfloat16"))) is not None
    p = Pilot(PilotOptions(**kw, scorer_dtype="float32"))
    m = scorer_model(p)
    assert m.dtype == torch.float32 and p.dep.target.dtype == torch.bfloat16
    ref = load_model(bundled_target_dir(), "float32", "cpu")
    ids = list(range(5, 40))
    got, want = Scorer(m).next_logprobs(ids), Scorer(ref).next_logprobs(ids)
    assert torch.equal(got, want)  # the float32 copy is the checkpoint in float32, not the bf16 weights upcast
    assert not torch.equal(Scorer(p.dep.target).next_logprobs(ids), want)
