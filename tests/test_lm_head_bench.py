"""``bench/lm_head_bench.py --quick``: the CPU smoke mode of the certified INT8 head benchmark (§4.1) runs
end to end in the Triton interpreter and writes a complete JSON with a passing correctness section."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_mode_writes_json(tmp_path):
    out = tmp_path / "lm_head.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "SPECPILOT_COMMIT": "test-commit"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "lm_head_bench.py"), "--out", str(out), "--quick",
                           "--no-sweep"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["correct"] is True and res["meta"]["commit"] == "test-commit" and res["meta"]["torch"]
    kinds = res["correctness"]
    assert set(kinds) >= {"random", "tie", "peaked_gamma0.1"}
    assert all(k["mismatches"] == 0 and k["rows"] == 16 and k["survivors_max"] >= 1 for k in kinds.values())
    for r in ("1", "4"):
        t = res["timing"][r]
        assert "error" not in t, t
        assert t["bf16_us"] > 0 and t["certified_us"] > 0 and t["bounds_kernel_us"] > 0
