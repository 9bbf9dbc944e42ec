"""Cost drafters: a drafter of a real drafter's shape whose proposals are run and discarded, so a simulated drafter
(:mod:`specpilot.spec.calibrated`) costs what the real one would (§3.2: the cost model's ``drafter`` class).

A spec is a small JSON object relative to the target (block widths default to the target's), so a calibration
measured on a small real pair can carry the cost of a drafter for a large target with random weights.
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from specpilot.errors import DrafterError
from specpilot.spec.drafter import SlotFanout


def cost_spec_of(drafter) -> dict:
    """The cost spec of a real drafter object, relative to the target so it carries to a larger one: ``ngram`` with
    its suffix lengths; ``block`` with its layers, block size, Markov rank and number of target layers (the layer
    widths are the target's when built); ``draft_model`` with the draft model's own architecture.

    Raises:
        DrafterError: a drafter kind without a cost spec.
    """
    from specpilot.spec.block import BlockDrafter
    from specpilot.spec.draft_model import DraftModelDrafter
    from specpilot.spec.ngram import NgramDrafter

    if isinstance(drafter, NgramDrafter):
        return {"kind": "ngram", "ngram_max": drafter.ngram_max, "ngram_min": drafter.ngram_min}
    if isinstance(drafter, BlockDrafter):
        c = drafter.cfg
        return {"kind": "block", "layers": c.layers, "block_size": c.block_size, "markov_rank": c.markov_rank,
                "n_target_layers": len(c.target_layers)}
    if isinstance(drafter, DraftModelDrafter):
        return {"kind": "draft_model", "args": asdict(drafter.model.args)}
    raise DrafterError(f"no cost spec for a {type(drafter).__name__} drafter")


def _random_init(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """N(0, 0.02) weights, ones for vectors, from a generator of its own (torch's global generator untouched)."""
    dev = next(module.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=dev, dtype=torch.float32) * 0.02)
    return module.eval().requires_grad_(False)


def cost_drafter(spec: dict | None, target, top_k: int, slots: int = 1, static_step: bool = False):
    """A drafter of the real drafter's shape for ``target``, holding ``slots`` requests, whose proposals the calibrated
    drafter runs and discards (the drafting cost); ``static_step``: a block network's step runs from CUDA graphs
    (:class:`~specpilot.spec.block.BlockDrafter`'s static step for one slot, its batched one for more), as in a
    graphed engine. ``spec`` (a calibration's ``cost``):

    - None or ``{"kind": "none"}``: None (no cost);
    - ``{"kind": "ngram", "ngram_max": 4, "ngram_min": 1}``: the n-gram index;
    - ``{"kind": "block", "layers": 1, "block_size": 16, "markov_rank": 0, "n_target_layers": 3}`` (optional
      ``target_layers``, ``heads``, ``kv_heads``, ``head_dim``, ``intermediate_size``, ``draft_vocab_size``,
      ``seed``; widths default to
      the target's, target layers to ``n_target_layers`` spread over 1 … L-2): a randomly initialised block network
      (§1.1) reading the target's features;
    - ``{"kind": "draft_model", "args": {ModelArgs fields}}`` or ``{"kind": "draft_model", "path": DIR}``: a random
      (or loaded) draft model with the target's vocabulary, drafting sequentially.

    Raises:
        DrafterError: an unknown kind or a spec that does not build (the message says which field).
    """
    from specpilot.model.args import ModelArgs, rope_inv_freq
    from specpilot.model.checkpoint import build_model, load_model
    from specpilot.spec.block import TOP_K as BLOCK_TOP_K
    from specpilot.spec.block import BlockDrafter
    from specpilot.spec.block_net import BlockConfig, BlockNet
    from specpilot.spec.draft_model import DraftModelDrafter
    from specpilot.spec.ngram import NgramDrafter

    kind, a = (spec or {}).get("kind", "none"), target.args
    try:
        if kind == "none":
            return None
        if kind == "ngram":
            return NgramDrafter(spec.get("ngram_max", 4), spec.get("ngram_min", 1), max(top_k, 1), max(slots, 1024))
        if kind == "block":
            n = spec.get("n_target_layers", 3)
            lo, hi = (1, a.num_layers - 2) if a.num_layers >= 4 else (0, a.num_layers - 1)
            layers = spec.get("target_layers") or sorted({round(lo + i * (hi - lo) / max(n - 1, 1)) for i in range(n)})
            cfg = BlockConfig(spec.get("block_size", 16), spec.get("markov_rank", 0), spec.get("layers", 1),
                              spec.get("heads") or a.n_heads, spec.get("kv_heads") or a.n_kv_heads,
                              spec.get("head_dim") or a.head_dim, spec.get("intermediate_size") or a.intermediate_size,
                              [min(max(i, 0), a.num_layers - 1) for i in layers], a.hidden_size, a.vocab_size,
                              a.num_layers, a.model_type, a.rms_norm_eps, a.rope_theta,
                              draft_vocab_size=spec.get("draft_vocab_size", 0))
            with torch.device("meta"):
                net = BlockNet(cfg)
            net = _random_init(net.to_empty(device=target.device).to(target.dtype), spec.get("seed", 0))
            if cfg.draft_vocab_size:  # the first ids (random weights: no frequencies to rank them by)
                net.draft_ids.copy_(torch.arange(cfg.draft_vocab_size))
            return BlockDrafter(net, target, min(top_k, BLOCK_TOP_K), 4096 if slots == 1 else 512, slots,
                                static_step=static_step and slots == 1,
                                batch_step=static_step and slots > 1 and cfg.markov_rank == 0)
        if kind == "draft_model":
            if "path" in spec:
                model = load_model(spec["path"], str(target.dtype).removeprefix("torch."), target.device)
            else:
                margs = ModelArgs(**{**spec["args"], "vocab_size": a.vocab_size})
                with torch.device("meta"):  # a hybrid draft model's args build a hybrid model
                    model = build_model(margs)
                model = _random_init(model.to_empty(device=target.device).to(target.dtype), spec.get("seed", 0))
                model.inv_freq = rope_inv_freq(margs).to(target.device)
                model = model.fuse_projections()
            made = [DraftModelDrafter(model, top_k=top_k) for _ in range(slots)]
            return made[0] if slots == 1 else SlotFanout(made)
    except (KeyError, TypeError, ValueError) as e:
        raise DrafterError(f"cost drafter spec {spec}: {type(e).__name__}: {e}") from None
    raise DrafterError(f"unknown cost drafter kind {kind!r} (none, ngram, block, draft_model)")
