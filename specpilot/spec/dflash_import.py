"""Public DFlash block-drafter checkpoints (z-lab's ``DFlashDraftModel``, e.g. ``z-lab/Qwen3-8B-DFlash-b16``) loaded
as our block drafter (§1.1): a :class:`~specpilot.spec.block_net.BlockNet` with the DFlash options on.

Layout read: ``config.json`` (a Qwen3 decoder config with ``block_size``, ``num_target_layers`` and
``dflash_config: {target_layer_ids, mask_token_id}``) and ``model.safetensors`` or shards listed by
``model.safetensors.index.json``, keys ``layers.{i}.self_attn.{q,k,v,o}_proj / {q,k}_norm``,
``layers.{i}.mlp.{gate,up,down}_proj``, ``layers.{i}.{input,post_attention}_layernorm``, ``fc``, ``hidden_norm``,
``norm`` (an optional ``model.`` prefix is dropped; ``embed_tokens`` / ``lm_head`` copies and rotary caches are
ignored: DFlash uses the target's embedding and LM head, as we do).

The math, compared with our BlockNet (the same up to names unless said):

- context: the outputs of target layers ``target_layer_ids`` (HF ``hidden_states[id + 1]``, our features),
  concatenated, ``hidden_norm(fc(.))`` = our ``ctx_norm(fc(.))``. For the target's last layer HF hands the
  final-normed state, which our engine does not capture: such ids are refused.
- context K/V: each layer's ``k_proj`` / ``v_proj`` of the fused context *without* that layer's input norm
  (ours normalizes it) -> ``ctx_layer_norm=False``; then ``k_norm`` and RoPE at the context positions, as ours.
- block rows: the target's embedding of ``[anchor, mask_token_id × (B − 1)]`` at positions ``L … L + B − 1``
  -> ``mask_embed`` is filled with the target's embedding row of ``mask_token_id`` (ours: a learned vector).
- attention: non-causal (every block row sees the whole context and every block row), row ``j ≥ 1`` predicts the
  token at its own position, the anchor row's output is unused -> ``diffusion_block=True`` and our ``block_size``
  is DFlash's minus one (B − 1 positions drafted per pass).
- the same: per-head q/k RMS norms, rotate-half RoPE with the config's ``rope_theta``, scale 1/√head_dim, GQA,
  pre-norm residual layers with a SwiGLU MLP, a final norm, then the target's LM head; absolute position ids.

Loaded in place (``--drafter-path <downloaded dir>``; :func:`specpilot.spec.block.load_block` dispatches here)
rather than converted by an ``import-dflash`` command: the mask row is the target's own embedding, so a converted
directory would be valid for that target only anyway; in place keeps one copy of the weights and no conversion
step can drift from the published files. Checked against logits of the public reference implementation
(``tests/test_dflash_import.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specpilot.errors import DrafterError
from specpilot.spec.block_net import BlockConfig, BlockNet

ARCHITECTURE = "DFlashDraftModel"
_IGNORED = ("embed_tokens.", "lm_head.", "rotary_emb.")  # DFlash uses the target's; HF rotary caches


def _config(path) -> dict | None:
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def is_dflash_dir(path) -> bool:
    """True when ``path/config.json`` is a DFlash drafter's (architecture ``DFlashDraftModel`` or a
    ``dflash_config`` entry)."""
    raw = _config(path)
    return raw is not None and (ARCHITECTURE in (raw.get("architectures") or []) or "dflash_config" in raw)


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default target layers when a config names none: the middle layer for a 1-layer drafter, else
    ``num_draft_layers`` ids spread evenly (rounded) from 1 to ``num_target_layers − 3``."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    end = num_target_layers - 3
    return [int(round(1 + i * (end - 1) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def dflash_block_config(raw: dict, target_args, where: str = "DFlash checkpoint") -> BlockConfig:
    """The :class:`BlockConfig` of a DFlash ``config.json`` (parsed) for a target with ``target_args``
    (:class:`~specpilot.model.args.ModelArgs`).

    Raises:
        DrafterError: a field missing or of the wrong kind, a feature we do not run (sliding-window layers,
            attention biases, a non-SiLU MLP, RoPE scaling), or the drafter does not fit the target (hidden size,
            vocabulary, mask token, number of target layers, target layer ids beyond its depth or its last layer).
    """
    dc = raw.get("dflash_config") or {}
    if not isinstance(dc, dict):
        raise DrafterError(f"{where}: dflash_config must be an object, got {type(dc).__name__}")

    def need(key, kind=int, src=raw):
        v = src.get(key)
        if not isinstance(v, kind) or isinstance(v, bool):
            raise DrafterError(f"{where}: config.json needs {key!r} ({kind.__name__}), found {v!r}")
        return v

    ta = target_args
    hidden, layers, heads = need("hidden_size"), need("num_hidden_layers"), need("num_attention_heads")
    kv_heads = raw.get("num_key_value_heads", heads)
    head_dim = raw.get("head_dim") or hidden // heads
    block = dc.get("block_size", raw.get("block_size"))
    mask_id = dc.get("mask_token_id", raw.get("mask_token_id"))
    n_target = raw.get("num_target_layers", ta.num_layers)
    ids = dc.get("target_layer_ids", raw.get("target_layer_ids")) or default_layer_ids(n_target, layers)
    if not isinstance(kv_heads, int) or not isinstance(head_dim, int) or kv_heads < 1 or heads % kv_heads:
        raise DrafterError(f"{where}: {heads} attention heads do not split into {kv_heads!r} key/value heads")
    if not isinstance(block, int) or block < 2:
        raise DrafterError(f"{where}: block_size must be an integer >= 2 (anchor + masks), found {block!r}")
    if not isinstance(mask_id, int):
        raise DrafterError(f"{where}: dflash_config.mask_token_id (an integer) is missing")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise DrafterError(f"{where}: dflash_config.target_layer_ids must be a list of integers, found {ids!r}")
    if raw.get("attention_bias") or raw.get("mlp_bias") or raw.get("hidden_act", "silu") != "silu":
        raise DrafterError(f"{where}: attention/MLP biases or a non-SiLU activation are not supported")
    if raw.get("use_sliding_window") or any(t != "full_attention" for t in raw.get("layer_types") or []):
        raise DrafterError(f"{where}: sliding-window drafter layers are not supported")
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise DrafterError(f"{where}: RoPE scaling {rope.get('rope_type', rope.get('type'))!r} is not supported")
    theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
    if hidden != ta.hidden_size or raw.get("vocab_size", ta.vocab_size) != ta.vocab_size:
        raise DrafterError(f"{where} was built for hidden {hidden} / vocab {raw.get('vocab_size')}, the target has "
                           f"hidden {ta.hidden_size} / vocab {ta.vocab_size}")
    if n_target != ta.num_layers:
        raise DrafterError(f"{where} was built for a target of {n_target} layers, the target has {ta.num_layers}")
    if not ids or min(ids) < 0 or max(ids) >= ta.num_layers - 1:
        raise DrafterError(f"{where} reads target layers {ids}, the target has {ta.num_layers} layers (ids 0 to "
                           f"{ta.num_layers - 2}: HF hands the last layer's output final-normed)")
    if not 0 <= mask_id < ta.vocab_size:
        raise DrafterError(f"{where}: mask_token_id {mask_id} is outside the target's vocabulary of {ta.vocab_size}")
    return BlockConfig(block_size=block - 1, markov_rank=0, layers=layers, heads=heads, kv_heads=kv_heads,
                       head_dim=head_dim, intermediate_size=need("intermediate_size"), target_layers=list(ids),
                       target_hidden=hidden, vocab_size=ta.vocab_size, target_num_layers=ta.num_layers,
                       target_model_type=ta.model_type, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                       rope_theta=float(theta), ctx_layer_norm=False, diffusion_block=True, mask_token_id=mask_id)


def read_weights(path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory: ``model.safetensors``, or the shards named by
    ``model.safetensors.index.json``. Raises :class:`DrafterError` when neither is there, a shard is missing or one
    is unreadable."""
    from specpilot.fileio import load_safetensors

    p = Path(path)
    if (p / "model.safetensors").is_file():
        files = [p / "model.safetensors"]
    elif (p / "model.safetensors.index.json").is_file():
        try:
            wmap = json.loads((p / "model.safetensors.index.json").read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            raise DrafterError(f"{p}/model.safetensors.index.json has no readable weight_map") from None
        files = [p / f for f in sorted(set(wmap.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise DrafterError(f"{p}: shard(s) {', '.join(missing)} named by model.safetensors.index.json are missing")
    else:
        raise DrafterError(f"{p} has no model.safetensors (nor model.safetensors.index.json)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_safetensors(f, DrafterError))
    return out


def _our_name(key: str) -> str:
    """A DFlash weight name -> ours (``self_attn.`` dropped; ``hidden_norm`` -> ``ctx_norm``)."""
    return key.replace(".self_attn.", ".").replace("hidden_norm.", "ctx_norm.")


def load_dflash(path, target) -> BlockNet:
    """Load a DFlash drafter directory for ``target`` (:class:`~specpilot.model.transformer.Transformer`), in the
    target's dtype and device, its ``mask_embed`` the target's embedding of ``mask_token_id``.

    Raises:
        DrafterError: not a DFlash directory, a config that does not fit the target (:func:`dflash_block_config`),
            weights missing, unexpected or of the wrong shape.
    """
    p = Path(path)
    raw = _config(p)
    if raw is None or not is_dflash_dir(p):
        raise DrafterError(f"{p} is not a DFlash drafter directory (config.json with \"architectures\": "
                           f"[\"{ARCHITECTURE}\"] or a dflash_config)")
    cfg = dflash_block_config(raw, target.args, f"DFlash drafter {p}")
    sd = read_weights(p)
    keys = list(sd)
    if keys and all(k.startswith("model.") for k in keys):
        sd = {k[len("model."):]: v for k, v in sd.items()}
    sd = {_our_name(k): v for k, v in sd.items() if not k.startswith(_IGNORED) and ".rotary_emb." not in k}
    with torch.device("meta"):  # no initialisation: every parameter is loaded next
        net = BlockNet(cfg)
    want = {k: tuple(v.shape) for k, v in net.state_dict().items() if k != "mask_embed"}
    missing = sorted(set(want) - set(sd))
    extra = sorted(set(sd) - set(want))
    if missing or extra:
        what = (f"misses {len(missing)} weight(s) ({', '.join(missing[:3])})" if missing
                else f"has {len(extra)} unexpected weight(s) ({', '.join(extra[:3])})")
        raise DrafterError(f"DFlash drafter {p} {what} for its config.json ({cfg.layers} layers)")
    for k, shape in want.items():
        if tuple(sd[k].shape) != shape:
            raise DrafterError(f"DFlash drafter {p}: weight {k} has shape {tuple(sd[k].shape)}, its config.json "
                               f"implies {shape}")
    sd["mask_embed"] = target.model.embed_tokens.weight[cfg.mask_token_id].detach().float().cpu()
    net = net.to_empty(device="cpu")
    net.load_state_dict({k: v.float() for k, v in sd.items()})
    return net.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
