"""The batched pilot per batch size: one incumbent and one seal per size, and the shared budget per size from the
flat region of the batched pass. Verdicts here come from throughputs set by config through the pilot's ``adjust``
seam (real runs, real outputs, no timing in any assertion); budgets from synthetic cost tables."""

from __future__ import annotations

import json
import random

import pytest

from specpilot.config import SystemConfig
from specpilot.errors import SpecPilotError
from specpilot.pilot.batch_budget import flat_budget, measure_pass_ms, shared_budgets
from specpilot.pilot.batch_runs import BatchMeasured, compare

pytestmark = pytest.mark.usefixtures("one_thread")


def test_flat_budget_is_the_edge_of_the_flat_region():
    # 4 requests: flat (within 5% of the 4-row pass) up to 12 rows, then dearer twice in a row; a later dip does
    # not count
    costs = {4: 10.0, 5: 10.1, 6: 9.9, 8: 10.3, 12: 10.4, 20: 13.0, 36: 10.6, 68: 10.0}
    assert flat_budget(costs, 4) == 12 - 4
    assert flat_budget(costs, 4, tolerance=0.02) == 6 - 4
    # one dearer total between flat ones is noise (a shared CPU: 9 rows 6% over the 8-row pass, 16 rows flat)
    assert flat_budget({8: 76.8, 9: 81.3, 10: 77.0, 12: 78.1, 16: 79.9, 24: 88.0, 40: 120.0}, 8) == 16 - 8
    assert flat_budget({8: 76.8, 9: 77.0, 10: 81.3}, 8) == 9 - 8  # the last total dearer: the edge is before it
    assert flat_budget({1: 5.0, 2: 6.0, 3: 7.0}, 1) == 1  # not flat at all: one drafted node, the smallest budget
    assert flat_budget({16: 5.0}, 16) == 1
    for bad in ({5: 1.0}, {3: 1.0, 4: 1.0}, {4: 0.0, 5: 1.0}):
        with pytest.raises(ValueError):
            flat_budget(bad, 4)


def test_shared_budgets_give_each_batch_size_its_own_budget():
    def table(m):  # a pass flat up to 8 m rows
        return {m: 1.0, **{m + e: (1.0 if m + e <= 8 * m else 2.0) for e in (1, 2, 4, 8, 16, 32, 64)}}

    budgets, tables = shared_budgets(4, table)
    assert budgets == tuple(max(e for e in (1, 2, 4, 8, 16, 32, 64) if m + e <= 8 * m) for m in range(1, 5))
    assert budgets == (4, 8, 16, 16) and set(tables) == {1, 2, 3, 4}
    cfg = SystemConfig(tree="best_first", top_k=4, row_selection="shared_budget", shared_budget=budgets)
    assert [cfg.step_budget(m) for m in (1, 4, 5)] == [4, 16, cfg.nodes * 5]  # past the table: nodes x m


def test_measure_pass_ms_times_the_batched_pass_by_total_rows():
    from specpilot.engine.deployment import Deployment
    from specpilot.zoo import bundled_target_dir

    target = Deployment(bundled_target_dir()).target
    costs = measure_pass_ms(target, 3, extras=(1, 5), tolerance=1e9, prefix=16, repeats=1)
    assert set(costs) == {3, 4, 8} and all(t > 0 for t in costs.values())  # 3 roots, + 1 and + 5 drafted rows
    assert flat_budget(costs, 3, tolerance=1e9) == 5
    with pytest.raises(ValueError):
        measure_pass_ms(target, 0)


def test_measure_pass_ms_times_the_padded_pass_where_the_engine_pads(monkeypatch):
    """Where a batched engine pads its passes (CUDA), the budget is measured on that pass: the BatchRunner's bucket,
    padding included (here its CPU twin in Triton's interpreter), each total through ``BatchRunner.run``."""
    import specpilot.pilot.batch_budget as bb
    from specpilot.engine.batch_runner import BatchRunner
    from specpilot.engine.deployment import Deployment
    from specpilot.zoo import bundled_target_dir

    target = Deployment(bundled_target_dir()).target
    monkeypatch.setattr(bb, "runs_padded", lambda model, pool: True)
    runs, real = [], BatchRunner.run
    monkeypatch.setattr(BatchRunner, "run", lambda self, *a: runs.append(sum(map(len, a[2]))) or real(self, *a))
    costs = measure_pass_ms(target, 2, extras=(1, 3), tolerance=1e9, prefix=8, repeats=1)
    assert set(costs) == {2, 3, 5} and all(t > 0 for t in costs.values())
    assert set(runs) == {2, 3, 5}  # every total through the runner (2 warm-ups + 1 timed each, the base interleaved)


def test_measured_cells_split_by_size_and_merge_back():
    cells = [("b", n, r) for n in (1, 4) for r in range(2)]
    m = BatchMeasured({"a": {c: 10.0 for c in cells}, "b": {c: 10.0 * c[1] for c in cells}},
                      {k: {c: (((1,),), ((1,),)) for c in cells} for k in "ab"}, {c: (((0,),), ((0,),)) for c in cells},
                      {"a": (), "b": ("t",)}, {"a": False, "b": True})
    at4 = m.at(4)
    assert set(at4.tps["b"]) == {("b", 4, 0), ("b", 4, 1)} and compare(at4, "a", "b").gain == pytest.approx(4.0)
    back = BatchMeasured.merged([m.at(1), at4])
    assert back.tps == m.tps and back.outside == {"a": (), "b": ("t",)} and back.nondeterministic["b"]
    with pytest.raises(ValueError):
        BatchMeasured.merged([at4, at4])


def _speed(cfg: SystemConfig, n: int, ar: float = 90.0) -> float:
    """Throughput by config and size: the best-first tree (per request) wins at one request and loses at two; AR
    runs at ``ar`` (slower than stock by default); everything else runs at stock's speed."""
    if cfg.drafter == "none":
        return ar
    if cfg.tree == "best_first" and cfg.row_selection == "per_request":
        return 120.0 if n == 1 else 80.0
    return 100.0


def _set_speeds(systems: dict, m: BatchMeasured) -> None:
    for name, cfg in systems.items():
        m.tps[name] = {cell: _speed(cfg, cell[1]) for cell in m.tps[name]}


def test_a_candidate_that_wins_at_one_size_and_loses_at_the_other_seals_per_size(tmp_path):
    from specpilot.engine.deployment import Deployment
    from specpilot.pilot.batch_pilot import run_batch_pilot
    from specpilot.pilot.state import PilotOptions
    from specpilot.zoo import bundled_target_dir

    out = tmp_path / "r"
    opts = PilotOptions(target=bundled_target_dir(), out=out, quick=True,
                        overrides={"per_benchmark": 2, "max_new_tokens": 8, "benchmarks": 1})
    flat = lambda m: {m: 1.0, m + 1: 1.0, m + 2: 1.02, m + 4: 1.04, m + 8: 1.5}  # noqa: E731  flat up to m + 4
    rep = run_batch_pilot(opts, (1, 2), rounds=2, rng=random.Random(3), pass_ms=flat, adjust=_set_speeds)

    bf = {v["size"]: v for v in rep["verdicts"] if v["mechanism"] == "best_first"}
    assert bf[1]["approved"] and bf[1]["gain"] == pytest.approx(1.2)
    assert not bf[2]["approved"] and bf[2]["gain"] == pytest.approx(0.8)
    round0 = [v for v in rep["verdicts"] if v["mechanism"] == "stock"]
    assert len(round0) == 2 and all(v["approved"] for v in round0)  # stock beats AR at both sizes
    shared = {v["size"]: v for v in rep["verdicts"] if v["mechanism"] == "shared_budget"}
    assert rep["shared_budget"]["budgets"] == [4, 4]
    assert all(tuple(v["delta"]["shared_budget"]) == (4, 4) for v in shared.values())
    assert shared[1]["incumbent"] == bf[1]["candidate"] and shared[2]["incumbent"] == rep["stock_label"]

    ps = rep["per_size"]
    assert ps["1"]["sealed_label"] == bf[1]["candidate"] and ps["1"]["entries"] == ["best_first"]
    assert ps["2"]["sealed_is"] == "stock" and ps["2"]["entries"] == []
    assert ps["1"]["sealed_vs_stock"] == pytest.approx(1.2) and ps["2"]["sealed_vs_stock"] == pytest.approx(1.0)
    assert ps["1"]["sigma"] == 0.0 and ps["1"]["sealed_vs_ar_low"] is not None

    dep = Deployment(bundled_target_dir())
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 13, 11, 12, 13, 11]]
    ar = [g.tokens for g in dep.batch_system(SystemConfig.ar(), max_num_seqs=2).generate_all(prompts, 12)]
    systems = {}
    for n in (1, 2):
        s = json.loads((out / f"system_n{n}.json").read_text())
        cfg = SystemConfig(**s["config"])
        assert cfg.seal() == s["seal"] == ps[str(n)]["sealed_seal"] and s["batch_size"] == n
        assert s["deployment"]["batch"] == [n]
        assert ps[str(n)]["outputs_equal_ar"] == {"stock": True, "sealed": True}  # the seal's batch runs
        got = [g.tokens for g in dep.batch_system(cfg, max_num_seqs=n).generate_all(prompts, 12)]
        assert got == ar  # the sealed system, loaded from its file, equals AR in float32
        systems[n] = cfg
    assert systems[1] != systems[2] and systems[1].tree == "best_first" and systems[2] == SystemConfig.stock(depth=6)
    assert json.loads((out / "system.json").read_text()) == json.loads((out / "system_n1.json").read_text())
    md = (out / "batch_report.md").read_text()
    assert "system_n1.json" in md and "system_n2.json" in md and "| 2 | best_first |" in md


def test_a_size_where_no_drafted_row_pays_seals_ar(tmp_path):
    """AR faster than stock at both sizes: stock is not approved in round 0, so AR is each size's incumbent and
    every candidate (built from stock) must beat AR itself: the best-first tree does at one request (120 vs 110) and
    not at two (80), where AR is sealed."""
    from specpilot.pilot.batch_pilot import run_batch_pilot
    from specpilot.pilot.state import PilotOptions
    from specpilot.zoo import bundled_target_dir

    def speeds(systems, m):
        for name, cfg in systems.items():
            m.tps[name] = {cell: _speed(cfg, cell[1], ar=110.0) for cell in m.tps[name]}

    out = tmp_path / "r"
    opts = PilotOptions(target=bundled_target_dir(), out=out, quick=True,
                        overrides={"per_benchmark": 2, "max_new_tokens": 8, "benchmarks": 1})
    flat = lambda m: {m: 1.0, m + 1: 1.0, m + 2: 1.02, m + 4: 1.04, m + 8: 1.5}  # noqa: E731
    rep = run_batch_pilot(opts, (1, 2), rounds=2, rng=random.Random(4), pass_ms=flat, adjust=speeds)
    round0 = [v for v in rep["verdicts"] if v["mechanism"] == "stock"]
    assert len(round0) == 2 and not any(v["approved"] for v in round0)
    assert all(v["incumbent"] == SystemConfig.ar().label() for v in round0)
    bf = {v["size"]: v for v in rep["verdicts"] if v["mechanism"] == "best_first"}
    assert bf[1]["approved"] and bf[1]["incumbent"] == SystemConfig.ar().label()
    assert bf[1]["gain"] == pytest.approx(120 / 110) and not bf[2]["approved"]
    ps = rep["per_size"]
    assert ps["1"]["sealed_label"] == bf[1]["candidate"] and ps["2"]["sealed_is"] == "ar"
    assert ps["2"]["sealed_vs_ar"] == pytest.approx(1.0) and ps["2"]["sealed_vs_stock"] == pytest.approx(1.1)
    md = (out / "batch_report.md").read_text()
    assert "| 2 | AR | AR: neither stock nor any candidate beat it by the bar |" in md
    assert "each beating the incumbent of its moment: best_first" in md


def test_an_approved_system_slower_than_ar_in_its_seal_gives_way_to_ar(tmp_path):
    """The best-first tree is approved at one request (120 vs AR's 110) but runs 100 in the seal's own runs (as an
    H100's approvals ran on an H200): that size seals AR, its system file and report say so."""
    from specpilot.pilot.batch_pilot import run_batch_pilot
    from specpilot.pilot.state import PilotOptions
    from specpilot.zoo import bundled_target_dir

    def speeds(systems, m):
        sealing = "sealed" in systems
        for name, cfg in systems.items():
            fast = cfg.tree == "best_first" and cfg.row_selection == "per_request" and not sealing
            m.tps[name] = {cell: 120.0 if fast and cell[1] == 1 else _speed(cfg, cell[1], ar=110.0) * (
                100 / 120 if sealing and cfg.tree == "best_first" else 1) for cell in m.tps[name]}

    out = tmp_path / "r"
    opts = PilotOptions(target=bundled_target_dir(), out=out, quick=True,
                        overrides={"per_benchmark": 2, "max_new_tokens": 8, "benchmarks": 1})
    flat = lambda m: {m: 1.0, m + 1: 1.0, m + 2: 1.02, m + 4: 1.04, m + 8: 1.5}  # noqa: E731
    rep = run_batch_pilot(opts, (1, 2), rounds=2, rng=random.Random(5), pass_ms=flat, adjust=speeds)
    bf = {v["size"]: v for v in rep["verdicts"] if v["mechanism"] == "best_first"}
    assert bf[1]["approved"]
    ps = rep["per_size"]["1"]
    assert ps["sealed_is"] == "ar" and ps["entries"] == [] and ps["sealed_vs_ar"] == pytest.approx(1.0)
    assert ps["fell_back"]["label"] == bf[1]["candidate"] and ps["fell_back"]["entries"] == ["best_first"]
    assert ps["fell_back"]["gain_vs_ar"] == pytest.approx(100 / 110)
    assert SystemConfig(**json.loads((out / "system_n1.json").read_text())["config"]) == SystemConfig.ar()
    md = (out / "batch_report.md").read_text()
    assert f"| 1 | AR | AR: {bf[1]['candidate']} was approved (best_first) but ran 0.909x AR in the seal |" in md


def test_a_pilot_cut_short_resumes_from_its_journal(tmp_path, monkeypatch, capsys):
    """A run killed in its third measurement, run again in the same directory, measures only what was left (the
    journal's measurements read back) and reaches the verdicts and seals of a run never cut; other options refuse
    the directory."""
    import specpilot.pilot.batch_pilot as bp
    from specpilot.pilot.batch_journal import JOURNAL
    from specpilot.pilot.state import PilotOptions
    from specpilot.zoo import bundled_target_dir

    flat = lambda m: {m: 1.0, m + 1: 1.0, m + 2: 1.02, m + 4: 1.04, m + 8: 1.5}  # noqa: E731
    calls, real = [], bp.measure_batches

    def counted(makers, *a, **k):
        calls.append(tuple(makers))
        if len(calls) == 3 and cut:
            raise KeyboardInterrupt  # the call's time limit
        return real(makers, *a, **k)

    monkeypatch.setattr(bp, "measure_batches", counted)

    def run(out, cut_now, **over):
        nonlocal cut
        cut = cut_now
        opts = PilotOptions(target=bundled_target_dir(), out=out, quick=True,
                            overrides={"per_benchmark": 2, "max_new_tokens": 8, "benchmarks": 1, **over})
        return bp.run_batch_pilot(opts, (1, 2), rounds=2, rng=random.Random(3), pass_ms=flat, adjust=_set_speeds)

    cut = False
    whole = run(tmp_path / "whole", False)
    n_whole = len(calls)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "cut", True)
    assert len(calls) == 3 and (tmp_path / "cut" / JOURNAL).is_file()
    calls.clear()
    resumed = run(tmp_path / "cut", False)
    assert len(calls) == n_whole - 2  # the two finished before the cut were read back
    strip = lambda rep: [{k: v for k, v in x.items() if k != "run"} for x in rep["verdicts"]]  # noqa: E731
    assert strip(resumed) == strip(whole)
    assert {n: r["sealed_label"] for n, r in resumed["per_size"].items()} == \
        {n: r["sealed_label"] for n, r in whole["per_size"].items()}
    calls.clear()
    again = run(tmp_path / "cut", False)
    assert not calls and strip(again) == strip(whole)  # everything from the journal
    from specpilot.pilot.batch_journal import machine_name

    assert again["journal_machines"] == {machine_name("cpu"): n_whole}  # every measurement names its machine
    path = tmp_path / "cut" / JOURNAL
    j = json.loads(path.read_text())
    for v in j["entries"].values():
        if isinstance(v, dict) and "machine" in v:
            v["machine"] = "NVIDIA H100 80GB HBM3"
    path.write_text(json.dumps(j))
    capsys.readouterr()
    elsewhere = run(tmp_path / "cut", False)
    assert "its verdicts mix machines" in capsys.readouterr().err and strip(elsewhere) == strip(whole)
    assert elsewhere["journal_machines"] == {"NVIDIA H100 80GB HBM3": n_whole}
    with pytest.raises(SpecPilotError, match="plan.max_new_tokens 8 there, 9 here"):
        run(tmp_path / "cut", False, max_new_tokens=9)


def test_a_journal_resumed_on_another_machine_says_whose_measurements_it_mixes(tmp_path, capsys):
    """The header's device is "cuda" for any GPU: each measurement names its machine, and a resume elsewhere says
    that its verdicts mix machines (an H100's approvals were sealed on an H200 and lost there)."""
    from specpilot.pilot.batch_journal import BatchJournal, machine_name
    from specpilot.pilot.batch_runs import BatchMeasured

    head = {"sizes": [1], "plan": {}}
    j = BatchJournal(tmp_path, head, "NVIDIA H100 80GB HBM3")
    j.measured("a", BatchMeasured)
    j.put("phase0_s", 1.0)  # not a measurement
    again = BatchJournal(tmp_path, head, "NVIDIA H200")
    assert again.machines() == {"NVIDIA H100 80GB HBM3": 1} and again.resumed == 2
    m, old = again.measured("b", BatchMeasured)
    assert not old and again.machines() == {"NVIDIA H100 80GB HBM3": 1, "NVIDIA H200": 1}
    assert machine_name("cpu")  # the CPU's name, never empty


def test_a_broken_or_foreign_journal_is_refused_in_one_line(tmp_path):
    """Not JSON, not a dict, no header, a malformed entry: 'not a readable journal'; another run's header names
    each differing option with both values; sizes in another order are the same run."""
    from specpilot.pilot.batch_journal import JOURNAL, BatchJournal

    head = {"sizes": [1, 2], "plan": {"max_new_tokens": 8}}
    j = BatchJournal(tmp_path, head)
    j.put("k", {"tps": {}})
    for text in ("{", "[]", '{"entries": {}}', '{"header": {}, "entries": []}'):
        (tmp_path / JOURNAL).write_text(text)
        with pytest.raises(SpecPilotError, match="not a readable journal"):
            BatchJournal(tmp_path, head)
    (tmp_path / "x").mkdir()
    j = BatchJournal(tmp_path / "x", head)
    j.put("k", "a string")
    with pytest.raises(SpecPilotError, match="entry 'k' is malformed"):
        BatchJournal(tmp_path / "x", head).measured("k", lambda: pytest.fail("measured again"))
    with pytest.raises(SpecPilotError, match="plan.max_new_tokens 8 there, 9 here"):
        BatchJournal(tmp_path / "x", {**head, "plan": {"max_new_tokens": 9}})


def test_a_pilot_refuses_the_other_kinds_directory(tmp_path):
    from specpilot.pilot.cli import check_report_dir

    (tmp_path / "journal.json").write_text("{}")
    with pytest.raises(SpecPilotError, match="holds a batched"):
        check_report_dir(tmp_path)
    check_report_dir(tmp_path, batched=True)
    (tmp_path / "report.json").write_text("{}")
    with pytest.raises(SpecPilotError, match="holds a single-request"):
        check_report_dir(tmp_path, batched=True)
