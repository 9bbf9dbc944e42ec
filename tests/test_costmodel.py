"""Cost model, byte floor, ceiling and step profiler (seed paper §3.2)."""

import math
import time

import pytest
import torch

from specpilot.model.args import ModelArgs
from specpilot.model.transformer import Transformer
from specpilot.pilot import profiler as prof_mod
from specpilot.pilot.costmodel import (
    Ceiling,
    ClassCost,
    CostModel,
    build_ceiling,
    byte_floor_ms,
    floors_ms,
    pass_counts,
    pass_launches,
    step_counts,
)
from specpilot.pilot.profiler import DevicePeaks, StepProfiler, measure_peaks


def tiny_args(**kw):
    base = dict(model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                n_heads=4, n_kv_heads=2, head_dim=16, qk_norm=True)
    base.update(kw)
    return ModelArgs(**base)


def test_counts_match_hand_computed():
    # R = 8 rows, L = 10 prefix slots, fp32 (4 bytes); h=64, I=128, H=4, KV=2, d=16, V=128, 2 layers.
    c = step_counts(tiny_args(), rows=8, prefix_len=10, dtype_bytes=4)
    assert set(c) == {"projections", "attention", "norms_elementwise", "lm_head", "other"}
    # per layer: q 64->64, k,v 64->32, o 64->64, gate,up 64->128, down 128->64
    # FLOPs 2*8*(4096 + 2048 + 2048 + 4096 + 3*8192) = 589824 per layer
    # bytes 4*[(4096+8*128)*2 + (2048+8*96)*2 + (8192+8*192)*3] = 180224 per layer
    assert c["projections"] == (2 * 589824, 2 * 180224)
    # attention: S = 18; FLOPs 4*8*18*4*16 = 36864; bytes 4*(2*18*2*16 + 2*8*2*16 + 2*8*4*16) = 10752
    assert c["attention"] == (2 * 36864, 2 * 10752)
    # LM head 64->128: FLOPs 2*8*64*128, bytes 4*(64*128 + 8*(64+128))
    assert c["lm_head"] == (131072, 38912)
    # embedding lookup: read + write 8 rows of 64
    assert c["other"] == (0, 4096)
    # norms/elementwise per layer elements: norms 4*512+2*64, residuals 6*512, rope 2*768, swiglu 3*1024,
    # qk norm 2*768+2*16 = 11424; plus final norm 2*512+64 -> bytes 4*(2*11424 + 1088)
    assert c["norms_elementwise"] == (2 * 15616 + 2048, 4 * (2 * 11424 + 1088))


def test_counts_scale_and_bias():
    a = tiny_args()
    one, two = pass_counts(a, 8, 10, 2), pass_counts(a, 8, 10, 4)
    assert all(two[k][1] == 2 * one[k][1] and two[k][0] == one[k][0] for k in one)
    # weights dominate projection bytes at R=1: weights are read once whatever the rows
    r1, r64 = pass_counts(a, 1, 0, 2)["projections"], pass_counts(a, 64, 0, 2)["projections"]
    assert r64[0] == 64 * r1[0] and r64[1] < 64 * r1[1]
    biased = pass_counts(tiny_args(attention_bias=True), 8, 10, 4)["projections"][1]
    assert biased - two["projections"][1] == 2 * 4 * (64 + 32 + 32)  # q,k,v biases, 2 layers
    with pytest.raises(ValueError):
        pass_counts(a, 0, 0, 2)


def test_drafter_counted_under_drafter():
    a, d = tiny_args(), tiny_args(num_layers=1)
    base = step_counts(a, 8, 10, 2)
    c = step_counts(a, 8, 10, 2, drafter_args=d, drafter_rows=4, drafter_passes=3)
    one = pass_counts(d, 4, 10, 2)
    assert c["drafter"] == (3 * sum(f for f, _ in one.values()), 3 * sum(b for _, b in one.values()))
    assert {k: v for k, v in c.items() if k != "drafter"} == base
    no_head = step_counts(a, 8, 10, 2, drafter_args=d, drafter_rows=4, drafter_passes=3, drafter_lm_head=False)
    assert no_head["drafter"][1] == c["drafter"][1] - 3 * one["lm_head"][1]


def test_byte_floor_picks_larger_term():
    p = DevicePeaks(flops_per_s=1e9, bytes_per_s=1e9, device_name="fake", method="test")
    assert byte_floor_ms(6e8, 0, p) == pytest.approx(1000.0)  # 6e8 / (0.6 * 1e9) s
    assert byte_floor_ms(0, 9e8, p) == pytest.approx(1000.0)  # 9e8 / (0.9 * 1e9) s
    assert byte_floor_ms(1.2e9, 9e8, p) == pytest.approx(2000.0)  # compute-bound
    assert byte_floor_ms(6e8, 1.8e9, p) == pytest.approx(2000.0)  # memory-bound
    fl = floors_ms({"a": (6e8, 0), "b": (0, 1.8e9)}, p)
    assert fl == pytest.approx({"a": 1000.0, "b": 2000.0})
    with pytest.raises(ValueError):
        byte_floor_ms(1, 1, DevicePeaks(0.0, 1e9, "x", "x"))


def test_nested_regions_do_not_double_count(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(prof_mod, "_clock", lambda: now[0])
    p = StepProfiler("cpu")
    with p.region("other"):
        now[0] += 0.010
        with p.region("drafter"):
            now[0] += 0.030
            with p.region("attention"):
                now[0] += 0.005
            now[0] += 0.001
        now[0] += 0.002
    t = p.totals_ms()
    assert t == pytest.approx({"other": 12.0, "drafter": 31.0, "attention": 5.0})
    assert p.total_ms() == pytest.approx(48.0)  # equals the outer wall time
    assert p.calls() == {"other": 1, "drafter": 1, "attention": 1}
    with pytest.raises(KeyError), p.region("x"):  # closed on an exception
        now[0] += 0.001
        raise KeyError
    assert p.totals_ms()["x"] == pytest.approx(1.0)
    p.reset()
    assert p.totals_ms() == {} and p.calls() == {}


@torch.no_grad()
def test_profiler_covers_a_forward_pass():
    torch.manual_seed(0)
    m = Transformer(tiny_args())
    cache = m.new_cache(64)
    toks = torch.arange(8)
    p = StepProfiler("cpu")
    for _ in range(3):  # warm-up
        m.logits(m.forward(toks, toks, cache, 0, prof=p), prof=p)
    best = None
    for _ in range(5):
        p.reset()
        t0 = time.perf_counter()
        m.logits(m.forward(toks, toks, cache, 0, prof=p), prof=p)
        wall = (time.perf_counter() - t0) * 1e3
        frac = p.total_ms() / wall
        best = frac if best is None else max(best, frac)
        assert frac <= 1.0 + 1e-9
    assert best > 0.6  # the regions cover most of the pass (residual adds run outside any region)
    assert set(p.totals_ms()) == {"projections", "attention", "norms_elementwise", "lm_head", "other"}
    assert all(v > 0 for v in p.totals_ms().values())
    # per layer: q/k/v, o, gate/up, down; input norm, q/k norm + rope, swiglu, post norm; + final norm
    assert p.calls() == {"other": 1, "projections": 8, "norms_elementwise": 9, "attention": 2, "lm_head": 1}


def test_measure_peaks_small():
    pk = measure_peaks("cpu", seconds_budget=0.05, matmul_n=128, copy_bytes=4 << 20)
    assert pk.flops_per_s > 1e6 and pk.bytes_per_s > 1e6
    assert "128x128x128" in pk.method and pk.device_name
    assert set(pk.to_dict()) == {"flops_per_s", "bytes_per_s", "device_name", "method", "launch_s"}
    assert 1e-8 < pk.launch_s < 1e-3 and "one-element adds" in pk.method


def test_launch_floor_binds_a_launch_bound_pass():
    """A small target's pass is bound by its launches, not its bytes: the floor takes the larger."""
    args = tiny_args()
    fused, eager = pass_launches(args, True), pass_launches(args, False)
    assert fused == {"projections": 8, "attention": 2, "norms_elementwise": 9, "other": 1, "lm_head": 2}
    assert all(eager[k] >= fused[k] for k in fused) and "lm_head" not in pass_launches(args, True, lm_head=False)
    peaks = DevicePeaks(1e15, 4e12, "fake", "test", launch_s=2e-6)
    counts = pass_counts(args, 1, 100, 2)
    plain, floored = floors_ms(counts, peaks), floors_ms(counts, peaks, fused)
    assert floored["projections"] == pytest.approx(8 * 2e-3) and floored["projections"] > plain["projections"]
    assert all(floored[k] >= plain[k] for k in counts)
    assert byte_floor_ms(1e12, 0, peaks, launches=3) == byte_floor_ms(1e12, 0, peaks)  # compute-bound: unchanged


def _ceiling(**kw):
    classes = {
        "projections": ClassCost(measured_ms=6.0, floor_ms=3.0, flops=1e9, bytes=2e9),
        "attention": ClassCost(measured_ms=2.0, floor_ms=1.0, flops=1e8, bytes=1e8),
        "other": ClassCost(measured_ms=2.0, floor_ms=0.0, flops=0, bytes=0),
    }
    args = dict(tau_current=4.0, tau_best=6.0, step_ms=12.0, classes=classes,
                cost=CostModel(tau=4.0, step_ms=12.0, ar_ms=8.0, rows=16))
    args.update(kw)
    return Ceiling(**args)


def test_ceiling_factors_multiply():
    c = _ceiling()
    assert c.profiled_ms == 10.0 and c.floor_ms == 4.0
    assert (c.tree, c.kernel, c.outside) == pytest.approx((1.5, 2.5, 1.2))
    assert c.ceiling == pytest.approx(c.tree * c.kernel * c.outside) == pytest.approx(4.5)
    assert c.largest_factor() == "kernel"
    assert _ceiling(tau_best=16.0).largest_factor() == "tree"
    assert _ceiling(step_ms=40.0).largest_factor() == "outside"
    # c(N) = 12 / 8, speedup = 4 / 1.5; ceiling speedup = tau_best * T_AR / floor
    assert c.cost.c == pytest.approx(1.5) and c.cost.speedup == pytest.approx(4 / 1.5)
    assert c.ceiling_speedup == pytest.approx(6.0 * 8.0 / 4.0)
    d = c.to_dict()
    assert d["factors"] == pytest.approx({"tree": 1.5, "kernel": 2.5, "outside": 1.2})
    assert d["ceiling"] == pytest.approx(4.5) and d["largest_factor"] == "kernel"
    assert d["classes"]["projections"] == {"measured_ms": 6.0, "floor_ms": 3.0, "flops": 1e9, "bytes": 2e9,
                                           "ratio": 2.0}
    assert d["classes"]["other"]["ratio"] is None
    assert d["cost"]["speedup"] == pytest.approx(4 / 1.5) and math.isfinite(d["ceiling_speedup"])


def test_ceiling_guards():
    for bad in (dict(step_ms=0.0), dict(tau_current=-1.0), dict(tau_best=float("nan")),
                dict(classes={"other": ClassCost(0.0, 1.0, 1, 1)}),
                dict(classes={"other": ClassCost(1.0, 0.0, 0, 0)})):
        with pytest.raises(ValueError):
            _ceiling(**bad)
    with pytest.raises(ValueError):
        CostModel(tau=2.0, step_ms=1.0, ar_ms=0.0)


def test_build_ceiling_from_profile():
    peaks = DevicePeaks(flops_per_s=1e12, bytes_per_s=1e11, device_name="fake", method="test")
    counts = step_counts(tiny_args(), 8, 10, 2, drafter_args=tiny_args(num_layers=1))
    totals = {"projections": 4.0, "attention": 2.0, "lm_head": 1.0, "drafter": 1.0, "other": 2.0}
    c = build_ceiling(totals, counts, peaks, step_ms=6.0, tau_current=2.0, tau_best=3.0, steps=2, ar_ms=4.0)
    assert c.profiled_ms == pytest.approx(5.0)  # per step
    assert c.outside == pytest.approx(6.0 / 5.0)
    assert list(c.classes) == ["projections", "attention", "norms_elementwise", "lm_head", "drafter", "other"]
    assert c.classes["norms_elementwise"].measured_ms == 0.0 and c.classes["norms_elementwise"].floor_ms > 0
    assert c.floor_ms == pytest.approx(sum(floors_ms(counts, peaks).values()))
    assert c.ceiling == pytest.approx(c.tree * c.kernel * c.outside)
    with pytest.raises(ValueError):
        build_ceiling(totals, counts, peaks, 6.0, 2.0, 3.0, steps=0)
