"""``bench/read_floor.py``: the streaming-read kernel whose time is the measured read floor reads every word
once (its per-program XORs equal numpy's), in every launch shape the probe times; a ragged tail is masked."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from .tritonutil import DEV, triton  # noqa: F401  (skips without Triton; the interpreter on the CPU)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import read_floor as rf  # noqa: E402


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


def test_probe_refuses_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusal")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        rf.main(str(tmp_path / "o.json"))
