"""``specpilot zoo random``: real architectures with random weights load in ours and in transformers."""

from __future__ import annotations

import pytest
import torch

from specpilot.engine.checkpoint import load_model
from specpilot.errors import SpecPilotError
from specpilot.zoo.random_ckpt import ARCHS, tensor_shapes, write_random_checkpoint

SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_random_checkpoint_loads_and_matches_transformers(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    d = write_random_checkpoint(arch, tmp_path / arch, device="cpu", overrides=SMALL, shard_bytes=40_000)
    assert len(list(d.glob("*.safetensors"))) > 1 and (d / "model.safetensors.index.json").is_file()
    ours = load_model(d)
    ref = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    ids = torch.arange(20) % 256
    with torch.no_grad():
        got = ours.logits(ours(ids, torch.arange(20), ours.new_cache(32), 0))
        want = ref(ids[None]).logits[0]
    assert (got - want).abs().max() < 1e-4


def test_full_size_shapes_count_parameters():
    n = sum(torch.Size(s).numel() for s in tensor_shapes(ARCHS["qwen3-8b"]).values())
    assert 8.1e9 < n < 8.3e9  # Qwen3-8B: 8.19B parameters
    n = sum(torch.Size(s).numel() for s in tensor_shapes(ARCHS["llama-3.1-8b"]).values())
    assert 8.0e9 < n < 8.1e9  # Llama-3.1-8B: 8.03B


def test_unknown_arch_is_a_clear_error(tmp_path):
    with pytest.raises(SpecPilotError, match="unknown architecture"):
        write_random_checkpoint("gpt-5", tmp_path)


def test_random_transformer_in_memory():
    from specpilot.zoo.random_ckpt import random_transformer

    m = random_transformer("llama-3.1-8b", device="cpu", dtype=torch.float32, overrides=SMALL)
    assert m.args.rope_scaling is not None and m.args.num_layers == 2
    w = m.model.layers[0].mlp.down_proj.weight
    assert 0.015 < w.std().item() < 0.025 and torch.all(m.model.norm.weight == 1)
    hidden = m(torch.arange(8), torch.arange(8), m.new_cache(16), 0)
    assert torch.isfinite(m.logits(hidden)).all()
