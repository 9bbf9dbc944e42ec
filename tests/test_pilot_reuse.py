"""Memory reuse end to end (§3.5): a first quick pilot's memory fed into a second run on the bundled models
is re-tuned, re-measured and reported as reused, never as a new discovery; a patch entry is skipped with
its reason. The report's c is the sealed step over the AR step of the same interleaved run.

The controller's *decision* is pinned to "approve" here (its paired runs and token forcing still run for
real) so the test does not depend on CPU timing noise; the approval rule itself is tested in
tests/test_controller.py and tests/test_adversarial.py.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from specpilot.pilot import run as pilot_run
from specpilot.pilot.memory import Entry, Evidence, Memory
from specpilot.pilot.phase0 import clear_old_memory
from specpilot.pilot.state import Pilot
from specpilot.zoo import bundled_drafter_dir, bundled_target_dir

PLAN = {"per_benchmark": 2, "max_new_tokens": 16, "candidates": 1, "depth_max": 6}


@pytest.fixture
def approve_all(monkeypatch):
    """Every verdict approved: the controller's approval rule is wrapped where every judgement reaches it (a round's
    candidates through ``Pilot.judge_many``, reuse and round 0 through ``Pilot.judge``: all call
    ``Controller.judge``, which calls ``controller.approve``)."""
    from specpilot.pilot import controller

    real = controller.approve

    def approve(*a, **kw):
        return dataclasses.replace(real(*a, **kw), approved=True, reason="approved: decision pinned by the test")

    monkeypatch.setattr(controller, "approve", approve)


@pytest.fixture
def stock_beats_ar(monkeypatch):
    """Phase 0's stock-vs-AR gain pinned to at least 1: on a busy CPU stock can time below AR, and round 0
    then approves AR (under ``approve_all``) as a new discovery beside the reused entries."""
    real = pilot_run.run_rounds

    def run_rounds(pilot, p0):
        return real(pilot, dataclasses.replace(p0, stock_vs_ar=max(p0.stock_vs_ar, 1.0)))

    monkeypatch.setattr(pilot_run, "run_rounds", run_rounds)


def test_second_run_reports_first_runs_memory_as_reused(tmp_path, approve_all, stock_beats_ar):
    torch.set_num_threads(1)
    first = pilot_run.run_pilot(pilot_run.PilotOptions(
        target=bundled_target_dir(), drafter=bundled_drafter_dir(), out=tmp_path / "first", threads=1,
        overrides={**PLAN, "rounds": 1}))
    assert first["entries"], "the pinned decision approves the round's best candidate"
    src = tmp_path / "memory"
    shutil.copytree(tmp_path / "first" / "memory", src)
    Memory(src).add(Entry(id="zz-patch", title="a code delta", mechanism="kernel", kind="patch",
                          delta="diff --git a/x b/x\n", evidence=Evidence(gain=1.1, lower_bound=1.05, bar=0.01, sigma=0.0),
                          base={"commit": "0" * 40}, system={"tree": "1" * 40}))

    second = pilot_run.run_pilot(pilot_run.PilotOptions(
        target=bundled_target_dir(), drafter=bundled_drafter_dir(), out=tmp_path / "second", threads=1,
        memory=src, overrides={**PLAN, "rounds": 0}))
    rows = {r["id"]: r for r in second["reused"]}
    assert set(rows) == {e["id"] for e in first["entries"]} | {"zz-patch"}
    assert rows["zz-patch"]["status"] == "not carried over" and "patch entry skipped" in rows["zz-patch"]["reason"]
    reused = [r for r in second["reused"] if r["status"] == "reused"]
    assert reused, second["reused"]
    mem = Memory(tmp_path / "second" / "memory")
    for r in reused:
        e = mem.get(r["entry"])
        assert e.reused_from == str(src / r["id"]) and e.id.startswith("reuse-")
        assert e.evidence.gain == pytest.approx(r["gain"])  # new evidence, measured in this run
    assert all(e["reused_from"] for e in second["entries"])  # nothing counted as a new discovery
    assert second["reproduction_check"]["ok"]
    md = (tmp_path / "second" / "report.md").read_text()
    assert "## Reused from memory" in md and "reused from `" in md and "(new;" not in md
    assert "| `zz-patch` | patch | not carried over |" in md
    data = json.loads((tmp_path / "second" / "report.json").read_text())
    assert data["device"]["threads"] == 1
    steps = data["steps"]  # τ and c from the seal's interleaved run itself
    assert data["c"] == pytest.approx(steps["sealed"]["step_ms"] / steps["ar"]["step_ms"])
    assert data["ar_step_ms"] == steps["ar"]["step_ms"] and data["tau"] == steps["sealed"]["tau"]
    assert f"T_AR {data['ar_step_ms']:.3f} ms" in md


def test_rerun_into_the_same_out_replaces_the_old_memory_and_refuses_it_as_source(tmp_path):
    """A second pilot into the same --out used to leave the first run's memory entries beside its own report
    (listed, checked and reusable as if this run had approved them): they are removed at the start, and
    --memory pointing at OUT/memory itself is refused (the run would delete its own source)."""
    from specpilot.errors import SpecPilotError

    out = tmp_path / "rep"
    stale = out / "memory" / "r1-old-entry"
    stale.mkdir(parents=True)
    (stale / "entry.json").write_text("{}")
    mine = out / "memory" / "my_notes"  # a user's folder there was once deleted as an "entry"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me\n")
    (out / "memory" / "README").write_text("mine too\n")
    opts = pilot_run.PilotOptions(target=bundled_target_dir(), drafter=bundled_drafter_dir(), out=out)
    clear_old_memory(Pilot(opts))
    assert not stale.exists()
    assert (mine / "notes.txt").read_text() == "keep me\n" and (out / "memory" / "README").read_text() == "mine too\n"
    assert sorted(p.name for p in (out / "memory").iterdir()) == ["README", "my_notes"]
    stale.mkdir(parents=True)
    (stale / "entry.json").write_text("{}")
    with pytest.raises(SpecPilotError, match="own output"):
        Pilot(dataclasses.replace(opts, memory=out / "memory"))


def test_memory_whose_every_entry_is_broken_is_refused_before_phase0(tmp_path, monkeypatch, capsys):
    from specpilot.errors import SpecPilotError
    from specpilot.pilot.reuse import open_source

    mem = tmp_path / "mem"
    for name in ("a", "b"):
        (mem / name).mkdir(parents=True)
        (mem / name / "entry.json").write_text("{ not json")
    with pytest.raises(SpecPilotError, match=r"none of its 2 entries can be used \(e\.g\. a: .*corrupted"):
        open_source(mem)
    from .conftest import run_cli

    code, out, err = run_cli(monkeypatch, capsys, "pilot", "--memory", str(mem), "--out", str(tmp_path / "r"))
    assert code == 2 and "none of its 2 entries can be used" in err and "Traceback" not in err
    assert not (tmp_path / "r" / "report.md").exists()


def test_memory_given_as_a_report_directory_points_at_its_memory_subdirectory(tmp_path):
    """``--memory REPORT_DIR`` (the pilot's output, whose entries live in ``memory/``) says where they are, as
    ``specpilot memory list`` does; an empty directory without one gets no such hint."""
    from specpilot.errors import SpecPilotError
    from specpilot.pilot.reuse import open_source

    report = tmp_path / "specpilot-report"
    (report / "memory" / "e1").mkdir(parents=True)
    with pytest.raises(SpecPilotError, match=r"its entries are in .*specpilot-report/memory"):
        open_source(report)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecPilotError) as e:
        open_source(tmp_path / "empty")
    assert "its entries are in" not in str(e.value)
