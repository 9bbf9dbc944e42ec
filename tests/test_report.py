"""Report writer."""

import json

import numpy as np

from specpilot.pilot.report import write_report

REPORT = {
    "device": "cpu (2 cores)", "commit": "0123abc", "versions": {"torch": "2.13.0"},
    "stock_label": "draft_model/chain N=6", "sealed_label": "ngram/best_first N=6",
    "ar_tokens_per_s": 41.5, "stock_tokens_per_s": 63.2, "sealed_tokens_per_s": 97.8,
    "speedup_vs_ar": 2.357, "speedup_vs_stock": 1.547, "speedup_ci_low": 1.512,
    "tau": 3.21, "c": 1.362, "sigma": 0.0012,
    "ceiling": {"tree": 1.8, "kernel": 1.3, "outside": 1.1},
    "token_forcing": {"mismatch_rate": 0.0, "events": 0, "event_rate": 0.0, "delta": 0.125,
                      "tokens": 4096, "stock_mismatch_rate": 0.0, "passed": True},
    "entries": [{"id": "best-first", "title": "best-first tree", "gain": 1.4, "requires": []}, "budget-16"],
    "candidates": [
        {"round": 1, "name": "best_first N=16", "gain": 1.41, "lower_bound": 1.38, "bar": 0.012,
         "outputs_differ": False, "forcing_passed": True, "tau": 3.0, "c": 1.3, "approved": True,
         "reason": "approved: ..."},
        {"round": 1, "name": "chain D=8", "gain": 1.004, "lower_bound": 0.99, "bar": 0.012, "approved": False},
    ],
    "rounds": [{"round": 1, "ceiling": {"tree": 2.5, "kernel": 1.3, "outside": 1.1}, "attacked": "tree"},
               {"round": 2, "ceiling": {"tree": 1.8, "kernel": 1.3, "outside": 1.1}, "attacked": "tree"}],
    "tau_curve": {"chain": {1: 1.0, 4: 2.1, 8: 2.4}, "best_first": {"1": 1.0, "4": 2.5, "16": 3.2}},
    "c_curve": {1: 1.0, 4: 1.1, 16: 1.36, 64: np.float64(2.2)},
}


def test_writes_everything(tmp_path):
    out = write_report(tmp_path / "rep", REPORT, {})
    names = {"report.json", "report.md", "tau_vs_n.png", "c_vs_n.png", "ceiling.png"}
    assert set(out) == names
    for n in names:
        assert (tmp_path / "rep" / n).stat().st_size > 0
    for n in ("tau_vs_n.png", "c_vs_n.png", "ceiling.png"):
        assert (tmp_path / "rep" / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    js = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert js["sealed_tokens_per_s"] == 97.8 and js["c_curve"]["64"] == 2.2
    md = (tmp_path / "rep" / "report.md").read_text()
    for s in ("97.8", "63.2", "41.5", "2.357", "1.547", "1.512", "3.210", "1.362", "0.125",
              "best_first N=16", "chain D=8", "rejected", "`best-first`", "`budget-16`", "![ceiling](ceiling.png)"):
        assert s in md, s
    assert "| 1.800 | 1.300 | 1.100 | 2.574 |" in md  # ceiling factors and their product
    assert "< 1: the profiled run" not in md
    from specpilot.pilot.costmodel import Ceiling, ClassCost

    low = Ceiling(1.0, 1.0, 0.964, {"projections": ClassCost(1.0, 1.25, 1, 1)})  # outside 0.964, kernel 0.8
    write_report(tmp_path / "low", {**REPORT, "ceiling": {**low.factors(), "detail": low.to_dict()}}, {})
    low_md = (tmp_path / "low" / "report.md").read_text()
    assert "outside 0.96 < 1: the profiled run's region times sum to more" in low_md
    assert "kernel 0.80 < 1: the profiled kernels ran faster than the byte floor" in low_md
    assert "Commit: 0123abc; versions: torch 2.13.0" in md
    assert "| stock (`draft_model/chain N=6`) | 63.2 |" in md and "| sealed (`ngram/best_first N=6`) | 97.8 |" in md


def test_missing_parts_do_not_crash(tmp_path):
    out = write_report(tmp_path, {"ar_tokens_per_s": 10.0, "token_forcing": {"delta": 0.25}, "c_curve": {}})
    assert set(out) == {"report.json", "report.md"}  # no plot data: plots skipped
    md = (tmp_path / "report.md").read_text()
    assert "10.0" in md and "—" in md and "- none" in md
    out = write_report(tmp_path / "p", {}, {"c_vs_n": {2: 1.05, 8: 1.2}})  # plot data passed separately
    assert "c_vs_n.png" in out


def test_report_flags_a_sealed_system_slower_than_ar_and_estimator_gaps(tmp_path):
    """A sealed system below AR is flagged in report.md; a headline that τ / c of the same runs does not back
    (beyond 5%) gets the note that explains the two estimators; consistent figures get neither."""
    from specpilot.pilot.report import write_report

    write_report(tmp_path / "slow", {"speedup_vs_ar": 0.9, "speedup_ci_low": 0.8, "tau": 2.0, "c": 2.0})
    md = (tmp_path / "slow" / "report.md").read_text()
    assert "slower than AR in this run" in md and "differ by 10%" in md
    assert "Round 0 judges AR only when" in md
    write_report(tmp_path / "r0", {"speedup_vs_ar": 0.99, "speedup_ci_low": 0.89, "sigma": 0.079,
                                   "rounds": [{"round": 0, "approved": None}], "sealed_label": "draft_model/chain N=6"})
    md = (tmp_path / "r0" / "report.md").read_text()  # round 0 did judge AR, below a 17% bar
    assert "Round 0 judged AR against stock and did not approve it" in md and "σ = 7.9%" in md
    assert "only when stock loses" not in md
    write_report(tmp_path / "ar", {"speedup_vs_ar": 0.98, "speedup_ci_low": 0.96, "sealed_label": "AR"})
    assert "AR against AR, run-to-run noise" in (tmp_path / "ar" / "report.md").read_text()
    write_report(tmp_path / "ok", {"speedup_vs_ar": 1.3, "speedup_ci_low": 1.2, "tau": 2.6, "c": 2.0,
                                   "sealed_label": "ngram/chain N=4", "stock_label": "ngram/chain N=3"})
    md = (tmp_path / "ok" / "report.md").read_text()
    assert "slower than AR" not in md and "differ by" not in md and "stock itself" not in md
    assert "not shown faster than AR" not in md
    write_report(tmp_path / "lb", {"speedup_vs_ar": 1.127, "speedup_ci_low": 0.971, "sealed_label": "ngram/chain N=4"})
    md = (tmp_path / "lb" / "report.md").read_text()  # faster in the headline, but not shown faster than AR
    assert "not shown faster than AR" in md and "0.971" in md and "slower than AR in this run" not in md
    write_report(tmp_path / "st", {"speedup_vs_ar": 1.3, "speedup_vs_stock": 1.016, "speedup_vs_stock_ci_low": 1.003,
                                   "sealed_label": "ngram/chain N=3", "stock_label": "ngram/chain N=3"})
    md = (tmp_path / "st" / "report.md").read_text()  # a seal that is stock read 1.016x stock
    assert "sealed system is stock itself" in md and "1.003" in md and "run-to-run noise" in md


def test_report_flags_a_seal_that_failed_token_forcing(tmp_path):
    ok = write_report(tmp_path / "ok", REPORT, {})
    assert ok and "failed token forcing" not in (tmp_path / "ok" / "report.md").read_text()
    tf = {**REPORT["token_forcing"], "passed": False, "reasons": ["events (margin >= 2δ = 0.25) at 0.087% of tokens"],
          "allowance": 0.0131, "scorer_dtype": "float32", "outputs": "outputs/sealed.jsonl", "stock_outputs": "outputs/stock_phase0.jsonl"}
    write_report(tmp_path / "bad", {**REPORT, "token_forcing": tf}, {})
    md = (tmp_path / "bad" / "report.md").read_text()
    head = md[md.index("## Headline"):md.index("## Ceiling")]
    assert "**Warning: the sealed system failed token forcing in the seal's audit** (events (margin >= 2δ" in head
    assert "- failed: events (margin >= 2δ = 0.25) at 0.087% of tokens" in md
    assert "scorer: target in float32, FP32 LM head" in md and "stock's + 1.31 pp" in md and "`outputs/sealed.jsonl`" in md and "`outputs/stock_phase0.jsonl`" in md
    assert "against a float32 scorer" not in md  # the scorer was float32 already
    cmd = "specpilot audit --target T --outputs O --reference R --delta 0.125 --dtype float32 --device cuda"
    write_report(tmp_path / "bf16", {**REPORT, "token_forcing": {**tf, "scorer_dtype": "bfloat16",
                                                                 "reaudit_float32_command": cmd}}, {})
    head = (tmp_path / "bf16" / "report.md").read_text().split("## Ceiling")[0]
    assert "The scorer ran in bfloat16" in head and f"against a float32 scorer, from this report's directory: `{cmd}`" in head


def test_duration_line_compares_the_estimate_with_the_wall_time(tmp_path):
    """report.md says how long the run took against the estimate printed before Phase 0, per phase."""
    d = {"estimate_s": 150.0, "actual_s": 171.0, "target_s": 180.0, "plan_changes": ["max_new_tokens 32 -> 16"],
         "estimate_by_phase_s": {"setup": 10.0, "phase0": 40.0, "seal": 100.0},
         "actual_by_phase_s": {"setup": 10.0, "phase0": 45.0, "seal": 116.0}}
    write_report(tmp_path / "d", {**REPORT, "duration": d}, {})
    md = (tmp_path / "d" / "report.md").read_text()
    assert ("Duration: 2.9 min, expected 2.5 min before Phase 0 (per phase, actual (expected): setup 10 s (10), "
            "phase0 45 s (40), seal 116 s (100)); --quick plan: max_new_tokens 32 -> 16") in md
    write_report(tmp_path / "n", REPORT, {})
    assert "Duration:" not in (tmp_path / "n" / "report.md").read_text()  # no duration in the report: no line


def test_calibrated_rows_say_their_acceptance_is_simulated(tmp_path):
    """A calibrated drafter's rows in the Predictions and Candidates tables carry [SIMULATED] and the tables a
    legend; other rows do not, and a report with no calibrated row has neither."""
    from specpilot.config import SystemConfig

    cal = SystemConfig(drafter="calibrated", drafter_path="cal.json", tree="best_first", nodes=8, depth=4, top_k=2)
    ngram = SystemConfig(drafter="ngram", tree="chain", nodes=4, depth=4, top_k=1)
    screened = [{"round": 1, "name": c.label(), "tau_replay": 2.0, "tau_live": 2.0, "c_predicted": 1.1, "c_live": 1.2}
                for c in (cal, ngram)]
    cands = [{"round": 1, "name": c.label(), "config": c.model_dump(), "gain": 1.1, "approved": False}
             for c in (cal, ngram)]
    rep = {**REPORT, "candidates": cands, "predictions": {"candidates": 2, "holds": True, "screened": screened}}
    write_report(tmp_path / "cal", rep, {})
    md = (tmp_path / "cal" / "report.md").read_text()
    pred = md[md.index("## Predictions"):md.index("## Candidates")]
    table = md[md.index("## Candidates"):md.index("## Rounds")]
    for part in (pred, table):
        assert f"| {cal.label()} [SIMULATED] |" in part and f"| {ngram.label()} |" in part
        assert f"{ngram.label()} [SIMULATED]" not in part
        assert "\n[SIMULATED] marks the `calibrated` drafter, whose acceptance is simulated" in part
    write_report(tmp_path / "real", {**REPORT, "predictions": {"candidates": 1, "holds": True, "screened": screened[1:]}})
    assert "SIMULATED" not in (tmp_path / "real" / "report.md").read_text()
