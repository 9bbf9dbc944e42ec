"""Load a local Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files).

Only local directories: nothing is fetched from a hub. Every failure a user can cause (missing directory,
missing or corrupted files, unsupported model_type) raises :class:`~specpilot.errors.CheckpointError` with
a one-line message.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specpilot.errors import CheckpointError
from specpilot.model.args import SUPPORTED_MODEL_TYPES, ModelArgs, rope_inv_freq
from specpilot.model.transformer import Transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_config(path: str | Path) -> dict:
    """Parsed ``config.json`` of checkpoint directory ``path``.

    Raises:
        CheckpointError: if the directory or its config.json is missing, not valid JSON or not a JSON object.
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise CheckpointError(f"{p} is a file: give the checkpoint's directory (config.json + *.safetensors)")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {p}")
    cfg = p / "config.json"
    if not cfg.is_file():
        raise CheckpointError(f"no config.json in {p}: not a Hugging Face checkpoint directory")
    try:
        out = json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(out, dict):
        raise CheckpointError(f"{cfg} holds a JSON {type(out).__name__}, not an object of config fields")
    return out


#: config.json fields that must be positive integers when present (the model's shapes)
_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "num_experts_per_tok", "moe_intermediate_size",
                 "shared_expert_intermediate_size", "decoder_sparse_step")


def read_args(path: str | Path) -> ModelArgs:
    """:class:`ModelArgs` of a checkpoint. Raises CheckpointError for unsupported or incomplete configs, and for
    shape fields (:data:`_SHAPE_FIELDS`) that are not positive integers."""
    cfg = read_config(path)
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"unsupported model_type {mt!r} in {path} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    for key in _SHAPE_FIELDS:
        v = cfg.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise CheckpointError(f"config.json in {path}: {key} must be a positive integer, got {v!r}")
    try:
        return ModelArgs.from_hf(cfg)
    except KeyError as e:
        raise CheckpointError(f"config.json in {path} lacks required field {e.args[0]!r}") from None
    except ValueError as e:
        raise CheckpointError(f"config.json in {path}: {e}") from None


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the ``*.safetensors`` files in ``path`` (on the CPU, stored dtype). A W12 directory
    (one with ``w12.json``, written by ``specpilot w12 pack``; §4.1) is decoded, every converted tensor
    checked bit for bit against the sha256 of its source and every copied tensor and copied file (config,
    tokenizer, ...) against the sha256 recorded at packing, so it yields the source checkpoint's tensors.

    Raises:
        CheckpointError: if there is no safetensors file or one is truncated / corrupted (for a W12 directory:
            a :class:`~specpilot.w12.format.W12FormatError` naming the directory and the bad tensor or file).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from specpilot.w12.format import W12FormatError
    from specpilot.w12.pack import MANIFEST
    from specpilot.w12.verify import load_w12_state_dict

    if (Path(path) / MANIFEST).is_file():
        try:
            return load_w12_state_dict(path)
        except W12FormatError as e:
            raise W12FormatError(f"W12 checkpoint {path}: {e}") from None

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weight files in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {f.name}: corrupted or truncated ({e})") from None
    return state


def qwen3_next_state(state: dict[str, torch.Tensor], args: ModelArgs, path: str | Path = "checkpoint"
                     ) -> dict[str, torch.Tensor]:
    """A qwen3_next state dict in the names and layout the hybrid model loads: each GDN layer's grouped
    ``in_proj_qkvz`` / ``in_proj_ba`` split into qwen3_5's four projections
    (:func:`~specpilot.model.gdn.split_grouped_projections`), and experts stored fused (transformers' in-memory
    ``mlp.experts.gate_up_proj [E, 2 I, hidden]`` / ``down_proj [E, hidden, I]``) split into the hub's per-expert
    ``mlp.experts.{e}.*_proj.weight``. Other tensors pass unchanged (``mtp.*`` heads stay unused).

    Raises:
        CheckpointError: a GDN layer lacks its grouped projections, or their shapes do not fit the config.
    """
    from specpilot.model.gdn import split_grouped_projections

    out = dict(state)
    for i, kind in enumerate(args.layer_types):
        p = f"model.layers.{i}."
        if kind == "linear_attention":
            names = [p + "linear_attn.in_proj_qkvz.weight", p + "linear_attn.in_proj_ba.weight"]
            for n in names:
                if n not in out:
                    raise CheckpointError(f"{path}: weights missing from the checkpoint, e.g. {n!r}")
            try:
                parts = split_grouped_projections(out.pop(names[0]), out.pop(names[1]), args.linear_num_key_heads,
                                                  args.linear_num_value_heads, args.linear_key_head_dim,
                                                  args.linear_value_head_dim)
            except ValueError as e:
                raise CheckpointError(f"{path}: layer {i}: {e}") from None
            for n, t in zip(("qkv", "z", "b", "a"), parts):
                out[p + f"linear_attn.in_proj_{n}.weight"] = t
        fused = p + "mlp.experts.gate_up_proj"
        if fused in out and p + "mlp.experts.down_proj" in out:
            gate_up, down = out.pop(fused), out.pop(p + "mlp.experts.down_proj")
            half = gate_up.shape[1] // 2
            for e in range(gate_up.shape[0]):
                q = p + f"mlp.experts.{e}."
                out[q + "gate_proj.weight"], out[q + "up_proj.weight"] = gate_up[e, :half], gate_up[e, half:]
                out[q + "down_proj.weight"] = down[e]
    return out


def build_model(args: ModelArgs) -> Transformer:
    """An uninitialised target of ``args``' architecture: a :class:`Transformer`, or for a hybrid model type a
    :class:`~specpilot.model.hybrid.HybridTransformer` (Gated DeltaNet + gated attention; qwen3_next's MLPs
    mixtures of experts)."""
    if args.is_hybrid:
        from specpilot.model.hybrid import HybridTransformer

        return HybridTransformer(args)
    return Transformer(args)


def load_model(
    path: str | Path, dtype: str = "float32", device: str | torch.device = "cpu", fuse: bool = True,
    pack: bool | None = None,
) -> Transformer:
    """Build our :class:`Transformer` from checkpoint directory ``path``.

    Args:
        path: local checkpoint directory (a W12 directory is decoded and hash-checked, see
            :func:`read_state_dict`; the model holds plain weights: the ``w12`` mechanism re-encodes them).
        dtype: ``float32`` | ``bfloat16`` | ``float16`` for weights and activations.
        device: torch device.
        fuse: fuse q/k/v and gate/up into one GEMM each (:meth:`Transformer.fuse_projections`).
        pack: every projection and the LM head read a oneDNN-prepacked copy of their weight
            (:func:`specpilot.kernels.cpu_linear.pack_linears`: 1.06-2.5x faster per projection at 2-96 rows, twice
            the projections' weight memory); None = :func:`~specpilot.kernels.cpu_linear.pack_by_default`.
    Raises:
        CheckpointError: missing files, unsupported model_type, missing or mis-shaped tensors.
    """
    if dtype not in DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    args = read_args(path)
    state = read_state_dict(path)
    with torch.device("meta"):
        model = build_model(args)
    if args.is_hybrid:  # a multimodal qwen3_5 checkpoint keeps the text model under model.language_model
        state = {"model." + k[len("model.language_model."):] if k.startswith("model.language_model.") else k: t
                 for k, t in state.items()}
    if args.model_type == "qwen3_next":
        state = qwen3_next_state(state, args, path)
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if args.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = [k for k in expected if k not in state]
    if missing:
        raise CheckpointError(f"{path}: weights missing from the checkpoint, e.g. {missing[0]!r}")
    for k, shape in expected.items():
        if tuple(state[k].shape) != tuple(shape):
            raise CheckpointError(f"{path}: tensor {k!r} has shape {tuple(state[k].shape)}, config says {tuple(shape)}")
    model = model.to_empty(device=device)
    model.load_state_dict({k: state[k] for k in expected}, strict=False, assign=False)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(DTYPES[dtype])
    model.inv_freq = rope_inv_freq(args).to(device)  # built on the meta device above
    model = model.eval().requires_grad_(False)
    if fuse:
        model = model.fuse_projections()
    from specpilot.kernels.cpu_linear import pack_by_default, pack_linears

    if pack if pack is not None else pack_by_default(device, dtype):
        pack_linears(model)
    return model


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt")


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer through ``transformers.AutoTokenizer`` (local files only), or None when the
    directory holds no tokenizer file (:data:`TOKENIZER_FILES`), e.g. a ``specpilot zoo random`` checkpoint:
    transformers 5 would otherwise build an empty tokenizer from config.json alone that maps every text to
    no ids.

    Raises:
        CheckpointError: if ``path`` has tokenizer files that do not load.
    """
    from transformers import AutoTokenizer

    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many kinds here; the user needs one line
        raise CheckpointError(f"cannot load a tokenizer from {path}: {str(e).splitlines()[0]}") from None
