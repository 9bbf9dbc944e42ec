"""Real architectures without weights: HF checkpoint directories with random weights of a real shape.

For timing only: the shapes, dtypes and file layout are those of the public checkpoints, the
values are N(0, 0.02) (norm weights 1). No tokenizer is written; benchmarks feed token ids directly.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specpilot.errors import SpecPilotError

#: Public architectures (config.json fields of the released checkpoints).
ARCHS: dict[str, dict] = {
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
        "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "qwen3-32b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 5120,
        "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
        "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 128000, "eos_token_id": 128009,
    },
    # a hybrid: 48 Gated DeltaNet + 16 gated full-attention layers (every 4th), the text model's shape as public
    # Qwen3.5-27B configs give it (third-party copies of its config.json; not checked against the hub here)
    "qwen3.5-27b-like": {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 248320,
        "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64, "num_attention_heads": 24,
        "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 16,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "tie_word_embeddings": False,
        "hidden_act": "silu", "attention_bias": False, "eos_token_id": 248044,
    },
    # a hybrid with mixture-of-experts MLPs: 36 Gated DeltaNet + 12 gated full-attention layers (every 4th), every
    # layer's MLP 512 routed experts (top 10) + a gated shared expert; 79.7B parameters (the multi-token-prediction
    # head not written). The shape as third-party copies of Qwen3-Next-80B-A3B-Instruct's config.json give it, which
    # agree with transformers' Qwen3NextConfig defaults; not checked against the hub here
    "qwen3-next-80b-a3b-like": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
        "rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "full_attention_interval": 4,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512, "num_experts_per_tok": 10,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False, "hidden_act": "silu",
        "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
    },
}


def _hybrid_layer_shapes(cfg: dict, n: int, layer_types: list[str]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of hybrid (qwen3_5 / qwen3_next) decoder layer ``n``'s token mixer (HF names;
    qwen3_next keeps the GDN input projections grouped as ``in_proj_qkvz`` and ``in_proj_ba``)."""
    p, h = f"model.layers.{n}.", cfg["hidden_size"]
    if layer_types[n] == "full_attention":
        d, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        return {p + "self_attn.q_proj.weight": (2 * nh * d, h), p + "self_attn.k_proj.weight": (nkv * d, h),
                p + "self_attn.v_proj.weight": (nkv * d, h), p + "self_attn.o_proj.weight": (h, nh * d),
                p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    kd, vd = hk * cfg["linear_key_head_dim"], hv * cfg["linear_value_head_dim"]
    q = p + "linear_attn."
    if cfg["model_type"] == "qwen3_next":
        proj = {q + "in_proj_qkvz.weight": (2 * kd + 2 * vd, h), q + "in_proj_ba.weight": (2 * hv, h)}
    else:
        proj = {q + "in_proj_qkv.weight": (2 * kd + vd, h), q + "in_proj_z.weight": (vd, h),
                q + "in_proj_b.weight": (hv, h), q + "in_proj_a.weight": (hv, h)}
    return {**proj, q + "conv1d.weight": (2 * kd + vd, 1, cfg["linear_conv_kernel_dim"]), q + "dt_bias": (hv,),
            q + "A_log": (hv,), q + "norm.weight": (cfg["linear_value_head_dim"],), q + "out_proj.weight": (h, vd)}


def _mlp_shapes(p: str, h: int, i: int) -> dict[str, tuple[int, ...]]:
    """A SwiGLU MLP's tensors under prefix ``p`` (hidden ``h``, width ``i``)."""
    return {p + "gate_proj.weight": (i, h), p + "up_proj.weight": (i, h), p + "down_proj.weight": (h, i)}


def _moe_shapes(cfg: dict, p: str) -> dict[str, tuple[int, ...]]:
    """A qwen3_next mixture-of-experts MLP's tensors under prefix ``p`` (the hub's per-expert names)."""
    h, e, i = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
    out = {p + "gate.weight": (e, h), p + "shared_expert_gate.weight": (1, h)}
    for k in range(e):
        out.update(_mlp_shapes(p + f"experts.{k}.", h, i))
    return {**out, **_mlp_shapes(p + "shared_expert.", h, cfg["shared_expert_intermediate_size"])}


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape of a llama / qwen2 / qwen3 / qwen3_5 text / qwen3_next checkpoint with config
    ``cfg`` (HF names)."""
    from specpilot.model.args import HYBRID_MODEL_TYPES, ModelArgs

    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    args = ModelArgs.from_hf(cfg) if cfg["model_type"] in HYBRID_MODEL_TYPES else None
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        if args is not None:
            shapes.update(_hybrid_layer_shapes(cfg, n, args.layer_types))
            shapes.update(_moe_shapes(cfg, p + "mlp.") if args.is_moe_layer(n) else _mlp_shapes(p + "mlp.", h, i))
            shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
            continue
        shapes.update({
            p + "self_attn.q_proj.weight": (nh * d, h), p + "self_attn.k_proj.weight": (nkv * d, h),
            p + "self_attn.v_proj.weight": (nkv * d, h), p + "self_attn.o_proj.weight": (h, nh * d),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
        if cfg["model_type"] == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        if cfg["model_type"] == "qwen2":
            for k, n_out in (("q", nh * d), ("k", nkv * d), ("v", nkv * d)):
                shapes[p + f"self_attn.{k}_proj.bias"] = (n_out,)
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, h)
    return shapes


def write_random_checkpoint(arch: str, out: str | Path, seed: int = 0, shard_bytes: int = 4 << 30,
                            device: str | None = None, overrides: dict | None = None) -> Path:
    """Write ``out/config.json`` + sharded bf16 safetensors (+ index) with random weights of ``arch``.

    Args:
        arch: a key of :data:`ARCHS`.
        out: output directory (created).
        seed: RNG seed. shard_bytes: largest shard size in bytes.
        device: where to draw the random numbers (default: cuda if available; the file is the same layout).
        overrides: config fields to replace (tests use it to shrink an architecture).
    Returns:
        the output directory.
    Raises:
        SpecPilotError: unknown ``arch``; ``out`` a file or a non-empty directory.
    """
    from specpilot.fileio import output_dir, save_safetensors

    if arch not in ARCHS:
        raise SpecPilotError(f"unknown architecture {arch!r} (choose {', '.join(ARCHS)})")
    cfg = {**ARCHS[arch], "torch_dtype": "bfloat16", **(overrides or {})}
    out = output_dir(out, empty=True)  # never mix files into (or overwrite) an existing checkpoint
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=dev).manual_seed(seed)
    shapes = tensor_shapes(cfg)
    shards, cur, cur_bytes = [], {}, 0
    for name, shape in shapes.items():
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen, device=dev, dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()
        nb = t.numel() * 2
        if cur and cur_bytes + nb > shard_bytes:
            shards.append(cur)
            cur, cur_bytes = {}, 0
        cur[name] = t
        cur_bytes += nb
    shards.append(cur)
    index, total = {}, 0
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        save_safetensors(shard, out / fname, metadata={"format": "pt"})
        for name, t in shard.items():
            index[name] = fname
            total += t.numel() * 2
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=2))
    (out / "RANDOM_WEIGHTS.txt").write_text(
        f"Random N(0, 0.02) bf16 weights with the shapes of {arch} (seed {seed}); for timing only.\n")
    return out


def random_transformer(arch: str, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                       overrides: dict | None = None, fuse: bool = True):
    """Our :class:`~specpilot.model.transformer.Transformer` of ``arch`` with random N(0, 0.02) weights (norms 1),
    built directly on ``device`` without writing files (for timing scripts); ``fuse`` as in ``load_model``.

    Raises:
        SpecPilotError: unknown ``arch``; ``out`` a file or a non-empty directory.
    """
    from specpilot.model.args import ModelArgs, rope_inv_freq
    from specpilot.model.checkpoint import build_model

    if arch not in ARCHS:
        raise SpecPilotError(f"unknown architecture {arch!r} (choose {', '.join(ARCHS)})")
    args = ModelArgs.from_hf({**ARCHS[arch], **(overrides or {})})
    with torch.device("meta"):
        model = build_model(args)
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * 0.02)
    model.inv_freq = rope_inv_freq(args).to(device)
    model = model.eval().requires_grad_(False)
    return model.fuse_projections() if fuse else model
