"""A K/V pool too large for the device is a one-line SpecPilotError, not the allocator's traceback
(`specpilot pilot --batch 100000`, `specpilot serve --max-num-seqs 100000` asked for 630 GB on a CPU)."""

from __future__ import annotations

import pytest
import torch

from specpilot.errors import SpecPilotError
from specpilot.model.args import ModelArgs
from specpilot.model.cache import KVPool

ARGS = ModelArgs(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, n_heads=2,
                 n_kv_heads=1, head_dim=16)


def test_a_pool_that_fits_is_allocated_as_before():
    pool = KVPool(ARGS, 3, 40, torch.float32, "cpu")
    assert pool.k.shape == (3, 2, 40, 1, 16) and pool.nbytes() == 2 * 3 * 2 * 40 * 16 * 4


def test_a_pool_past_the_devices_memory_is_one_line():
    with pytest.raises(SpecPilotError) as e:
        KVPool(ARGS, 10**9, 10**6, torch.float32, "cpu")  # 2 x 1.2e17 bytes: no allocator gives that
    msg = str(e.value)
    assert "\n" not in msg and "10000000000 slots" not in msg and "1000000000 slots x 1000000 positions" in msg
    assert "GiB" in msg and "--max-num-seqs" in msg
