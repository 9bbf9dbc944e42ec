"""One exact pass over the rows of several requests of a hybrid target (Gated DeltaNet + gated attention), eager
PyTorch (§2.2, §4.2, §4.4).

As a dense target's batched pass (:meth:`~specpilot.model.transformer.Transformer.forward_batch`), every request's
rows (``[root] + tree`` in a decode step, a prompt in a prefill) are packed into one ``[R]`` sequence, so the
projections, norms and MLPs (dense or mixture of experts) run once over all rows. What reads a request's state runs
per request, over its slot of the :class:`~specpilot.model.hybrid_pool.HybridPool`:

- gated attention: each row's K/V is written at its position in its request's slot; rows padded to ``[B, R_max]``
  attend to their slot's committed prefix and, among their request's rows, to what its mask allows (one masked
  SDPA, the dense reference's :func:`~specpilot.model.layers.grouped_sdpa`);
- a GDN layer: the input projections over all rows (:meth:`GatedDeltaNet.inputs`), then per request the conv and
  delta-rule steps along each row's root path (parents from its mask, :func:`~specpilot.model.gdn.parents_from_mask`)
  from that request's committed state and window (:meth:`GatedDeltaNet.mix`: the single-request pass's code), what
  its commit needs recorded in that request's cache; then the output norm and projection over all rows.

Each request's cache then commits as a single request's does (:meth:`HybridCache.commit`), so a request's output and
state do not depend on what shares its batch beyond float32 rounding of the shared GEMMs.
"""

from __future__ import annotations

import torch

from specpilot.errors import SpecPilotError
from specpilot.model.batch import Prepared
from specpilot.model.gdn import parents_from_mask
from specpilot.model.hybrid_pool import HybridPool
from specpilot.model.layers import grouped_sdpa


def forward_prepared(model, tokens: torch.Tensor, positions: torch.Tensor, pool: HybridPool, p: Prepared,
                     kernel: bool = False, prof=None, features: list | None = None,
                     feature_layers: tuple[int, ...] = ()) -> torch.Tensor:
    """Final-norm hidden states of one exact batched pass of a :class:`~specpilot.model.hybrid.HybridTransformer`.

    Args:
        model: the hybrid target; tokens / positions: ``[R] long``, request 0's rows, then request 1's, ...;
        pool: its :class:`HybridPool`; p: the :class:`~specpilot.model.batch.Prepared` rows (each request's rows
            start at its slot's committed length: a GDN state holds exactly the committed tokens);
        kernel: must be False (no batched kernel path for hybrids yet);
        prof / features / feature_layers: as :meth:`Transformer.forward` (features ``[R, hidden]`` over all rows).
    Returns:
        ``[R, hidden_size]`` in the model dtype.
    Raises:
        SpecPilotError: ``kernel`` (the Triton batched attention / CUDA-graph path is not built for hybrids).
        ValueError: a request's rows do not start at its slot's committed length.
    """
    if kernel:
        raise SpecPilotError("hybrid (Gated DeltaNet) targets have no batched kernel path yet: run the eager batched "
                             "pass (BatchEngine(padded=False), KernelConfig batch_kernel off)")
    counts, starts = p.counts.tolist(), p.starts.tolist()
    reqs, lo = [], 0
    for i, (slot, start, n) in enumerate(zip(p.slots.tolist(), starts, counts)):
        cache = pool.cache(slot)
        cache.begin_pass(start, n)  # raises unless start is the committed length
        reqs.append((cache, lo, lo + n, parents_from_mask(p.mask[i, :n, : start + n], start, n)))
        lo += n
    x, cos, sin = model._embed(tokens, positions, prof)
    return model._layers(x, lambda i, layer, h: _layer(layer, h, cos, sin, pool, p, reqs, prof), prof, features,
                         feature_layers)


def _layer(layer, x, cos, sin, pool: HybridPool, p: Prepared, reqs: list, prof) -> torch.Tensor:
    """:meth:`HybridLayer.forward` over the rows of every request: ``x [R, hidden]`` -> ``[R, hidden]``."""
    h = layer.input_layernorm(x)
    if layer.kind == "linear_attention":
        h = _gdn(layer.linear_attn, layer.slot, h, reqs)
    else:
        h = _attention(layer.self_attn, layer.slot, h, cos, sin, pool, p)
    x = x + h
    return x + layer.mlp(layer.post_attention_layernorm(x), prof)


def _gdn(m, slot: int, x: torch.Tensor, reqs: list) -> torch.Tensor:
    """GDN layer ``slot`` (its index among the GDN layers): projections over all rows, mixing per request from its
    cache's committed state and window (recorded for its commit), output over all rows. ``x [R, hidden]``."""
    mixed, z, g, beta = m.inputs(x)
    outs = [m.mix(mixed[lo:hi], g[lo:hi], beta[lo:hi], cache.state[slot], cache.window[slot], parents,
                  cache.recorder(slot), cache.keep_rows(hi - lo)) for cache, lo, hi, parents in reqs]
    return m.output(torch.cat(outs), z)


def _attention(attn, slot: int, x: torch.Tensor, cos, sin, pool: HybridPool, p: Prepared) -> torch.Tensor:
    """Gated attention layer ``slot`` (its index among the attention layers) over every request's rows, as
    :meth:`GatedAttention.forward` computes it for one: K/V written to each row's slot and position, then each
    request's rows attend to their slot (``p.mask``). ``x [R, hidden]`` -> ``[R, hidden]``."""
    a, r = attn.args, x.shape[0]
    q, k, v, gate = attn.project(x, cos, sin)
    pool.k[p.slot, slot, p.pos] = k.to(pool.k.dtype)
    pool.v[p.slot, slot, p.pos] = v.to(pool.v.dtype)
    keys = pool.k[:, slot, : p.span].index_select(0, p.slots)  # [B, span, KVH, D]
    vals = pool.v[:, slot, : p.span].index_select(0, p.slots)
    qp = q.new_zeros(len(p.slots), p.r_max, a.n_heads, a.head_dim)
    qp[p.req, p.j] = q
    o = grouped_sdpa(qp, keys, vals, p.mask)[p.req, p.j].reshape(r, a.n_heads * a.head_dim)
    return attn.o_proj(o * torch.sigmoid(gate.reshape(r, -1)))
