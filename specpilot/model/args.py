"""Architecture of a decoder read from a Hugging Face ``config.json`` (dense llama / qwen2 / qwen3, or a hybrid
qwen3_5 text model whose layers mix Gated DeltaNet and gated full attention), and its RoPE frequencies."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_5", "qwen3_5_text")

#: model types whose layers mix Gated DeltaNet (``linear_attention``) and full attention (:mod:`specpilot.model.hybrid`)
HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")


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
    # hybrid (qwen3_5) fields; the defaults describe a dense decoder
    layer_types: list[str] | None = None  # per layer "linear_attention" (GDN) or "full_attention"; None = dense
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * factor dims of q/k
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers are Gated DeltaNet layers (built by :mod:`specpilot.model.hybrid`)."""
        return self.layer_types is not None

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelArgs":
        """Build from a parsed ``config.json`` dict (transformers 4.x or 5.x field names). A ``qwen3_5`` config
        (the multimodal wrapper) is read from its ``text_config``."""
        mt = cfg["model_type"]
        if mt == "qwen3_5":
            cfg = {**cfg["text_config"], "model_type": mt}
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
            **(_hybrid_fields(cfg, rope) if mt in HYBRID_MODEL_TYPES else {}),
        )


def _hybrid_fields(cfg: dict, rope: dict) -> dict:
    """The qwen3_5 fields of :class:`ModelArgs` (layer types as transformers derives them when absent: every
    ``full_attention_interval``-th layer is full attention)."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        every = cfg.get("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    if len(types) != n or set(types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"layer_types must list {n} entries of linear_attention / full_attention")
    return dict(
        layer_types=list(types),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))),
        linear_num_key_heads=cfg.get("linear_num_key_heads", 16),
        linear_num_value_heads=cfg.get("linear_num_value_heads", 32),
        linear_key_head_dim=cfg.get("linear_key_head_dim", 128),
        linear_value_head_dim=cfg.get("linear_value_head_dim", 128),
        linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4),
    )


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse RoPE frequencies ``[rot // 2]`` float32 (``rot = head_dim * partial_rotary_factor``, the whole head
    for dense models), with llama3 scaling when configured.

    Implements the ``default`` and ``llama3`` rope types of Hugging Face transformers.

    Raises:
        ValueError: for a rope type other than default / llama3.
    """
    d = int(args.head_dim * args.partial_rotary_factor)
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
