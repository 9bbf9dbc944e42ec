"""Deterministic tiny DFlash drafter checkpoints (the public ``DFlashDraftModel`` layout) for the loader's tests.

Weights come from a fixed hash of their index, not from an RNG, so the checkpoint the reference values in
``tests/data/dflash_reference.json`` were computed on is rebuilt bit for bit by any torch version. The recipe of
those values: :func:`write_dflash` with :data:`REF` into a directory, the public reference implementation's
``DFlashDraftModel.from_pretrained`` on it (float32, CPU, SDPA and eager attention agreeing), target embedding /
LM head :func:`ref_target_weights`, context features :func:`ref_features`; per case, the drafter's output rows
1 … B − 1 through the LM head, with the context given whole and, as its ``dflash_generate`` feeds it, in two
steps through its KV cache (both agreed to < 1e-5).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# the reference checkpoint: a 2-layer drafter, block 8, reading layers 0 and 2 of a 4-layer target (hidden 64,
# vocabulary 256), mask token 250, RoPE theta 1e6
REF = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=96, vocab=256, block=8,
           target_layers=[0, 2], num_target_layers=4, mask_token_id=250, rope_theta=1e6)
REF_CASES = [(5, 17), (11, 203)]  # (context positions, anchor token)


def det(shape, seed: int, std: float = 1.0) -> torch.Tensor:
    """A fixed float32 tensor of ``shape``, roughly uniform with standard deviation ``std`` (a hash of the index)."""
    n = 1
    for s in shape:
        n *= s
    t = torch.arange(n, dtype=torch.float64)
    h = torch.remainder(torch.sin(t * 12.9898 + seed * 78.233 + 0.5) * 43758.5453, 1.0) - 0.5  # [-0.5, 0.5)
    return (h * (std * 12**0.5)).float().reshape(shape)


def dflash_weights(hidden, layers, heads, kv_heads, head_dim, intermediate, n_features, seed=0) -> dict:
    """The state dict of a DFlash drafter (its names) with :func:`det` weights."""
    sd, k = {}, seed * 1000

    def put(name, shape, std):
        nonlocal k
        k += 1
        sd[name] = det(shape, k, std)

    for i in range(layers):
        a = f"layers.{i}."
        put(a + "self_attn.q_proj.weight", (heads * head_dim, hidden), hidden**-0.5)
        put(a + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden), hidden**-0.5)
        put(a + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden), hidden**-0.5)
        put(a + "self_attn.o_proj.weight", (hidden, heads * head_dim), (heads * head_dim) ** -0.5)
        put(a + "mlp.gate_proj.weight", (intermediate, hidden), hidden**-0.5)
        put(a + "mlp.up_proj.weight", (intermediate, hidden), hidden**-0.5)
        put(a + "mlp.down_proj.weight", (hidden, intermediate), intermediate**-0.5)
        for norm, dim in (("self_attn.q_norm", head_dim), ("self_attn.k_norm", head_dim), ("input_layernorm", hidden),
                          ("post_attention_layernorm", hidden)):
            put(a + norm + ".weight", (dim,), 0.1)
            sd[a + norm + ".weight"] += 1.0
    put("fc.weight", (hidden, n_features * hidden), (n_features * hidden) ** -0.5)
    for norm in ("hidden_norm", "norm"):
        put(norm + ".weight", (hidden,), 0.1)
        sd[norm + ".weight"] += 1.0
    return sd


def dflash_config(hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, block, target_layers,
                  num_target_layers, mask_token_id, rope_theta=1e6) -> dict:
    """A DFlash ``config.json`` (the public checkpoints' fields)."""
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": head_dim, "intermediate_size": intermediate, "vocab_size": vocab, "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "rope_theta": rope_theta, "rope_scaling": None, "attention_bias": False,
            "attention_dropout": 0.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
            "use_sliding_window": False, "sliding_window": None, "layer_types": ["full_attention"] * layers,
            "block_size": block, "num_target_layers": num_target_layers,
            "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layers)},
            "torch_dtype": "float32"}


def write_dflash(path, hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, block, target_layers,
                 num_target_layers, mask_token_id, rope_theta=1e6, seed=0, shards=1, edit=None) -> Path:
    """Write a DFlash drafter directory (``config.json`` + safetensors, ``shards`` > 1: sharded with an index);
    ``edit(config, state_dict)`` may change either first. Returns the directory."""
    from safetensors.torch import save_file

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    cfg = dflash_config(hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, block, target_layers,
                        num_target_layers, mask_token_id, rope_theta)
    sd = dflash_weights(hidden, layers, heads, kv_heads, head_dim, intermediate, len(target_layers), seed)
    if edit is not None:
        edit(cfg, sd)
    (p / "config.json").write_text(json.dumps(cfg, indent=2))
    if shards == 1:
        save_file(sd, str(p / "model.safetensors"))
        return p
    names = sorted(sd)
    wmap = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: sd[k] for k in names[s::shards]}
        save_file(part, str(p / fname))
        wmap.update({k: fname for k in part})
    (p / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    return p


def write_ref(path, **over) -> Path:
    """The reference checkpoint (:data:`REF`, any field overridden by ``over``)."""
    return write_dflash(path, **{**REF, **over})


def ref_target_weights() -> tuple[torch.Tensor, torch.Tensor]:
    """``(embed [vocab, hidden], lm_head [vocab, hidden])`` float32 of the reference target."""
    return det((REF["vocab"], REF["hidden"]), 901, 0.5), det((REF["vocab"], REF["hidden"]), 902, REF["hidden"] ** -0.5)


def ref_features() -> torch.Tensor:
    """Context features ``[max context, len(target_layers) * hidden]`` float32 of the reference cases."""
    return det((max(c for c, _ in REF_CASES), len(REF["target_layers"]) * REF["hidden"]), 903, 1.0)
