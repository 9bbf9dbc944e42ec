"""``specpilot bench --batch SIZES --system PILOT_DIR``: a batched pilot's sealed systems, served as one load plan,
measured beside AR and stock at every size with paired bounds; float32 outputs equal AR's; the JSON names each
size's system (sizes between sealed ones run the nearest); bad combinations are one-line errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.zoo import bundled_target_dir

from .conftest import run_cli


def _system_file(path, cfg: SystemConfig, n: int) -> None:
    path.write_text(json.dumps({"config": cfg.model_dump(), "label": cfg.label(), "seal": cfg.seal(), "batch_size": n,
                                "deployment": {"target": str(bundled_target_dir()), "drafter": "ngram",
                                               "device": "cpu", "batch": [n]}}))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_sealed_plan_measured_against_ar_and_stock_at_every_size(monkeypatch, capsys, tmp_path, compiled):
    pilot = tmp_path / "pilot"
    pilot.mkdir()
    one = SystemConfig(drafter="ngram", tree="best_first", nodes=4, depth=4, top_k=2)
    _system_file(pilot / "system_n1.json", one, 1)
    _system_file(pilot / "system_n4.json", SystemConfig.ar(), 4)
    n = torch.get_num_threads()
    try:
        code, out, err = run_cli(monkeypatch, capsys, "bench", "--batch", "1,3", "--system", str(pilot), "--device",
                                 "cpu", "--rounds", "2", "--per-benchmark", "2", "--new-tokens", "6", "--out",
                                 str(tmp_path / "out"), *(["--compile"] if compiled else []))
    finally:
        torch.set_num_threads(n)
    assert code == 0, err
    (path,) = (tmp_path / "out").glob("batch_sealed_*.json")
    res = json.loads(path.read_text())
    assert res["plan"] == {"1": one.label(), "4": "AR"} and res["stock"] == SystemConfig.stock("ngram", 6).label()
    assert res["per_size"]["1"]["system"] == one.label() and res["per_size"]["3"]["system"] == "AR"  # 3: nearest 4
    for f in res["per_size"].values():
        assert f["outputs_equal_ar"] == {"stock": True, "sealed": True}
        assert all(t > 0 for t in f["tokens_per_s"].values())
        for key in ("vs_ar", "vs_stock"):
            low = f[key]["lower_bound"]
            assert f[key]["gain"] > 0 and (low is None or low <= f[key]["gain"])
    want = all(f[k]["lower_bound"] is not None and f[k]["lower_bound"] >= 0.98 for f in res["per_size"].values()
               for k in ("vs_ar", "vs_stock"))
    assert res["meets_bar_at_every_size"] == want and f"against AR and stock: {want}" in out
    assert res["device"] == "cpu" and res["commit"] and res["versions"] and math.isfinite(res["duration_s"])
    assert res["compiled"] is compiled


def test_sealed_bench_refuses_bad_options_in_one_line(monkeypatch, capsys, tmp_path):
    pilot = tmp_path / "pilot"
    pilot.mkdir()
    _system_file(pilot / "system_n1.json", SystemConfig.ar(), 1)
    for args, msg in ((("--system", str(pilot)), "--system needs --batch"),
                      (("--system", str(pilot), "--batch", "1", "--rounds", "1"), "--rounds must be at least 2"),
                      (("--system", str(tmp_path / "nope"), "--batch", "1"), "nope")):
        code, _, err = run_cli(monkeypatch, capsys, "bench", "--device", "cpu", *args)
        assert code == 2 and err.count("\n") == 1 and msg in err, (args, err)
