"""``specpilot.benchsuite.w12`` (``specpilot bench --suite w12``): imports cleanly with the package (the helpers the
``bench/`` probes import by name included) and refuses to run without CUDA. Its measurements need an H200."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_w12_suite_refuses_without_cuda(tmp_path):
    from specpilot.benchsuite import w12

    assert set(w12.SHAPES) >= {"qwen3-8b/qkv", "qwen3-8b/o", "qwen3-8b/gate_up", "qwen3-8b/down"}
    assert all(callable(getattr(w12, f)) for f in ("projection_copies", "copies_of", "check", "codes", "bits_equal"))
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        w12.main(str(tmp_path / "w12.json"))
    assert not (tmp_path / "w12.json").exists()
