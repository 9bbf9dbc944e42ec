"""The static path of a pass through fused Triton kernels (CUDA; the Triton interpreter in tests).

At one verification row an 8B model's exact pass written op by op is ~1000 tiny kernels (float32 RMSNorm
alone is eight), about 3 ms of a 9 ms step on an H200; this path runs a decoder layer in 8 launches (+1
split-KV combine) with the same math as :meth:`~specpilot.model.layers.DecoderLayer.forward_static` up to
rounding (:mod:`specpilot.kernels.fused` says where each kernel rounds). The residual add is deferred into
the next norm. With W12 projections at one row, two more fusions apply where their kernels accept the shapes:
SwiGLU inside the down projection's activation load (:mod:`specpilot.w12.swiglu`, the same bits) and the
residual add + RMSNorm split across the GEMVs around them (:mod:`specpilot.w12.norm`). Which of these run is
the model's :class:`~specpilot.model.transformer.KernelConfig`.
"""

from __future__ import annotations

import torch

from specpilot.kernels import fused
from specpilot.kernels.gemm import cublas_linear, invariant_linear, linear
from specpilot.kernels.tree_attention import pack_tree_mask, tree_attention
from specpilot.w12 import norm as w12_norm
from specpilot.w12 import swiglu as w12_swiglu


def fused_layer(layer, x, delta, attend, lin, fuse_swiglu: bool, sq, fuse_norm: bool, next_norm):
    """One decoder layer on the fused path.

    Args:
        layer: the :class:`~specpilot.model.layers.DecoderLayer` (fused projections).
        x: ``[R, hidden]`` the residual stream; ``delta``: the previous layer's pending output (None first).
        attend: ``attend(qkv, q_norm_w, k_norm_w) -> [R, H, D]``: q/k norm, RoPE and this layer's K/V store, then
            attention (:func:`forward_fused`'s one cache, or :func:`forward_batch_fused`'s pool slots).
        lin: ``lin(x, nn.Linear)`` the projection
            (:func:`~specpilot.kernels.gemm.cublas_linear` or the skinny :func:`~specpilot.kernels.gemm.linear`).
        fuse_swiglu: a W12 down projection computes ``silu(gate) · up`` in its load where
            :func:`~specpilot.w12.swiglu.swiglu_fusable` holds (one launch fewer, the same bits).
        sq / fuse_norm / next_norm: with ``fuse_norm`` (one row, W12 projections on the one-row GEMV) the o
            projection adds the residual and gate_up normalises in its load; with ``next_norm = (qkv_proj,
            input_layernorm)`` of the next layer the down projection adds the residual too and the call returns
            ``(x, None, sq)``, ``sq`` the float32 tile sums of squares the next layer (given ``sq``) normalises with.
    Returns:
        ``(x, delta, sq)``: the residual stream, this layer's pending output (or None), the tile sums (or None).
    """
    attn, a = layer.self_attn, layer.self_attn.args
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    if sq is not None:
        qkv = w12_norm.w12_norm_in(x, sq, ln1.weight, ln1.eps, attn.qkv_proj)
    else:
        h, x = fused.add_rmsnorm(x, delta, ln1.weight, ln1.eps)
        qkv = lin(h, attn.qkv_proj)
    qn = (attn.q_norm.weight, attn.k_norm.weight) if a.qk_norm else (None, None)
    o = attend(qkv, *qn).reshape(x.shape[0], a.n_heads * a.head_dim)
    gate_up_proj, down = layer.mlp.gate_up_proj, layer.mlp.down_proj
    if fuse_norm and w12_norm.add_fusable(o, attn.o_proj, x) and w12_norm.norm_fusable(x, gate_up_proj, ln2.weight):
        x, sq = w12_norm.w12_add_residual(o, attn.o_proj, x)
        gate_up = w12_norm.w12_norm_in(x, sq, ln2.weight, ln2.eps, gate_up_proj)
    else:
        h, x = fused.add_rmsnorm(x, lin(o, attn.o_proj), ln2.weight, ln2.eps)
        gate_up = lin(h, gate_up_proj)
    glu = fuse_swiglu and w12_swiglu.swiglu_fusable(gate_up, down)
    act = gate_up if glu else fused.silu_mul(gate_up)
    if (fuse_norm and next_norm is not None and w12_norm.add_fusable(act, down, x, glu)
            and w12_norm.norm_fusable(x, next_norm[0], next_norm[1].weight)):
        x, sq = w12_norm.w12_add_residual(act, down, x, glu)
        return x, None, sq
    return x, w12_swiglu.w12_swiglu_down(act, down) if glu else lin(act, down), None


def forward_fused(model, x, cos, sin, cache, start: torch.Tensor, tree_mask, features: list | None,
                  feature_layers: tuple[int, ...]) -> torch.Tensor:
    """The static pass of ``model`` (a :class:`~specpilot.model.transformer.Transformer`) through
    :func:`fused_layer`; the tree mask is packed once per pass. ``x [R, hidden]`` embeddings -> final-norm
    hidden states ``[R, hidden]``; the outputs of ``feature_layers`` are appended to ``features``. With the
    model's ``kernels.aligned`` the pass is the batched engine's for one request (:func:`forward_batch_fused`'s
    kernels: batch-invariant GEMMs, AR-aligned attention over the cache as a pool of one slot), so its rows at
    their own positions carry the one-row AR pass's bits."""
    a = model.args
    aligned = model.kernels.aligned
    if aligned:
        from specpilot.kernels.batch_attention import batch_tree_attention, pack_batch_masks

        r = x.shape[0]
        words = pack_batch_masks(tree_mask[None])
        zero = torch.zeros(1, dtype=torch.int32, device=x.device)
        starts = start.reshape(1).to(torch.int32)
        counts = torch.full((1,), r, dtype=torch.int32, device=x.device)
    else:
        words = pack_tree_mask(tree_mask)

    def attend(i):
        def run(qkv, qw, kw):
            q = fused.qk_norm_rope_store(qkv, qw, kw, cos, sin, cache.k[i], cache.v[i], start, a.n_heads,
                                         a.n_kv_heads, a.rms_norm_eps)
            if aligned:
                return batch_tree_attention(q, cache.k[i][None], cache.v[i][None], zero, starts, counts, zero, words,
                                            r, a.head_dim**-0.5)
            return tree_attention(q, cache.k[i], cache.v[i], start, words, a.head_dim**-0.5)
        return run

    return _fused_layers(model, x, attend, features, feature_layers, invariant_linear if aligned else None)


def forward_batch_fused(model, x, cos, sin, pool, p, features: list | None, feature_layers: tuple[int, ...]):
    """A batched pass (:meth:`~specpilot.model.transformer.Transformer.forward_prepared`) through
    :func:`fused_layer`: each row's K/V stored at its own (pool slot, position) by the fused q/k kernel, then the
    Triton batched tree attention over every request's slot (:mod:`specpilot.kernels.batch_attention`); the
    projections through the batch-invariant GEMM where the model's kernels say ``batch_invariant``.
    ``x [R, hidden]`` -> ``[R, hidden]``; ``p`` a :class:`~specpilot.model.batch.Prepared` on the device."""
    from specpilot.kernels.batch_attention import batch_tree_attention

    a = model.args

    def attend(i):
        k, v = pool.k[:, i], pool.v[:, i]

        def run(qkv, qw, kw):
            q = fused.qk_norm_rope_store(qkv, qw, kw, cos, sin, k, v, None, a.n_heads, a.n_kv_heads, a.rms_norm_eps,
                                         rows=(p.slot, p.pos))
            return batch_tree_attention(q, k, v, p.slots, p.starts, p.counts, p.row_off, p.words, p.r_max,
                                        a.head_dim**-0.5)
        return run

    return _fused_layers(model, x, attend, features, feature_layers,
                         invariant_linear if model.kernels.batch_invariant else None)


def _fused_layers(model, x, attend, features, feature_layers, lin=None) -> torch.Tensor:
    """Every decoder layer through :func:`fused_layer` with ``attend(i)``'s attention and ``lin``'s projections
    (None: the model's kernel choice), then the final norm."""
    kc = model.kernels
    lin = lin or (linear if kc.skinny_gemm else cublas_linear)
    delta = sq = None
    layers = model.model.layers
    captured = {}
    for i, layer in enumerate(layers):
        nxt = layers[i + 1] if i + 1 < len(layers) else None
        next_norm = None if nxt is None else (nxt.self_attn.qkv_proj, nxt.input_layernorm)
        x, delta, sq = fused_layer(layer, x, delta, attend(i), lin, kc.fuse_swiglu, sq, kc.fuse_norm, next_norm)
        if i in feature_layers:
            captured[i] = x if delta is None else x + delta
    if feature_layers:
        features.extend(captured[i] for i in feature_layers)
    return fused.add_rmsnorm(x, delta, model.model.norm.weight, model.model.norm.eps)[0]
