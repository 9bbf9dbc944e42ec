"""The read-floor suite (``specpilot bench --suite read-floor``, :mod:`specpilot.bench.read_floor`): the
streaming-read kernel whose time is the measured read floor reads every word once (its per-program XORs equal
numpy's), in every launch shape the suite times; a ragged tail is masked. Its derived budget figures, and its
one-line refusal without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .tritonutil import DEV, triton  # noqa: F401  (skips without Triton; the interpreter on the CPU)

from specpilot.bench import read_floor as rf  # noqa: E402  (after tritonutil chose the interpreter)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("cfg", [(1, 2, 2), (2, 1, 3)] + ([] if DEV == "cpu" else list(rf.CONFIGS)))
@pytest.mark.parametrize("n", [1, 4 * 128 * 3 + 5, 9000])
def test_read_kernel_reads_every_word(cfg, n):
    g = torch.Generator().manual_seed(n + cfg[0])
    x = torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int32).to(DEV)
    got = rf.read_words(x, cfg)
    want = rf.read_reference(x, cfg)
    assert got.shape == want.shape and torch.equal(got, want)
    # a change anywhere changes that program's XOR: no word is skipped
    i = n // 2
    x[i] ^= 1
    assert not torch.equal(rf.read_words(x, cfg), want)


def test_suite_refuses_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusal")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        rf.main(str(tmp_path / "o.json"))
    assert not (tmp_path / "o.json").exists()


def test_budget_figures():
    # cuBLAS 15 µs over a 12 µs read of its bf16 bytes; W12 14 µs over a 9 µs read of its own
    b = rf.budget(15.0, 14.0, 9.0, 12.0)
    assert b["needed_us"] == pytest.approx(12.0) and b["budget_us"] == pytest.approx(3.0)
    assert b["excess_w12_us"] == pytest.approx(5.0) and b["excess_cublas_us"] == pytest.approx(3.0)
    assert b["budget_of_cublas_excess"] == pytest.approx(1.0) and b["speedup"] == pytest.approx(15 / 14)
    assert b["cap_vs_cublas"] == pytest.approx(15 / 9)
    # a W12 kernel at exactly budget + floor is exactly 1.25x
    assert 15.0 / (9.0 + b["budget_us"]) == pytest.approx(1.25)
    # cuBLAS at or below its own floor: no ratio (standard JSON, not inf)
    assert rf.budget(10.0, 9.0, 8.0, 10.0)["budget_of_cublas_excess"] is None


def test_cli_refuses_in_one_line_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("would run the GPU suite")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for args in (["--device", "cpu"], []):  # the default device is cuda: no GPU here
        p = subprocess.run([sys.executable, "-m", "specpilot", "bench", "--suite", "read-floor", *args, "--out",
                            str(tmp_path / "r")], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), p.stderr
        assert "Traceback" not in p.stderr
    assert not (tmp_path / "r").exists()
