"""``specpilot bench --suite lm-head --device cpu`` (``specpilot.bench.lm_head --quick --no-sweep``): the CPU smoke
mode of the certified INT8 head benchmark (§4.1) runs end to end in the Triton interpreter and writes a complete
JSON with a passing correctness section; the suite's bad inputs are refused with a message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_mode_writes_json(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the CLI chooses the interpreter itself
    env.update(PYTHONPATH=str(ROOT), SPECPILOT_COMMIT="test-commit")
    proc = subprocess.run([sys.executable, "-m", "specpilot", "bench", "--suite", "lm-head", "--device", "cpu", "--out",
                           str(tmp_path / "res")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (out,) = (tmp_path / "res").glob("lm_head_bench_cpu_*.json")
    res = json.loads(out.read_text())
    assert res["correct"] is True and res["meta"]["commit"] == "test-commit" and res["meta"]["torch"]
    kinds = res["correctness"]
    assert set(kinds) >= {"random", "tie", "peaked_gamma0.1"}
    assert all(k["mismatches"] == 0 and k["rows"] == 16 and k["survivors_max"] >= 1 for k in kinds.values())
    for r in ("1", "4"):
        t = res["timing"][r]
        assert "error" not in t, t
        assert t["bf16_us"] > 0 and t["certified_us"] > 0 and t["bounds_kernel_us"] > 0


def test_suite_bad_inputs_are_refused(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for args, msg in ((["--suite", "w12", "--device", "cpu"], "needs a CUDA GPU"),
                      (["--suite", "read-floor", "--device", "cpu"], "needs a CUDA GPU"),
                      (["--suite", "nope"], "unknown suite 'nope'"),
                      (["--suite", "lm-head", "--device", "cpu", "--target", str(tmp_path)], "systems suite only"),
                      (["--device", "cpu"], "--target is required")):
        proc = subprocess.run([sys.executable, "-m", "specpilot", "bench", *args, "--out", str(tmp_path / "r")],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and msg in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_suite_leaves_torch_flags_as_they_were(tmp_path):
    """The suite turns off bf16 reduced-precision reductions for its run only (the certified bound needs float32
    sums): the process's flag is restored after it, whatever it was."""
    import torch

    from .tritonutil import DEV  # noqa: F401  (the interpreter on the CPU)
    from specpilot.bench import lm_head

    before = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    try:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True  # the suite sets False
        quick = [] if torch.cuda.is_available() else ["--quick"]
        lm_head.main(["--out", str(tmp_path / "r.json"), *quick, "--no-sweep", "--n", "4", "--reps", "2",
                      "--vocab", "512", "--hidden", "64"])
        assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is True
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = before


def test_cpu_run_without_triton_is_one_line(monkeypatch, tmp_path):
    """The README's main install (``pip install .``) has no Triton: the CPU smoke run says what is missing instead
    of writing tracebacks into its JSON."""
    import importlib.util

    import pytest

    from specpilot.bench.cli import run_suite
    from specpilot.errors import SpecPilotError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(SpecPilotError, match="install triton"):
        run_suite("lm-head", "cpu", tmp_path / "r")
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_the_cli_and_the_engines_do_not_import_triton():
    """`bench --suite lm-head --device cpu` sets TRITON_INTERPRET before Triton's first import, so nothing the CLI,
    the deployment or the engines import at module level may import Triton (a kernel module loads only where a fast
    path runs). Twice a module-level import crept in through the engine's imports and failed the benchmark."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT))
    code = ("import sys, specpilot.cli, specpilot.bench.cli, specpilot.engine.deployment, specpilot.engine.engine, "
            "specpilot.engine.batch, specpilot.model.hybrid, specpilot.model.hybrid_cache, specpilot.model.hybrid_pool; "
            "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.')))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout
