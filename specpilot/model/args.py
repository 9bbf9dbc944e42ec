"""Architecture of a decoder read from a Hugging Face ``config.json`` (dense llama / qwen2 / qwen3, or a hybrid
qwen3_5 text / qwen3_next model whose layers mix Gated DeltaNet and gated full attention, qwen3_next's MLPs mostly
mixtures of experts), and its RoPE frequencies."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_5", "qwen3_5_text", "qwen3_next")

#: model types whose layers mix Gated DeltaNet (``linear_attention``) and full attention (:mod:`specpilot.model.hybrid`)
HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_next")


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
    # hybrid (qwen3_5 / qwen3_next) fields; the defaults describe a dense decoder
    layer_types: list[str] | None = None  # per layer "linear_attention" (GDN) or "full_attention"; None = dense
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * factor dims of q/k
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # mixture-of-experts (qwen3_next) fields; num_experts = 0 means every MLP is dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers are Gated DeltaNet layers (built by :mod:`specpilot.model.hybrid`)."""
        return self.layer_types is not None

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer ``i`` (0-based) has a mixture-of-experts MLP (:mod:`specpilot.model.moe`), as
        transformers' qwen3_next decides: experts configured, ``i`` not in ``mlp_only_layers``, and ``i + 1`` a
        multiple of ``decoder_sparse_step``; otherwise a dense MLP of ``intermediate_size``."""
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

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
            **(_moe_fields(cfg) if mt == "qwen3_next" else {}),
        )


def _hybrid_fields(cfg: dict, rope: dict) -> dict:
    """The hybrid (qwen3_5 / qwen3_next) fields of :class:`ModelArgs` (layer types as transformers derives them
    when absent: every ``full_attention_interval``-th layer is full attention)."""
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


def _moe_fields(cfg: dict) -> dict:
    """The qwen3_next mixture-of-experts fields of :class:`ModelArgs` (transformers' defaults where absent).

    Raises:
        ValueError: top-k not in ``[1, num_experts]``, a sparse step below 1, or an ``mlp_only_layers`` entry
            that is not a layer index.
    """
    n = cfg["num_hidden_layers"]
    out = dict(num_experts=cfg.get("num_experts", 512), num_experts_per_tok=cfg.get("num_experts_per_tok", 10),
               moe_intermediate_size=cfg.get("moe_intermediate_size", 512),
               shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 512),
               norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
               decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
               mlp_only_layers=list(cfg.get("mlp_only_layers") or []))
    e, k = out["num_experts"], out["num_experts_per_tok"]
    if isinstance(e, bool) or not isinstance(e, int) or e < 0:
        raise ValueError(f"num_experts must be a non-negative integer, got {e!r}")
    if e > 0 and not 1 <= k <= e:
        raise ValueError(f"num_experts_per_tok must be in [1, num_experts = {e}], got {k}")
    if out["decoder_sparse_step"] < 1:
        raise ValueError(f"decoder_sparse_step must be at least 1, got {out['decoder_sparse_step']}")
    if any(not isinstance(i, int) or not 0 <= i < n for i in out["mlp_only_layers"]):
        raise ValueError(f"mlp_only_layers must list layer indices in [0, {n}), got {out['mlp_only_layers']}")
    if e > 0 and min(out["moe_intermediate_size"], out["shared_expert_intermediate_size"]) < 1:
        raise ValueError("moe_intermediate_size and shared_expert_intermediate_size must be positive integers")
    return out


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
