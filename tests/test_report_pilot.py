"""Pilot report pieces without engines: one source of truth for step times, thread pinning, the AR
incumbent's tree factor, memory reuse helpers and the report's sections (fast: no model)."""

from __future__ import annotations

import json
import random

import pytest

from specpilot.config import SystemConfig
from specpilot.spec.ngram import NgramDrafter
from specpilot.engine.types import Generation
from specpilot.pilot import controller as ctl
from specpilot.pilot.ceiling import tree_tau_best
from specpilot.pilot.memory import Entry, Evidence
from specpilot.pilot.planner import Planner
from specpilot.pilot.replay import record
from specpilot.pilot.report import write_report
from specpilot.pilot.report_plots import ceiling_rows
from specpilot.pilot.reuse import neighbourhood, patch_status
from specpilot.pilot.seal import benchmark_table
from specpilot.pilot.setup import choose_threads
from specpilot.pilot.steps import StepRecorder, c_of, interleaved_steps, step_stats


class FakeSystem:
    """Deterministic output; decode time ``ms_per_step`` per step on timed calls. The first call (the
    controller's warm-up) and calls after ``timed_calls`` (its determinism re-run) report 1000x slower
    steps, so any of them leaking into the step statistics would show."""

    def __init__(self, ms_per_step: float, tokens_per_step: int, timed_calls: int, warm_up: bool = True):
        self.ms, self.tps, self.timed_calls, self.calls = ms_per_step, tokens_per_step, timed_calls, 0
        self.warm_up = warm_up

    def generate(self, prompt_ids, max_new_tokens):
        self.calls += 1
        slow = (self.warm_up and self.calls == 1) or self.calls > 1 + self.timed_calls
        tokens = [(sum(prompt_ids) + i) % 50 + 3 for i in range(max_new_tokens)]
        steps = (max_new_tokens - 1 + self.tps - 1) // self.tps
        acc = [self.tps] * (steps - 1) + [max_new_tokens - 1 - self.tps * (steps - 1)]
        decode_s = 1e-3 * self.ms * steps * (1000 if slow else 1)
        return Generation(tokens, steps, acc, [self.tps] * steps, "length", 0.002 + decode_s, 0.002)


REQS = [ctl.Req(b, i, tuple(range(3 + i, 9 + i)), 9) for b in ("x", "y") for i in range(2)]


def test_report_c_is_sealed_step_over_ar_step_of_the_same_runs():
    rec = StepRecorder()
    n = 2 * len(REQS)  # timed calls per system in an interleaved run (two variants per request)
    makers = {"ar": rec.wrap("ar", lambda: FakeSystem(2.0, 1, n)),
              "sealed": rec.wrap("sealed", lambda: FakeSystem(3.0, 4, n))}
    final = ctl.interleaved_run(makers, REQS, vocab_size=100, rng=random.Random(0), progress=rec.progress())
    ar, sealed = rec.stats("ar", final.prompts), rec.stats("sealed", final.prompts)
    assert ar.step_ms == pytest.approx(2.0) and sealed.step_ms == pytest.approx(3.0)  # warm-up / re-run excluded
    assert ar.tau == 1.0 and sealed.tau == pytest.approx(8 / 2)  # 8 tokens after the prefill in 2 steps
    assert ar.runs == sealed.runs == len(REQS)
    assert c_of(sealed, ar) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="no timed run"):
        StepRecorder().stats("ar", final.prompts)


def test_interleaved_steps_keeps_the_faster_run_and_ratio():
    class Drifting(FakeSystem):  # every second call twice as slow: the faster run is kept
        def generate(self, prompt_ids, max_new_tokens):
            g = super().generate(prompt_ids, max_new_tokens)
            if self.calls % 2 == 0:
                g.time_s = g.prefill_s + 2 * (g.time_s - g.prefill_s)
            return g

    st = interleaved_steps({"ar": Drifting(2.0, 1, 10**6, False), "x": Drifting(5.0, 2, 10**6, False)}, REQS)
    assert st["x"].step_ms == pytest.approx(5.0) and st["ar"].step_ms == pytest.approx(2.0)
    assert c_of(st["x"], st["ar"]) == pytest.approx(2.5)
    with pytest.raises(ValueError):
        step_stats([Generation([1], 0)])


def test_thread_choice():
    assert choose_threads("cpu", None, 2, 2) == (1, "pinned to 1 on a CPU device with 2 core(s)")
    assert choose_threads("cpu", None, 8, 8)[0] == 8
    assert choose_threads("cuda:0", None, 2, 2)[0] == 2
    assert choose_threads("cpu", 2, 2, 1) == (2, "--threads")
    with pytest.raises(ValueError, match="--threads"):
        choose_threads("cpu", 0, 2, 2)


def test_ar_incumbent_tree_factor_uses_best_recorded_drafter():
    cycle = [5, 6, 7, 8, 9, 10]
    prompts = [cycle * 3, [11, 12, 13, 14] * 3]
    ar = [cycle * 3, [11, 12, 13, 14] * 4]  # the greedy continuation repeats: the n-gram drafter has it
    recs = {("ngram", 4): record(NgramDrafter(max_matches=4), prompts, ar, 6, 4)}
    planner = Planner(recs, {1: 1.0, 2: 1.1, 8: 1.5}, 1.2)
    ar_cfg = SystemConfig.ar()
    assert planner.oracle_tau(ar_cfg) == 0.0  # the old tree factor: max(0, τ=1) / 1 = 1
    tau_best, src = tree_tau_best(planner, ar_cfg, 1.0, 6)
    assert tau_best > 2.0 and "ngram" in src and "N=6" in src
    stock = SystemConfig.stock("ngram")
    assert tree_tau_best(planner, stock, 1.0, 6)[0] == pytest.approx(planner.oracle_tau(stock))


def test_speculative_tree_factor_sees_a_better_recorded_drafter():
    """An incumbent whose own drafter misses everything still sees the headroom of another recorded drafter (its
    own oracle alone said "no tree headroom", so the pilot never attacked the drafter)."""
    cycle = [5, 6, 7, 8, 9, 10]
    good = record(NgramDrafter(max_matches=4), [cycle * 3], [cycle * 3], 6, 4)
    # the same AR output from a prompt that never shows it: a drafter whose lattices miss (stands for a weak kind)
    weak = record(NgramDrafter(max_matches=4), [[20, 21, 22, 23]], [cycle * 3], 6, 4)
    planner = Planner({("draft_model", 4): weak, ("ngram", 4): good}, {1: 1.0, 2: 1.1, 8: 1.5}, 1.2)
    inc = SystemConfig(drafter="draft_model", tree="best_first", nodes=6, depth=6, top_k=4)
    own = planner.oracle_tau(inc)
    tau_best, src = tree_tau_best(planner, inc, 1.0, 6)
    assert tau_best > own + 1.0 and src == "best recorded drafter's oracle (ngram, top-4, N=6)"
    ngram = inc.model_copy(update={"drafter": "ngram"})
    assert tree_tau_best(planner, ngram, 1.0, 6) == (pytest.approx(planner.oracle_tau(ngram)),
                                                      "own drafter's oracle (ngram, top-4, N=6)")


def test_neighbourhood_and_patch_status():
    cfg = SystemConfig(drafter="ngram", tree="best_first", nodes=12, depth=6, top_k=4)
    hood = neighbourhood(cfg, depth_max=8)
    assert hood[0] == cfg and len(hood) == len(set(hood)) > 10
    assert {c.nodes for c in hood} == {8, 12, 18} and {c.depth for c in hood} == {4, 6, 8}
    assert {c.top_k for c in hood} == {2, 4, 8}
    chain = neighbourhood(SystemConfig.stock("ngram", depth=6), depth_max=6)
    assert all(c.nodes == c.depth and c.top_k == 1 for c in chain) and {c.depth for c in chain} == {4, 6}
    assert neighbourhood(SystemConfig.ar(), 8) == [SystemConfig.ar()]
    patch = Entry(id="p1", title="t", mechanism="m", kind="patch", delta="diff --git a/x b/x\n",
                  evidence=Evidence(gain=1.1, lower_bound=1.05, bar=0.01, sigma=0.0),
                  base={"commit": "a" * 40}, system={"tree": "b" * 40})
    assert patch_status(patch, "b" * 40)[0] == "in code base"
    status, why = patch_status(patch, "c" * 40)
    assert status == "not carried over" and "patch entry skipped" in why and "bbbbbbbbbbbb" in why


def test_report_sections(tmp_path):
    final = ctl.InterleavedRun(REQS, (), {"ar": (10.0, 12.0, 20.0, 22.0), "stock": (12.0, 13.0, 21.0, 25.0),
                                          "sealed": (15.0, 19.0, 30.0, 31.0)}, {}, {}, {})
    bm = benchmark_table(final)
    assert bm["x"]["vs_ar"] == pytest.approx(((15 / 10) * (19 / 12)) ** 0.5)
    assert bm["x"]["vs_ar_low"] is not None and bm["x"]["vs_ar_low"] <= bm["x"]["vs_ar"]
    rep = {
        "device": {"type": "cpu", "threads": 1, "threads_reason": "pinned to 1 on a CPU device with 2 core(s)"},
        "benchmarks": bm, "tau": 3.0, "c": 1.5, "step_ms": 3.0, "ar_step_ms": 2.0,
        "ceiling": {"tree": 1.2, "kernel": 2.0, "outside": 1.1},
        "candidates": [
            {"round": 1, "name": "A", "gain": 1.3, "lower_bound": 1.2, "bar": 0.01, "approved": True, "entry": "r1-a",
             "forcing_passed": True, "mismatch_rate": 0.0, "predicted": {"tau": 2.5, "c": 1.4, "c_screened": 1.6}},
            {"round": 1, "name": "B", "gain": 1.2, "lower_bound": 1.1, "bar": 0.01, "approved": True, "superseded_by": "A"},
            {"round": "memory", "name": "C", "gain": 1.1, "lower_bound": 1.05, "bar": 0.01, "approved": True,
             "entry": "reuse-c", "reused_from": "/m/r1-c"}],
        "rounds": [{"round": 0, "ceiling": {"tree": 1.0, "kernel": 2.0, "outside": 1.1}, "incumbent": "stock"},
                   {"round": 1, "ceiling": {"tree": 2.0, "kernel": 2.0, "outside": 1.1}, "incumbent": "AR"}],
        "memory_source": "/m", "reused": [
            {"id": "r1-c", "kind": "config", "status": "reused", "recorded": "C0", "config": "C", "entry": "reuse-c",
             "gain": 1.1, "lower_bound": 1.05, "reason": "approved"},
            {"id": "p", "kind": "patch", "status": "not carried over", "reason": "patch entry skipped: ..."}],
        "entries": [{"id": "reuse-c", "title": "C", "gain": 1.1, "lower_bound": 1.05, "requires": [],
                     "reused_from": "/m/r1-c"}, {"id": "r1-a", "title": "A", "gain": 1.3, "requires": ["reuse-c"]}],
        "c_curve": {0: 1.0, 3: 1.2}, "c_measured": [{"label": "sealed", "N": 3.0, "c": 1.5}],
    }
    out = write_report(tmp_path, rep)
    assert {"speedup.png", "c_vs_n.png", "ceiling.png"} <= set(out)
    md = (tmp_path / "report.md").read_text()
    for s in ("torch threads: 1 (pinned", "## Speedup per benchmark", f"{bm['x']['vs_ar']:.3f}",
              "approved, superseded (by A", "approved → entry `r1-a`", "passed (0.00%)", "| 2.500 | 1.400 | 1.600 |",
              "## Reused from memory", "| `p` | patch | not carried over |", "reused from `/m/r1-c`, re-measured here",
              "`r1-a` A (new;", "| 0 | stock |", "T_AR 2.000 ms", "τ / c = 2.000"):
        assert s in md, s
    assert json.loads((tmp_path / "report.json").read_text())["benchmarks"]["y"]["requests"] == 2
    rounds = rep["rounds"] + [{"round": "sealed", "ceiling": rep["ceiling"]}]
    assert [n for n, _ in ceiling_rows(rounds)] == ["round 0", "round 1", "sealed"]  # all drawn in ceiling.png


@pytest.mark.parametrize("args, msg", [
    (["--threads", "0"], "error: --threads must be >= 1, got 0"),
    (["--memory", "/nonexistent/mem"], "error: --memory /nonexistent/mem: no such directory"),
])
def test_pilot_cli_bad_threads_or_memory_is_one_line(monkeypatch, capsys, tmp_path, args, msg):
    import sys

    from specpilot.cli import main

    monkeypatch.setattr(sys, "argv", ["specpilot", "pilot", "--out", str(tmp_path / "o"), *args])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err == msg


def test_requests_ending_at_their_first_token_are_skipped_not_fatal():
    """A real model's EOS can end a request at its first token (no decode step): the step statistics skip it
    (the seal crashed on SmolLM2 before), and still refuse a system with no step at all."""

    class EosOn(FakeSystem):  # requests whose prompt (after any salt) starts with 3 end at the first token
        def generate(self, prompt_ids, max_new_tokens):
            if tuple(prompt_ids[-6:]) == (3, 4, 5, 6, 7, 8):
                self.calls += 1
                return Generation([2], 0, [], [], "stop", 0.002, 0.002)
            return super().generate(prompt_ids, max_new_tokens)

    st = interleaved_steps({"ar": EosOn(2.0, 1, 10**6, False), "x": EosOn(5.0, 2, 10**6, False)}, REQS)
    assert st["x"].runs == st["ar"].runs == 2 and c_of(st["x"], st["ar"]) == pytest.approx(2.5)  # 2 of 4 kept
    rec = StepRecorder()
    n = 2 * len(REQS)
    makers = {"ar": rec.wrap("ar", lambda: EosOn(2.0, 1, n)), "x": rec.wrap("x", lambda: EosOn(3.0, 1, n))}
    final = ctl.interleaved_run(makers, REQS, vocab_size=100, rng=random.Random(0), progress=rec.progress())
    x = rec.stats("x", final.prompts)
    assert x.step_ms == pytest.approx(3.0) and x.runs == 2
    with pytest.raises(ValueError, match="decode step"):
        interleaved_steps({"ar": EosOn(2.0, 1, 10**6, False)}, REQS[:1])
