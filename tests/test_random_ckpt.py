"""``specpilot zoo random``: real architectures with random weights load in ours and in transformers."""

from __future__ import annotations

import pytest
import torch

from specpilot.model.checkpoint import load_model
from specpilot.errors import SpecPilotError
from specpilot.zoo.random_ckpt import ARCHS, tensor_shapes, write_random_checkpoint

from .conftest import run_cli

SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}
#: what a hybrid (qwen3_5) architecture shrinks further: its layer list and Gated DeltaNet heads
SMALL_HYBRID = {"layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
                "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 16}
#: what a mixture-of-experts (qwen3_next) architecture shrinks further: its experts (layer 0 dense, layer 1 sparse)
SMALL_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 48, "mlp_only_layers": [0]}


def small(arch: str) -> dict:
    """The test's overrides shrinking ``arch``."""
    hybrid = "layer_types" in ARCHS[arch] or "full_attention_interval" in ARCHS[arch]
    return {**SMALL, **(SMALL_HYBRID if hybrid else {}), **(SMALL_MOE if "num_experts" in ARCHS[arch] else {})}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_random_checkpoint_loads_and_matches_transformers(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    d = write_random_checkpoint(arch, tmp_path / arch, device="cpu", overrides=small(arch), shard_bytes=40_000)
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
    n = sum(torch.Size(s).numel() for s in tensor_shapes(ARCHS["qwen3.5-27b-like"]).values())
    assert 26.5e9 < n < 27.5e9  # the text model of a 27B hybrid (48 GDN + 16 attention layers)
    shapes = tensor_shapes(ARCHS["qwen3-next-80b-a3b-like"])
    n = sum(torch.Size(s).numel() for s in shapes.values())
    assert 79.5e9 < n < 80.5e9  # an 80B hybrid MoE: 48 layers of 512 experts (no multi-token-prediction head)
    assert "model.layers.0.mlp.experts.511.down_proj.weight" in shapes
    assert "model.layers.3.self_attn.q_proj.weight" in shapes
    assert "model.layers.2.linear_attn.in_proj_qkvz.weight" in shapes


def test_unknown_arch_is_a_clear_error(tmp_path):
    with pytest.raises(SpecPilotError, match="unknown architecture"):
        write_random_checkpoint("gpt-5", tmp_path)


def test_a_file_or_non_empty_directory_is_refused(tmp_path):
    """Second fresh-user run this session: ``zoo random --out`` the bundled target's directory rewrote its
    config.json and wrote 16 GB of shards beside its weights; a file as --out was a traceback."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    (tmp_path / "file").write_text("x")
    for out, why in (("ckpt", "is not empty"), ("file", "is not a directory")):
        with pytest.raises(SpecPilotError, match=why):
            write_random_checkpoint("qwen3-8b", tmp_path / out, device="cpu")
    assert (tmp_path / "ckpt" / "config.json").read_text() == "{}" and (tmp_path / "file").read_text() == "x"


def test_random_transformer_in_memory():
    from specpilot.zoo.random_ckpt import random_transformer

    m = random_transformer("llama-3.1-8b", device="cpu", dtype=torch.float32, overrides=SMALL)
    assert m.args.rope_scaling is not None and m.args.num_layers == 2
    w = m.model.layers[0].mlp.down_proj.weight
    assert 0.015 < w.std().item() < 0.025 and torch.all(m.model.norm.weight == 1)
    hidden = m(torch.arange(8), torch.arange(8), m.new_cache(16), 0)
    assert torch.isfinite(m.logits(hidden)).all()


def test_checkpoint_without_tokenizer_feeds_byte_ids_to_the_pilot(tmp_path, monkeypatch, capsys):
    """A random checkpoint has no tokenizer files: the deployment's tokenizer is None (transformers 5 would build
    an empty one from config.json that encodes every prompt to no ids, and the pilot had no requests), the
    pilot's requests are the prompts' UTF-8 bytes as ids, and `generate` refuses a text prompt in one line."""
    from specpilot.data.benchmarks import load_mix
    from specpilot.engine.deployment import Deployment
    from specpilot.pilot.setup import BYTE_ID_OFFSET, build_requests

    d = write_random_checkpoint("qwen3-8b", tmp_path / "q", device="cpu", overrides=SMALL | {"vocab_size": 1024})
    dep = Deployment(d)
    assert dep.tokenizer is None and dep.eos_ids() == [ARCHS["qwen3-8b"]["eos_token_id"]]
    reqs = build_requests(dep, 2, 8)
    texts = load_mix(2)
    assert len(reqs) == len(texts) == 8
    for r, t in zip(reqs, texts):
        assert r.prompt_ids == tuple(BYTE_ID_OFFSET + b for b in t.text.encode("utf-8")) and r.max_new_tokens == 8
    small = write_random_checkpoint("qwen3-8b", tmp_path / "s", device="cpu", overrides=SMALL)
    with pytest.raises(SpecPilotError, match="too small"):
        build_requests(Deployment(small), 1, 8)
    code, out, err = run_cli(monkeypatch, capsys, "generate", "--target", str(d), "--prompt", "hi", "--max-new-tokens", "2")
    assert code == 2 and "no tokenizer files" in err and "Traceback" not in err
