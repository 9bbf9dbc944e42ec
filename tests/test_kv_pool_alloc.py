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


def _hybrid_pool_bytes(args, num_slots, slot_len):
    """Bytes of a float32 hybrid pool: attention K/V, float32 GDN states and conv windows (written out here, apart
    from the pool's own shapes)."""
    n_attn = args.layer_types.count("full_attention")
    n_gdn = len(args.layer_types) - n_attn
    kv = 2 * n_attn * slot_len * args.n_kv_heads * args.head_dim
    state = n_gdn * args.linear_num_value_heads * args.linear_key_head_dim * args.linear_value_head_dim
    conv = 2 * args.linear_num_key_heads * args.linear_key_head_dim + \
        args.linear_num_value_heads * args.linear_value_head_dim
    window = n_gdn * (args.linear_conv_kernel_dim - 1) * conv
    return num_slots * (kv + state + window) * 4


def test_a_hybrid_pool_past_the_devices_memory_is_one_line_counting_states_and_windows():
    from .hybridutil import tiny_target
    target = tiny_target()
    pool = target.new_pool(3, 40)
    assert pool.nbytes() == _hybrid_pool_bytes(target.args, 3, 40)
    with pytest.raises(SpecPilotError) as e:
        target.new_pool(10**9, 10**6)
    msg = str(e.value)
    gib = _hybrid_pool_bytes(target.args, 10**9, 10**6) / 2**30
    kv_only = gib - _hybrid_pool_bytes(target.args, 10**9, 0) / 2**30
    assert f"{gib:,.1f} GiB" in msg and f"{kv_only:,.1f} GiB" not in msg  # the states and windows are counted
    assert "\n" not in msg and "hybrid pool" in msg and "1000000000 slots x 1000000 positions" in msg
    assert "--max-num-seqs" in msg and "--max-model-len" in msg
