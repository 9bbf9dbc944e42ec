"""The cost model's predictions (§3.2): pass times made monotone in rows, the speculative step's own work
calibrated on a measured step, and the self-check against the live c of screened candidates."""

from __future__ import annotations

import random

import numpy as np
import pytest

from specpilot.config import SystemConfig
from specpilot.pilot.costinputs import c_model_curve
from specpilot.pilot.predictions import prediction_check
from specpilot.pilot.planner import Planner, monotone
from specpilot.pilot.replay import record
from specpilot.pilot.report_md import render_markdown
from specpilot.spec.ngram import NgramDrafter


def test_monotone_is_the_least_squares_non_decreasing_fit():
    assert monotone([1, 3, 2, 4]).tolist() == [1, 2.5, 2.5, 4]
    assert monotone([5.46, 7.0, 6.54, 7.02, 8.42]).tolist() == pytest.approx([5.46, 6.77, 6.77, 7.02, 8.42])
    rng = random.Random(0)
    for _ in range(200):
        v = [rng.uniform(0, 10) for _ in range(rng.randint(1, 9))]
        m = monotone(v)
        assert np.all(np.diff(m) >= -1e-12) and m.sum() == pytest.approx(sum(v))  # blocks keep their mean
        if all(a <= b for a, b in zip(v, v[1:])):
            assert m.tolist() == pytest.approx(v)


def _planner(spec_step=None, verify=None):
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1], [5, 6, 7, 5, 6, 7, 5]]
    ar = [[2, 3, 4, 1, 2, 3, 4], [6, 7, 5, 6, 7, 5, 6]]
    rec = record(NgramDrafter(4, 1, max_matches=1), prompts, ar, 6, 1)
    rec.draft_ms = rec.first_ms = 0.25  # every propose call 0.25 ms
    verify = verify or {1: 4.0, 2: 4.6, 4: 4.3, 8: 5.0, 16: 6.0}  # a dip at 4 rows: measurement noise
    return Planner({("ngram", 1): rec}, verify, 3.5, spec_step=spec_step)


def test_c_curve_is_monotone_even_when_the_measured_passes_dip():
    p = _planner()
    curve = c_model_curve(p, {1: 4.0, 2: 4.6, 4: 4.3, 8: 5.0, 16: 6.0})
    ns = sorted(curve)
    assert curve[0] == 1.0 and all(curve[a] <= curve[b] for a, b in zip(ns[1:], ns[2:]))
    assert p.verify_time(3) == pytest.approx(4.45)  # 2 and 4 rows pooled to their mean


def test_spec_overhead_is_calibrated_on_the_measured_step():
    from specpilot.pilot.replay import replay_steps

    stock = SystemConfig(drafter="ngram", tree="chain", nodes=4, depth=4, top_k=1)
    plain = _planner()
    assert plain.overhead_ms == 0.0  # AR's step (3.5 ms) is shorter than the one-row pass: nothing outside
    p = _planner(spec_step=(stock, 6.0))
    steps = replay_steps(p.recording(stock), stock)
    mean_pass = sum(p.verify_time(r) for _, r in steps) / len(steps)
    tree = p.tree_time(stock)
    assert 0 < tree < 1.0  # the host's tree building, measured (ms)
    assert p.overhead_ms == pytest.approx(6.0 - mean_pass - 0.25 - tree)
    assert "live step (6.000 ms)" in p.spec_overhead_source and "below 0" not in p.spec_overhead_source
    # a live step shorter than its parts priced apart: T_spec 0, and the source says by how much it fell below
    tight = _planner(spec_step=(stock, mean_pass))
    assert tight.overhead_ms == 0.0 and "below 0, so 0" in tight.spec_overhead_source
    # the calibration step itself is predicted at its measured cost
    assert p.predict(stock).c == pytest.approx(6.0 / 3.5)
    bigger = p.predict(SystemConfig(drafter="ngram", tree="chain", nodes=6, depth=6, top_k=1))
    # never cheaper (up to the timer's noise on the two trees' host time, both measured): here the n-gram finds no
    # longer match to draft, so the two trees are the same
    assert bigger.c >= p.predict(stock).c - 0.01
    # a config with no recording cannot calibrate: AR's own overhead is kept
    unknown = _planner(spec_step=(SystemConfig(drafter="draft_model", tree="chain", nodes=4, depth=4), 9.0))
    assert unknown.overhead_ms == 0.0 and "AR" in unknown.spec_overhead_source


def test_each_replayed_step_is_priced_at_its_own_rows():
    """A step whose drafter found nothing verifies one row; a pass's cost is not linear in rows, so the mean of
    the steps' pass times is priced, not the pass time of the mean rows (or of a full tree)."""
    from specpilot.pilot.replay import replay, replay_steps

    p = _planner(verify={1: 4.0, 2: 4.1, 3: 4.2, 4: 9.0, 5: 9.5, 16: 12.0})  # a jump between 3 and 4 rows
    cfg = SystemConfig(drafter="ngram", tree="chain", nodes=4, depth=4, top_k=1)
    steps = replay_steps(p.recording(cfg), cfg)
    rows = [r for _, r in steps]
    assert 1 in rows and max(rows) <= 5 and len(set(rows)) > 1  # some steps drafted nothing
    assert replay(p.recording(cfg), cfg) == (pytest.approx(sum(k for k, _ in steps) / len(steps)), len(steps))
    pred = p.predict(cfg)
    want = (sum(p.verify_time(r) for r in rows) / len(rows) + 0.25 + p.tree_time(cfg)) / 3.5
    assert pred.c == pytest.approx(want) and pred.c < p.step_c(5, 0.25 + p.tree_time(cfg))


def test_tree_time_grows_with_the_tree_and_is_zero_without_a_drafter():
    p = _planner()
    chain = SystemConfig(drafter="ngram", tree="chain", nodes=2, depth=2, top_k=1)
    assert p.tree_time(SystemConfig.ar()) == 0.0
    assert p.tree_time(chain) >= 0.0 and p.tree_time(chain) == p.tree_time(chain)  # memoized


def test_prediction_check_figures_and_bar():
    live = [1.0, 1.2, 1.4, 1.6, 1.8, 2.0]
    good = [{"name": f"c{i}", "c_predicted": c * 1.05, "c_live": c, "tau_replay": 2.0, "tau_live": 2.1}
            for i, c in enumerate(live)]
    r = prediction_check(good)
    assert r["candidates"] == 6 and r["median_abs_error"] == pytest.approx(0.05) and r["spearman"] == pytest.approx(1)
    assert r["tau_median_abs_error"] == pytest.approx(1 - 2.0 / 2.1) and r["holds"]
    off = [{**g, "c_predicted": g["c_live"] * 1.3} for g in good]
    assert not prediction_check(off)["holds"]  # 30% off, however well ranked
    shuffled = [{**g, "c_predicted": c} for g, c in zip(good, [1.9, 1.05, 1.7, 1.2, 2.0, 1.3])]
    s = prediction_check(shuffled)
    assert s["spearman"] < 0.8 and not s["holds"]
    few = prediction_check(good[:4])
    assert few["candidates"] == 4 and not few["holds"]  # under five candidates nothing is established
    flat = prediction_check([{**g, "c_predicted": 1.0} for g in good])
    assert flat["spearman"] is None and not flat["holds"]
    assert prediction_check([])["candidates"] == 0


def test_report_shows_the_predictions():
    rows = [{"round": 2, "name": "ngram/chain N=4", "c_predicted": 1.3, "c_live": 1.2, "tau_replay": 1.5,
             "tau_live": 1.45}]
    r = {"predictions": {**prediction_check(rows), "screened": rows},
         "cost_inputs": {"spec_overhead_ms": 0.4, "spec_overhead_source": "stock measured live"}}
    md = render_markdown(r, [])
    assert "## Predictions" in md and "did not hold" in md
    assert "| 2 | ngram/chain N=4 | 1.500 | 1.450 | 1.300 | 1.200 |" in md


def test_rechecked_peaks_keep_the_higher_and_say_when_setup_was_busy():
    from specpilot.pilot.profiler import DevicePeaks

    setup = DevicePeaks(1e12, 50e9, "cpu", "first")
    same, warn = setup.rechecked(DevicePeaks(1.1e12, 48e9, "cpu", "again"))
    assert warn is None and same.flops_per_s == 1.1e12 and same.bytes_per_s == 50e9
    busy, warn = setup.rechecked(DevicePeaks(0.9e12, 90e9, "cpu", "again"))
    assert busy.bytes_per_s == 90e9 and busy.flops_per_s == 1e12 and "bandwidth +80%" in warn and "busy" in warn
    twice, _ = busy.rechecked(DevicePeaks(0.9e12, 90e9, "cpu", "third"))
    assert twice.method.count("re-checked") == 1 and twice.method.startswith("first; re-checked: third")


def test_report_says_when_phase0_and_the_headline_disagree():
    base = {"ar_tokens_per_s": 100.0, "phase0": {"stock_vs_ar_gain": 0.994, "stock_vs_ar_lower_bound": 0.95}}
    agree = render_markdown({**base, "stock_tokens_per_s": 97.0}, [])
    assert "outside Phase 0's interval" not in agree
    apart = render_markdown({**base, "stock_tokens_per_s": 87.2}, [])
    assert "Phase 0 measured stock at 0.994x AR (95% interval ±0.044) and the headline at 0.872x" in apart


def test_tau_plot_gets_the_sealed_systems_own_drafter():
    from types import SimpleNamespace

    from specpilot.pilot.seal import sealed_tau_curves

    pilot = SimpleNamespace(planner=_planner(), plan={"depth_max": 6}, drafter_kind="draft_model")
    sealed = SystemConfig(drafter="ngram", tree="best_first", nodes=4, depth=4, top_k=2)
    curves = sealed_tau_curves(pilot, sealed)
    assert set(curves) == {"ngram/chain", "ngram/best_first", "ngram/oracle"}
    assert curves["ngram/chain"][1] >= 1.0 and curves["ngram/oracle"][4] >= curves["ngram/chain"][4]
    assert sealed_tau_curves(pilot, SystemConfig.ar()) == {}
    assert sealed_tau_curves(SimpleNamespace(**{**vars(pilot), "drafter_kind": "ngram"}), sealed) == {}


def test_every_candidates_rows_are_measured_not_interpolated():
    from specpilot.pilot.planner import VERIFY_ROWS

    p = _planner()
    for inc in (SystemConfig.stock("ngram"), SystemConfig(drafter="ngram", tree="best_first", nodes=32, depth=10,
                                                          top_k=4)):
        for direction in ("tree", "outside"):
            for cfg in p.space(inc, direction):
                rows = 1 + min(cfg.nodes, cfg.depth if cfg.tree == "chain" else cfg.nodes)
                assert rows in VERIFY_ROWS, cfg.label()
