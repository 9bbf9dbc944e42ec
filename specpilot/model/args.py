"""Architecture of a dense decoder (llama / qwen2 / qwen3) read from a Hugging Face ``config.json``, and its RoPE
frequencies."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass
class ModelArgs:
    """Architecture of a dense decoder, read from a Hugging Face ``config.json``.

    Raises:
        KeyError: when a required field is missing (the loader turns it into a CheckpointError).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelArgs":
        """Build from a parsed ``config.json`` dict (transformers 4.x or 5.x field names)."""
        mt = cfg["model_type"]
        n_heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or {})
        legacy = cfg.get("rope_scaling") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = {**legacy, **rope}
        if scaling.get("rope_type", scaling.get("type", "default")) in ("default", None):
            scaling = None
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            model_type=mt,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=True if mt == "qwen2" else bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=(mt == "qwen3"),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            eos_token_ids=eos_ids,
        )


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse RoPE frequencies ``[head_dim // 2]`` float32, with llama3 scaling when configured.

    Implements the ``default`` and ``llama3`` rope types of Hugging Face transformers.

    Raises:
        ValueError: for a rope type other than default / llama3.
    """
    d = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = args.rope_scaling
    if sc is None:
        return inv.float()
    kind = sc.get("rope_type", sc.get("type"))
    if kind != "llama3":
        raise ValueError(f"unsupported rope type {kind!r} (supported: default, llama3)")
    factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old = sc["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    lo_wl, hi_wl = old / lo, old / hi
    scaled = torch.where(wavelen > lo_wl, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= hi_wl) & (wavelen <= lo_wl)
    return torch.where(is_mid, mid, scaled).float()
