"""The batched pilot (`specpilot pilot --batch`): its gain and bound on synthetic figures, its rule, its candidates,
one quick end-to-end run on the bundled model (float32 CPU: every output equals AR's) and the CLI's wiring."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.errors import SpecPilotError
from specpilot.pilot import controller as ctl
from specpilot.pilot.batch_mechanisms import CPU_MECHANISMS, mechanisms_for
from specpilot.pilot.batch_pilot import (MECHANISMS, BatchForcing, expected_rest_s, judge_batch, parse_sizes,
                                         run_batch_pilot)
from specpilot.pilot.batch_runs import BatchMeasured, cell_gain, compare, variant_set

from .conftest import run_cli
from .test_calibrated import real  # noqa: F401  (the bundled pair's calibration, a module fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

BENCHES, SIZES, ROUNDS = ("gsm8k", "humaneval"), (1, 4, 16), 4


def _synthetic(ratio_by_size: dict, noise: float, seed: int) -> BatchMeasured:
    """A and B throughputs per (benchmark, size, round): B = A x ratio(size) x (1 + uniform noise)."""
    rng = random.Random(seed)
    cells = [(b, n, r) for b in BENCHES for n in SIZES for r in range(ROUNDS)]
    a = {c: 100.0 * c[1] ** 0.5 * (1 + rng.uniform(-noise, noise)) for c in cells}
    b = {c: a[c] * ratio_by_size[c[1]] * (1 + rng.uniform(-noise, noise)) for c in cells}
    out = {c: (((1, 2),), ((1, 2),)) for c in cells}
    return BatchMeasured({"a": a, "b": b}, {"a": out, "b": dict(out)}, {}, {"a": (), "b": ()},
                         {"a": False, "b": False})


def test_gain_is_the_geometric_mean_over_benchmarks_and_sizes():
    m = _synthetic({1: 1.2, 4: 1.0, 16: 0.9}, noise=0.0, seed=0)
    gain, low, method = cell_gain(m.tps["a"], m.tps["b"])
    assert gain == pytest.approx((1.2 * 1.0 * 0.9) ** (1 / 3))
    assert method == "degenerate" and low == pytest.approx(gain)
    run = compare(m, "a", "b")
    assert run.per_size[1]["gain"] == pytest.approx(1.2) and run.per_size[16]["gain"] == pytest.approx(0.9)
    assert m.tokens_per_s("b", 4) / m.tokens_per_s("a", 4) == pytest.approx(1.0)


def test_a_real_gain_is_approved_and_a_vs_a_is_not():
    aa = compare(_synthetic({n: 1.0 for n in SIZES}, noise=0.004, seed=1), "a", "b")
    sigma = ctl.noise_from_aa(aa)
    assert 0 < sigma < 0.01
    assert not judge_batch(aa, sigma).approved
    real = compare(_synthetic({1: 1.10, 4: 1.06, 16: 1.04}, noise=0.004, seed=2), "a", "b")
    assert real.gain == pytest.approx((1.10 * 1.06 * 1.04) ** (1 / 3), rel=0.01)
    assert 1.04 < real.lower_bound < real.gain
    v = judge_batch(real, sigma)
    assert v.approved, v.reason
    assert v.bar == pytest.approx(ctl.BASE_BAR + 2 * sigma)
    tiny = compare(_synthetic({n: 1.005 for n in SIZES}, noise=0.004, seed=3), "a", "b")  # below 1% + 2σ
    assert not judge_batch(tiny, sigma).approved


def test_different_output_is_rejected_whatever_the_gain():
    m = _synthetic({n: 1.5 for n in SIZES}, noise=0.004, seed=4)
    cell = next(iter(m.outputs["b"]))
    m.outputs["b"][cell] = (((1, 3),), ((1, 2),))
    v = judge_batch(compare(m, "a", "b"), 0.001)
    assert not v.approved and "differs" in v.reason


def test_outside_float32_a_different_output_needs_forcing_and_the_3_percent_bar():
    m = _synthetic({n: 1.10 for n in SIZES}, noise=0.004, seed=6)
    cell = next(iter(m.outputs["b"]))
    m.outputs["b"][cell] = (((1, 3),), ((1, 2),))
    run = compare(m, "a", "b")
    assert not judge_batch(run, 0.001, exact=False).approved  # forcing not run
    assert not judge_batch(run, 0.001, exact=False, forcing_passed=False).approved
    v = judge_batch(run, 0.001, exact=False, forcing_passed=True)
    assert v.approved and v.bar == pytest.approx(ctl.CHANGED_OUTPUT_BAR)
    small = compare(_synthetic({n: 1.02 for n in SIZES}, noise=0.002, seed=7), "a", "b")
    small = type(small)(**{**small.__dict__, "outputs_differ": True})
    assert not judge_batch(small, 0.001, exact=False, forcing_passed=True).approved  # 2% < the 3% bar
    # float32: parting at rounding ties only (the tie audit passed) is a lossless output: the 1% + 2σ bar
    v = judge_batch(small, 0.001, exact=True, forcing_passed=True)
    assert v.approved and v.bar == pytest.approx(ctl.BASE_BAR + 0.002), v.reason
    for audit in (None, False):  # not audited, or a token beyond a tie: a broken engine
        v = judge_batch(run, 0.001, exact=True, forcing_passed=audit)
        assert not v.approved and "beyond float32 rounding ties" in v.reason


def test_float32_rounding_ties_pass_ar_and_fail_a_planted_wrong_token():
    """The float32 audit of outputs that part from the incumbent's (``BatchMeasured.differing``, ``rounding_ties``):
    AR's own batched outputs are the scorer's argmax to rounding; a token one id off is nats below it."""
    from specpilot.pilot.forcing import F32_TIE, Scorer, rounding_ties

    dep, prompts, ar, bad = _ar_and_a_planted_token()
    cell = ("b", 2, 0)
    m = BatchMeasured({}, {"ar": {cell: (ar, ar)}, "x": {cell: (ar, bad)}}, {cell: (prompts, prompts)}, {}, {})
    assert m.differing("ar", "ar") == [] and m.differing("ar", "x") == [(prompts[0], bad[0], "b")]
    scorer = Scorer(dep.target)
    ok = rounding_ties(scorer, [(p, o, "b") for p, o in zip(prompts, ar)])
    assert ok["passed"] and ok["tokens"] == 16 and ok["largest_margin"] <= F32_TIE and not ok["reasons"]
    got = rounding_ties(scorer, m.differing("ar", "x"))
    assert not got["passed"] and got["largest_margin"] > 100 * F32_TIE and "nats below" in got["reasons"][0]


def _ar_and_a_planted_token():
    """The bundled target, two prompts, their batched AR outputs (8 tokens) and a copy with token 3 of the first
    one id off (a token the scorer rates far below its argmax)."""
    from specpilot.engine.deployment import Deployment
    from specpilot.zoo import bundled_target_dir

    dep = Deployment(bundled_target_dir())
    prompts = ((5, 6, 7, 8), (9, 10, 11))
    ar = tuple(tuple(g.tokens) for g in dep.batch_system(SystemConfig.ar(), max_num_seqs=2).generate_all(
        [list(p) for p in prompts], 8))
    return dep, prompts, ar, (ar[0][:3] + ((ar[0][3] + 1) % 4096,) + ar[0][4:], ar[1])


def test_batch_forcing_catches_a_planted_wrong_token():
    """δ and stock's figures from batched AR and stock outputs; a candidate whose outputs carry a token the
    scorer rates far below its argmax fails the events rule."""
    from specpilot.pilot.forcing import Scorer

    dep, prompts, ar, bad = _ar_and_a_planted_token()
    cell = ("b", 2, 0)
    p0 = BatchMeasured({}, {"ar": {cell: (ar, ar)}, "stock": {cell: (ar, ar)}, "x": {cell: (bad, bad)}},
                       {cell: (prompts, prompts)}, {}, {})
    f = BatchForcing(Scorer(dep.target), p0)
    assert f.delta == 0.125 and f.stock.mismatches == 0
    assert f.check(p0, "stock")["passed"]
    res = f.check(p0, "x")
    assert not res["passed"] and res["events"] >= 2


class _TieScorer:
    """A stand-in scorer whose argmax is token 0 everywhere; any other token is a mismatch of margin 0.1 nats."""

    class model:  # noqa: N801  (what BatchForcing reads of a scorer's model)
        dtype = "torch.float32"

    def score(self, prompt, out):
        import numpy as np

        from specpilot.pilot.forcing import TokenScores

        t = np.asarray(out, dtype=np.int64)
        return TokenScores(t, np.zeros_like(t), np.where(t == 0, 0.0, 0.1))


def test_batch_forcing_judges_a_candidate_against_stock_at_its_own_size():
    """Stock's figures at one size, not pooled over every size: at size 1 stock (as AR) mismatches on half its
    tokens, at size 2 on none and with ten times the tokens; a candidate at size 1 that mismatches as often as
    stock there passes, while against the pooled figures (9% mismatches, a small error) it would fail."""
    half, zeros = (1, 0) * 10, (0,) * 50
    c1, c2 = ("b", 1, 0), ("b", 2, 0)
    out1, out2 = ((half,), (half,)), ((zeros,) * 4, (zeros,) * 4)
    prompts = {c1: (((5,),), ((6,),)), c2: (((5,),) * 4, ((6,),) * 4)}
    p0 = BatchMeasured({}, {"ar": {c1: out1, c2: out2}, "stock": {c1: out1, c2: out2}, "x": {c1: out1, c2: out2}},
                       prompts, {}, {})
    f = BatchForcing(_TieScorer(), p0)
    assert f.delta == 0.125 and f.by_size[1].mismatch_rate == 0.5 and f.by_size[2].mismatch_rate == 0.0
    assert f.stock.tokens == 440 and f.stock.mismatches == 20
    at1 = f.check(p0.at(1), "x", 1)
    assert at1["passed"] and at1["stock_tokens"] == 40
    pooled = f.check(p0.at(1), "x")
    assert not pooled["passed"] and "mismatch rate" in pooled["reasons"][0]
    assert f.phase0["stock_by_size"]["1"]["mismatch_rate"] == 0.5


def test_one_round_has_no_bound_and_is_rejected():
    m = _synthetic({n: 1.5 for n in SIZES}, noise=0.004, seed=5)
    for k in ("a", "b"):
        m.tps[k] = {c: t for c, t in m.tps[k].items() if c[2] == 0}
        m.outputs[k] = {c: o for c, o in m.outputs[k].items() if c[2] == 0}
    run = compare(m, "a", "b")
    assert math.isnan(run.lower_bound) and not judge_batch(run, 0.001).approved


def test_variant_set_cycles_to_the_batch_size_with_fresh_salts():
    from specpilot.pilot.paired import Req, _salter

    reqs = [Req("b", i, (10 + i, 20), 4) for i in range(2)]
    salted = _salter(100, (), random.Random(0))
    prompts = variant_set(reqs, 5, salted)
    assert len(prompts) == 5 and len(set(prompts)) == 5
    assert [p[4:] for p in prompts] == [(10, 20), (11, 20), (10, 20), (11, 20), (10, 20)]
    assert len(variant_set(reqs, 1, salted)) == 2


def test_candidates_follow_the_incumbent():
    names = [n for n, _, _ in MECHANISMS]
    stock = SystemConfig.stock("draft_model", depth=6)
    bf = dict(zip(names, [m(stock) for _, _, m in MECHANISMS]))
    assert bf["best_first"].tree == "best_first" and bf["best_first"].nodes == stock.nodes
    assert bf["shared_budget"].tree == "best_first" and bf["shared_budget"].row_selection == "shared_budget"
    assert bf["drafter_block"].drafter_block == (6, 5, 3)
    assert bf["prompt_admission"].prompt_admission > 0
    shared = MECHANISMS[names.index("shared_budget")][2](bf["best_first"])
    assert shared.row_selection == "shared_budget"
    assert MECHANISMS[2][2](SystemConfig.stock("block", depth=16)).drafter_block == (16, 12, 8)
    assert all(m(SystemConfig.ar()) is None for n, _, m in MECHANISMS if n != "prompt_admission")
    (name, _, head), = CPU_MECHANISMS  # the certified head: built on AR too, a float32 target's only
    assert head(SystemConfig.ar()).lm_head_int8 and head(SystemConfig.ar(dtype="bfloat16")) is None
    assert head(SystemConfig.ar(lm_head_int8=True)) is None and name == "lm_head_int8"
    big = torch.ones(1, 1).expand(49152, 576)  # SmolLM2's head shape
    assert mechanisms_for("cuda", big) == MECHANISMS and mechanisms_for("cpu", big[:64]) == MECHANISMS
    assert mechanisms_for("cpu", big) == MECHANISMS + CPU_MECHANISMS


@pytest.mark.parametrize("text", ["", "0,2", "1,1", "a", "4,-1"])
def test_bad_sizes_are_one_line_errors(text):
    with pytest.raises(SpecPilotError, match="--batch"):
        parse_sizes(text)
    assert parse_sizes("1,4,16") == (1, 4, 16)


def test_cli_refuses_bad_sizes_and_options_before_loading(monkeypatch, capsys, tmp_path):
    code, _, err = run_cli(monkeypatch, capsys, "pilot", "--batch", "1,2", "--adversarial", "--out",
                           str(tmp_path / "r"))
    assert code != 0 and "--adversarial" in err and "Traceback" not in err
    code, _, err = run_cli(monkeypatch, capsys, "pilot", "--batch", "1,x", "--out", str(tmp_path / "r2"))
    assert code != 0 and "--batch" in err and "Traceback" not in err
    single = tmp_path / "single"  # a single-request run's directory: the malformed sizes are named first
    single.mkdir()
    (single / "report.json").write_text("{}")
    (single / "system.json").write_text("{}")
    code, _, err = run_cli(monkeypatch, capsys, "pilot", "--batch", "0", "--out", str(single))
    assert code != 0 and "--batch '0'" in err and "Traceback" not in err


def test_cli_batch_reaches_the_batched_pilot(monkeypatch, capsys, tmp_path):
    import specpilot.pilot.batch_pilot as bp
    import specpilot.pilot.run as run

    seen = []
    monkeypatch.setattr(bp, "run_batch_pilot", lambda opts, sizes: seen.append((opts, sizes)))
    monkeypatch.setattr(run, "run_pilot", lambda opts: pytest.fail("the single-request pilot ran"))
    code, _, err = run_cli(monkeypatch, capsys, "pilot", "--batch", "1,4,16", "--quick", "--max-new-tokens", "8",
                           "--out", str(tmp_path / "r"))
    assert code == 0, err
    assert seen[0][1] == (1, 4, 16) and seen[0][0].plan["max_new_tokens"] == 8


def test_the_result_line_goes_to_stdout(monkeypatch, capsys, tmp_path):
    """The console is stderr; the pilot's result is one stdout line, so `specpilot pilot > result.txt` keeps it."""
    import specpilot.pilot.batch_pilot as bp
    import specpilot.pilot.run as run

    single = {"sealed_label": "ngram/best_first N=8 D=8 k=2", "speedup_vs_ar": 1.7342, "speedup_ci_low": 1.4971}
    monkeypatch.setattr(run, "run_pilot", lambda opts: single)
    code, out, err = run_cli(monkeypatch, capsys, "pilot", "--quick", "--out", str(tmp_path / "s"))
    assert code == 0, err
    assert out.strip() == f"sealed ngram/best_first N=8 D=8 k=2: 1.734x AR (lower bound 1.497); report {tmp_path / 's'}/report.md"
    batched = {"per_size": {"1": {"sealed_label": "AR", "sealed_vs_ar": 1.0}, "4": {"sealed_label": "S", "sealed_vs_ar": 1.25}}}
    monkeypatch.setattr(bp, "run_batch_pilot", lambda opts, sizes: batched)
    code, out, err = run_cli(monkeypatch, capsys, "pilot", "--batch", "1,4", "--quick", "--out", str(tmp_path / "b"))
    assert code == 0, err
    assert out.strip() == f"sealed n=1: AR 1.000x AR; n=4: S 1.250x AR; report {tmp_path / 'b'}/batch_report.md"


def test_bfloat16_batch_run_is_token_forced(tmp_path):
    """Outside float32 outputs may differ from AR's; every differing candidate is token-forced, the sealed system
    too, with δ and stock's figures from Phase 0's batched outputs."""
    from specpilot.pilot.state import PilotOptions
    from specpilot.zoo import bundled_target_dir

    out = tmp_path / "bf16"
    opts = PilotOptions(target=bundled_target_dir(), out=out, quick=True, dtype="bfloat16",
                        overrides={"per_benchmark": 2, "max_new_tokens": 8, "benchmarks": 1})
    rep = run_batch_pilot(opts, (1, 2), rounds=2, rng=random.Random(1))
    tf = rep["token_forcing"]
    assert tf["delta"] >= 0.125 and tf["stock"]["tokens"] > 0 and tf["sealed"]["tokens"] > 0
    for v in rep["verdicts"]:
        if "run" in v:  # audited exactly when the output differed from the incumbent's
            assert (v["token_forcing"] is not None) == v["run"]["outputs_differ"]
            if v["run"]["outputs_differ"]:
                assert v["bar"] >= ctl.CHANGED_OUTPUT_BAR
    assert "Token forcing" in (out / "batch_report.md").read_text()


def test_expected_duration_prices_each_candidate_as_one_phase0_measurement():
    assert expected_rest_s(120.0, 4) == pytest.approx(60.0 * 5.5)  # 4 two-system runs + the 3-system seal
    assert expected_rest_s(0.0, 4) == 0.0


def test_quick_batch_run_end_to_end(tmp_path, capsys):
    from specpilot.pilot.state import PilotOptions
    from specpilot.zoo import bundled_drafter_dir, bundled_target_dir

    out = tmp_path / "r"
    opts = PilotOptions(target=bundled_target_dir(), drafter=bundled_drafter_dir(), out=out, quick=True,
                        overrides={"per_benchmark": 2, "max_new_tokens": 8, "benchmarks": 1})
    run_batch_pilot(opts, (1, 2), rounds=2, rng=random.Random(0))
    rep = json.loads((out / "batch_report.json").read_text())
    for key in ("device", "versions", "commit", "deployment", "sizes", "rounds", "sigma", "phase0", "per_size",
                "speedup_vs_ar", "speedup_vs_ar_low", "speedup_vs_stock", "speedup_vs_stock_low", "verdicts",
                "outputs_equal_ar", "sealed_label", "approval_rule", "method"):
        assert key in rep, key
    assert rep["sizes"] == [1, 2] and rep["deployment"]["batch"] == [1, 2]
    for n in ("1", "2"):
        row = rep["per_size"][n]
        assert all(row[f"{k}_tokens_per_s"] > 0 for k in ("ar", "stock", "sealed"))
        assert row["phase0_stock_vs_ar"] > 0 and row["sealed_vs_stock"] > 0
    assert rep["outputs_equal_ar"] == {"stock": True, "sealed": True}
    ties = rep["token_forcing"]["sealed"]  # float32: the rounding-tie audit of outputs parting from AR's (none here)
    assert ties["rule"] == "float32 rounding ties" and ties["passed"] and ties["tokens"] == 0
    assert "Float32 rounding ties: 0 tokens" in (out / "batch_report.md").read_text()
    judged = [v for v in rep["verdicts"] if "skipped" not in v]
    assert judged and all(not v["run"]["outputs_differ"] for v in judged)  # lossless: every candidate equals AR
    assert {v["mechanism"] for v in rep["verdicts"]} == {"stock", *(n for n, _, _ in MECHANISMS)}  # a small head
    system = json.loads((out / "system.json").read_text())
    assert system["label"] == rep["sealed_label"] and SystemConfig(**system["config"]).seal() == system["seal"]
    assert system == json.loads((out / "system_n1.json").read_text())  # system.json: the smallest size's
    assert json.loads((out / "system_n2.json").read_text())["batch_size"] == 2
    assert "## 2 requests at once" in (out / "batch_report.md").read_text()
    assert "expected duration: about" in capsys.readouterr().err  # the console is stderr


def test_a_calibration_adds_the_simulated_drafter_first(real, tmp_path):  # noqa: F811
    """--calibration: the calibrated drafter (SIMULATED acceptance) is the first candidate, a best-first tree of
    stock's nodes within what the calibration measured; lossless in float32, so its batched outputs equal AR's."""
    import copy

    from specpilot.pilot.batch_pilot import calibrated_mechanism
    from specpilot.pilot.state import PilotOptions
    from specpilot.spec.calibration import save_calibration
    from specpilot.zoo import bundled_target_dir

    cal = copy.deepcopy(real[1])
    cal.cost = None  # acceptance only: nothing here is a timing figure
    path = save_calibration(cal, tmp_path / "cal.json")
    stock = SystemConfig.stock("ngram", depth=6)
    name, _, make = calibrated_mechanism(path, stock)
    cfg = make(stock)
    assert name == "calibrated" and cfg.drafter == "calibrated" and cfg.tree == "best_first"
    assert cfg.nodes == stock.nodes and cfg.depth <= cal.depth and cfg.top_k <= cal.top_k and make(cfg) is None
    opts = PilotOptions(target=bundled_target_dir(), out=tmp_path / "r", quick=True, calibration=path,
                        overrides={"per_benchmark": 2, "max_new_tokens": 8, "benchmarks": 1})
    rep = run_batch_pilot(opts, (1, 2), rounds=2, rng=random.Random(2))
    vs = [v for v in rep["verdicts"] if v["mechanism"] == "calibrated"]
    assert sorted(v["size"] for v in vs) == [1, 2]  # judged at each size
    assert all("run" in v and not v["run"]["outputs_differ"] for v in vs)
    assert rep["outputs_equal_ar"] == {"stock": True, "sealed": True}


def test_learned_drafters_given_are_judged_as_drafter_swaps(tmp_path, monkeypatch, capsys):
    """--block / --eagle3 with --batch: each checkpoint is one drafter-swap candidate (a best-first tree of stock's
    nodes), judged at every size before the row choices; lossless in float32. The bundled target's default block
    drafters are the single-request pilot's only: a batched run judges the checkpoints named."""
    import torch

    from specpilot.model.checkpoint import read_args
    from specpilot.pilot.batch_mechanisms import learned_mechanism
    from specpilot.pilot.state import PilotOptions
    from specpilot.spec.eagle3 import save_eagle3
    from specpilot.spec.train_eagle3 import new_eagle3_net
    from specpilot.zoo import bundled_block_dir, bundled_target_dir

    stock = SystemConfig.stock("ngram", depth=6)
    cfg = learned_mechanism("block", "B", stock, block_size=4)[2](stock)
    assert (cfg.drafter, cfg.drafter_path, cfg.tree, cfg.nodes, cfg.depth, cfg.top_k) == ("block", "B", "best_first",
                                                                                         6, 4, 4)
    assert learned_mechanism("block", "B", stock, block_size=4)[2](cfg) is None  # already that checkpoint
    assert learned_mechanism("block", "C", stock, block_size=16)[2](cfg).depth == 6  # another checkpoint: a swap
    with pytest.raises(ValueError):
        learned_mechanism("block", "B", stock)
    args = read_args(bundled_target_dir())
    torch.manual_seed(0)  # an untrained head: acceptance aside, the swap is judged and lossless like a trained one
    net = new_eagle3_net(args, [0, args.num_layers // 2, args.num_layers - 1], torch.arange(args.vocab_size))
    e3 = save_eagle3(net, tmp_path / "e3", dtype=torch.float32)
    opts = PilotOptions(target=bundled_target_dir(), out=tmp_path / "r", quick=True, blocks=(bundled_block_dir(),),
                        eagle3=(e3,), overrides={"per_benchmark": 2, "max_new_tokens": 8, "benchmarks": 1})
    rep = run_batch_pilot(opts, (1, 2), rounds=2, rng=random.Random(3))
    names = [v["mechanism"] for v in rep["verdicts"]]
    assert names.index("block") < names.index("eagle3") < names.index("best_first")
    for kind in ("block", "eagle3"):
        vs = [v for v in rep["verdicts"] if v["mechanism"] == kind]
        assert sorted(v["size"] for v in vs) == [1, 2] and all("run" in v and not v["run"]["outputs_differ"]
                                                               for v in vs)
    assert rep["outputs_equal_ar"] == {"stock": True, "sealed": True}
    seen = []
    import specpilot.pilot.batch_pilot as bp

    monkeypatch.setattr(bp, "run_batch_pilot", lambda o, sizes: seen.append(o))
    code, _, err = run_cli(monkeypatch, capsys, "pilot", "--batch", "1", "--quick", "--out", str(tmp_path / "c"))
    assert code == 0, err
    assert seen[0].blocks == () and seen[0].eagle3 == ()


def test_compiled_batch_run_measures_the_compiled_pass_and_compiles_once(tmp_path, monkeypatch, capsys):
    """``--compile``: every engine of the run (AR, stock, candidates, seal) and the shared budget's pass table run
    the target's compiled stack, built once; outputs still equal AR's in float32; the report says how to serve it."""
    from specpilot.model import compiled_stack as cs
    from specpilot.pilot.state import PilotOptions
    from specpilot.zoo import bundled_target_dir

    built, passes = [], []
    real_init, real_fwd = cs.CompiledStack.__init__, cs.CompiledStack.forward_batch
    monkeypatch.setattr(cs.CompiledStack, "__init__", lambda self, t: built.append(t) or real_init(self, t))
    monkeypatch.setattr(cs.CompiledStack, "forward_batch", lambda self, *a, **k: passes.append(1) or
                        real_fwd(self, *a, **k))
    out = tmp_path / "c"
    opts = PilotOptions(target=bundled_target_dir(), out=out, quick=True, compile_cpu=True,
                        overrides={"per_benchmark": 2, "max_new_tokens": 8, "benchmarks": 1})
    rep = run_batch_pilot(opts, (1, 2), rounds=2, rng=random.Random(6))
    assert len(built) == 1 and len(passes) > 100  # one stack for the run; the pass table and every batch run
    assert rep["compiled"] is True and rep["outputs_equal_ar"] == {"stock": True, "sealed": True}
    assert "`specpilot serve --compile --system" in (out / "batch_report.md").read_text()
    assert json.loads((out / "journal.json").read_text())["header"]["compile_cpu"] is True
    code, _, err = run_cli(monkeypatch, capsys, "pilot", "--compile", "--out", str(tmp_path / "x"))
    assert code != 0 and "needs --batch" in err and "Traceback" not in err


def test_a_thread_left_running_counts_but_torch_compiles_progress_monitor_does_not():
    """A system's run that leaves a thread is judged as work outside the timed region; tqdm's monitor thread, which
    an Inductor compile (``--compile``) starts and leaves idle, is not."""
    import threading
    from types import SimpleNamespace

    from specpilot.pilot.batch_runs import timed_batch

    stop = threading.Event()

    def run_leaving(name):
        def generate_all(prompts, max_new):
            threading.Thread(target=stop.wait, name=name, daemon=True).start()
            return [SimpleNamespace(tokens=[1, 2]) for _ in prompts]
        return SimpleNamespace(drafters=(), generate_all=generate_all)

    try:
        assert timed_batch(run_leaving("tqdm_monitor"), [[3, 4]], 2)[2] == set()
        assert timed_batch(run_leaving("prefetch"), [[3, 4]], 2)[2] == {"prefetch"}
    finally:
        stop.set()


def test_inductors_compile_pool_is_a_library_thread_but_a_systems_own_executor_is_not(monkeypatch):
    """The first CPU-stack compile starts Inductor's compile pool (threads named ``ThreadPoolExecutor-N_M``, idle
    afterwards): not work the system left running. A system's own executor, named alike, still is."""
    import functools
    import sys
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from types import ModuleType

    from specpilot.pilot.paired import new_threads

    pool = ThreadPoolExecutor(2)

    class AsyncCompile:
        @staticmethod
        @functools.lru_cache(1)
        def pool():
            return pool

    fake = ModuleType("torch._inductor.async_compile")
    fake.AsyncCompile = AsyncCompile
    monkeypatch.setitem(sys.modules, "torch._inductor.async_compile", fake)
    own = ThreadPoolExecutor(1)
    stop = threading.Event()
    try:
        before = set(threading.enumerate())
        assert new_threads(before) == set()  # the pool not made yet: nothing to exclude, nothing new
        AsyncCompile.pool().submit(stop.wait, 0.01).result()
        assert pool._threads and new_threads(before) == set()
        own.submit(stop.wait, 0.01).result()
        (mine,) = own._threads
        assert new_threads(before) == {mine.name} and mine.name.startswith("ThreadPoolExecutor-")
    finally:
        stop.set()
        pool.shutdown()
        own.shutdown()



def test_phase0_stock_beyond_rounding_ties_stops_the_run_as_a_broken_engine(tmp_path, monkeypatch):
    """float32: stock may part from AR's outputs at rounding ties only; a planted token nats below the argmax in
    stock's Phase 0 output stops the run before any candidate is judged."""
    import specpilot.pilot.batch_pilot as bp
    from specpilot.pilot.state import PilotOptions
    from specpilot.zoo import bundled_target_dir

    real_measure = bp.measure_batches

    def planted(makers, *a, **kw):
        m = real_measure(makers, *a, **kw)
        if "stock" in makers:
            cell = next(iter(m.outputs["stock"]))
            first, *rest = m.outputs["stock"][cell]
            out0 = first[0]
            first = ((out0[:1] + ((out0[1] + 7) % 4096,) + out0[2:]),) + tuple(first[1:])
            m.outputs["stock"][cell] = (first, *rest)
        return m

    monkeypatch.setattr(bp, "measure_batches", planted)
    opts = PilotOptions(target=bundled_target_dir(), out=tmp_path / "r", quick=True,
                        overrides={"per_benchmark": 2, "max_new_tokens": 4, "benchmarks": 1})
    with pytest.raises(SpecPilotError, match="beyond rounding ties .*nats below.*the engine is broken"):
        run_batch_pilot(opts, (1, 2), rounds=2, rng=random.Random(5))
