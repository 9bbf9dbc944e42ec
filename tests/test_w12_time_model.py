"""``probes/w12_time_model.py`` recovers a known fixed cost and bandwidth from synthetic bench rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import w12_time_model as tm  # noqa: E402


def test_fit_recovers_fixed_cost_and_bandwidth():
    rows = []
    for proj, (n, k) in tm.SHAPES.items():
        mb = n * k * 2 / 1e6
        rows.append({"proj": proj, "rows": 1, "cublas_us": 4.0 + mb / 4.0, "w12_us": 6.0 + 0.75 * mb / 3.5})
    r = tm.model({"gemm": rows})["1"]
    assert r["cublas"]["fixed_us"] == pytest.approx(4.0) and r["cublas"]["tb_per_s"] == pytest.approx(4.0)
    assert r["w12"]["fixed_us"] == pytest.approx(6.0) and r["w12"]["tb_per_s"] == pytest.approx(3.5)
    assert r["w12"]["max_rel_residual"] < 1e-9
    qkv = r["qwen3_8b_at_1_25x"]["qwen3-8b/qkv"]
    mb = 6144 * 4096 * 2 / 1e6
    assert qkv["needed_fixed_us"] == pytest.approx((4.0 + mb / 4.0) / 1.25 - 0.75 * mb / 3.5)
    assert qkv["ratio_at_cublas_fixed_cost"] == pytest.approx((4.0 + mb / 4.0) / (4.0 + 0.75 * mb / 3.5))
    assert set(r["qwen3_8b_at_1_25x"]) == {p for p in tm.SHAPES if p.startswith("qwen3-8b")}
