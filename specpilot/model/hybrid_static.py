"""The hybrid target's static exact pass and its commit: shapes from the row count alone, no host sync on CUDA, so
one CUDA graph per row bucket replays any tree (§4.2; :class:`~specpilot.engine.runner.BucketRunner`'s contract).

The same math as the eager :meth:`~specpilot.model.hybrid.HybridTransformer.forward`, with every host decision moved
to the device:

- each row's parent is derived from the ``[B, B]`` tree mask on the device (the nearest ancestor: the highest-index
  ancestor other than itself; −1 a root over the committed state), and from the parents the conv gather index along
  root paths (the K − 1 inputs before a row: its ancestors, then the committed window);
- a GDN layer's delta rule runs through the path kernel :func:`~specpilot.kernels.gdn_tree.gdn_tree` (root paths
  computed once a pass, shared by every GDN layer) when the cache says so (:attr:`HybridCache.gdn_kernels`: on CUDA
  with triton; with :attr:`KernelConfig.gdn_wy` the WY-form kernel :func:`~specpilot.kernels.gdn_wy.gdn_tree_wy`
  instead, up to 64 rows), else the plain reference :func:`~specpilot.kernels.gdn_tree.gdn_tree_reference` (CPU;
  it reads the parents on the host). No per-row state is kept: the pass writes its rows' step inputs (k, v, g, β) and conv
  inputs into the cache's static buffers of the bucket (:class:`StaticRecord`), from which :func:`commit_path`
  replays the accepted path (``gdn_commit``, one launch for every GDN layer, or the reference replay);
- with the cache's GDN kernels the glue between the GEMMs runs fused (:mod:`specpilot.kernels.hybrid_glue`): one
  launch for a GDN layer's conv, SiLU, L2 norms and gates, which writes the record directly, one for its gated output
  norm, one for each zero-centred layer norm (the second with the residual add); the CPU keeps the PyTorch glue;
- an attention layer writes its rows' K/V at ``start + arange(B)`` (padding rows' K/V land past the real rows,
  which nothing reads) and attends to the prefix plus its tree-mask ancestors: the Triton tree attention on CUDA for
  head dims it supports, else one masked grouped SDPA over the whole cache with a mask built on the device (head
  dim 256, e.g. Qwen3.5: every slot is read, the masked ones weigh exactly zero);
- a mixture-of-experts MLP runs every expert on every row, each weighted by the row's routing weight (zero for an
  expert the row did not pick): the eager reference's sum in the same expert order, without its host-side loop over
  the experts picked (correct, not fast: every expert's weights are read).

Padding rows (a diagonal mask, as the runner pads) are roots: their GDN step and outputs are computed and unused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specpilot.kernels.tree_attention import SUPPORTED_HEAD_DIMS, pack_tree_mask, tree_attention
from specpilot.kernels.tree_attention import triton as _triton  # None without triton
from specpilot.kernels.gdn_tree import gdn_commit, gdn_commit_reference, gdn_tree, gdn_tree_reference, root_paths
from specpilot.kernels.gdn_wy import gdn_tree_wy
from specpilot.kernels.gdn_wy import tree_mask as wy_tree_mask
from specpilot.kernels.hybrid_glue import gated_rmsnorm, gdn_premix, zc_rmsnorm
from specpilot.model.layers import grouped_sdpa, region
from specpilot.model.moe import SparseMoE

#: The largest bucket whose GDN layers the WY kernel verifies (KernelConfig.gdn_wy); larger ones use the path kernel.
#: The WY kernel pads rows to a power of two: on the H200 it beat the path kernel at 16 and 32 rows (48 layers, 32
#: nodes: 0.95 vs 1.65 ms) and lost at 64 (4.08 vs 3.22 ms), and a whole step verifying a 32-node tree (bucket 40,
#: padded to 64) took 31.2 ms with it against 29.2 with the path kernel (results/hybrid_gpu_h200_2026-12-04_915283a/).
WY_ROWS = 32


@dataclass
class StaticRecord:
    """What a static pass of ``B`` rows leaves for its commit, per GDN layer ``L`` (fixed addresses: one per bucket).

    Attributes:
        k: ``[L, B, H, d_k]`` float32, v: ``[L, B, H, d_v]`` float32, g, beta: ``[L, B, H]`` float32: the rows'
            delta-rule inputs (q is not needed to move the state); mixed: ``[L, B, C]`` model dtype, the rows' conv
            inputs (the window follows the accepted path).
    """

    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    mixed: torch.Tensor

    @classmethod
    def empty(cls, layers: int, rows: int, heads: int, dk: int, dv: int, conv: int, dtype, device) -> "StaticRecord":
        """Zeroed buffers for ``rows`` rows (bytes: ``layers · rows · (4 H (d_k + d_v + 2) + C · itemsize)``)."""
        f = dict(dtype=torch.float32, device=device)
        return cls(torch.zeros(layers, rows, heads, dk, **f), torch.zeros(layers, rows, heads, dv, **f),
                   torch.zeros(layers, rows, heads, **f), torch.zeros(layers, rows, heads, **f),
                   torch.zeros(layers, rows, conv, dtype=dtype, device=device))


def parents_on_device(tree_mask: torch.Tensor) -> torch.Tensor:
    """``tree_mask [B, B]`` bool (ancestor-or-self) -> parents ``[B] long`` on its device: each row's highest-index
    ancestor other than itself, −1 for a root. No host sync."""
    b = tree_mask.shape[0]
    idx = torch.arange(b, device=tree_mask.device)
    anc = tree_mask & (idx[:, None] != idx[None, :])
    return torch.where(anc, idx[None, :], -1).amax(1)


def conv_index_on_device(parents: torch.Tensor, k: int) -> torch.Tensor:
    """The device form of :func:`~specpilot.model.gdn.conv_index`: ``parents [B] long`` -> ``[B, k] long`` indices
    into ``cat(window [k − 1, C], inputs [B, C])``, row j's root-path inputs oldest first, itself last."""
    b, dev = parents.shape[0], parents.device
    w = k - 1
    back = torch.cat((torch.arange(w, device=dev) - 1, torch.where(parents >= 0, parents + w, w - 1)))
    cols = [torch.arange(b, device=dev) + w]
    for _ in range(w):
        cols.append(back[cols[-1]])
    return torch.stack(cols[::-1], dim=1)


def attend_mask(tree_mask: torch.Tensor, start: torch.Tensor, slots: int) -> torch.Tensor:
    """``[B, slots]`` bool: row r may attend slot s when ``s < start`` or ``s = start + c`` with ``tree_mask[r, c]``."""
    b = tree_mask.shape[0]
    rel = torch.arange(slots, device=tree_mask.device) - start
    inside = (rel >= 0) & (rel < b)
    return (rel < 0)[None, :] | (inside[None, :] & tree_mask[:, rel.clamp(0, b - 1)])


@dataclass
class _Pass:
    """Per-pass tensors every layer shares."""

    cache: object
    start: torch.Tensor
    tree_mask: torch.Tensor
    conv_idx: torch.Tensor
    parents: torch.Tensor | list[int]
    paths: torch.Tensor | None
    wy_mask: torch.Tensor | None  # the WY kernel's ancestor mask (KernelConfig.gdn_wy), else None
    attend: torch.Tensor | None  # [B, S] mask of the SDPA path, or None when the tree attention kernel runs
    packed: torch.Tensor | None  # the kernel's packed tree mask
    rec: StaticRecord
    prof: object


def _gdn(mod, x: torch.Tensor, p: _Pass, slot: int) -> torch.Tensor:
    """One GDN token mixer over the pass's rows (:meth:`GatedDeltaNet.forward`'s math). ``x [B, hidden]``."""
    r, rec, cache = x.shape[0], p.rec, p.cache
    if cache.gdn_kernels:
        return _gdn_fused(mod, x, p, slot)
    mixed, z, g, beta = mod.inputs(x)
    seq = torch.cat((cache.window[slot].to(mixed.dtype), mixed))
    conv = F.silu((seq[p.conv_idx] * mod.conv1d.weight[:, 0, :].t()[None]).sum(1))
    q, k, v = mod.qkv(conv)
    rec.mixed[slot].copy_(mixed)
    rec.k[slot].copy_(k)
    rec.v[slot].copy_(v)
    rec.g[slot].copy_(g)
    rec.beta[slot].copy_(beta)
    if p.wy_mask is not None:
        o = gdn_tree_wy(cache.state[slot], q, rec.k[slot], rec.v[slot], rec.g[slot], rec.beta[slot], mask=p.wy_mask)
    elif p.paths is not None:
        o = gdn_tree(cache.state[slot], q, rec.k[slot], rec.v[slot], rec.g[slot], rec.beta[slot], paths=p.paths)
    else:
        o = gdn_tree_reference(cache.state[slot], q, k, v, g, beta, p.parents)
    o = mod.norm(o.to(x.dtype), z)
    return mod.out_proj(o.reshape(r, mod.hv * mod.dv))


def _gdn_fused(mod, x: torch.Tensor, p: _Pass, slot: int) -> torch.Tensor:
    """:func:`_gdn` through the fused glue kernels (the cache runs the GDN kernels): the projections, one
    :func:`~specpilot.kernels.hybrid_glue.gdn_premix` (conv, SiLU, L2 norms, gates; k, v, g, β and the conv inputs
    written into the record), the path or WY kernel, one :func:`~specpilot.kernels.hybrid_glue.gated_rmsnorm`, the
    out projection."""
    rec, cache = p.rec, p.cache
    mixed, z, b, a = mod.project(x)
    k, v, g, beta = rec.k[slot], rec.v[slot], rec.g[slot], rec.beta[slot]
    q = gdn_premix(mixed, cache.window[slot], p.conv_idx, mod.conv1d.weight, b, a, mod.A_log, mod.dt_bias, mod.hk,
                   mod.dk, k, v, g, beta, rec.mixed[slot])
    if p.wy_mask is not None:
        o = gdn_tree_wy(cache.state[slot], q, k, v, g, beta, mask=p.wy_mask)
    else:
        o = gdn_tree(cache.state[slot], q, k, v, g, beta, paths=p.paths)
    return mod.out_proj(gated_rmsnorm(o, z, mod.norm.weight, mod.norm.eps))


def _attention(mod, x: torch.Tensor, cos, sin, p: _Pass, slot: int) -> torch.Tensor:
    """One gated attention over the prefix and the rows' tree (:meth:`GatedAttention.forward`'s math)."""
    a, r, cache = mod.args, x.shape[0], p.cache
    q, k, v, gate = mod.project(x, cos, sin)
    slots = p.start + torch.arange(r, device=x.device)
    cache.k[slot].index_copy_(0, slots, k)
    cache.v[slot].index_copy_(0, slots, v)
    if p.attend is None:
        o = tree_attention(q.contiguous(), cache.k[slot], cache.v[slot], p.start, p.packed, a.head_dim**-0.5)
    else:
        o = grouped_sdpa(q[None], cache.k[slot][None], cache.v[slot][None], p.attend[None])[0]
    return mod.o_proj(o.reshape(r, a.n_heads * a.head_dim) * torch.sigmoid(gate.reshape(r, -1)))


def moe_static(moe: SparseMoE, x: torch.Tensor, prof=None) -> torch.Tensor:
    """:meth:`SparseMoE.forward` without host reads: every expert on every row, weighted by the row's routing weight
    (0 where not picked), added in expert order. ``x [R, hidden]`` -> same shape and dtype."""
    with region(prof, "projections"):
        weights, idx = moe.route(x)
    dense = torch.zeros(x.shape[0], len(moe.experts), dtype=weights.dtype, device=x.device).scatter_(1, idx, weights)
    out = torch.zeros_like(x)
    for e, expert in enumerate(moe.experts):
        out = out + expert(x, prof) * dense[:, e, None]
    shared = moe.shared_expert(x, prof)
    with region(prof, "projections"):
        return out + torch.sigmoid(moe.shared_expert_gate(x)) * shared


def _layer(layer, x: torch.Tensor, cos, sin, p: _Pass) -> torch.Tensor:
    """One decoder layer; with the cache's GDN kernels its two zero-centred norms (the second with the residual add)
    run as :func:`~specpilot.kernels.hybrid_glue.zc_rmsnorm`, one launch each."""
    ln1, ln2, fused = layer.input_layernorm, layer.post_attention_layernorm, p.cache.gdn_kernels
    h = zc_rmsnorm(x, None, ln1.weight, ln1.eps)[0] if fused else ln1(x)
    if layer.kind == "linear_attention":
        h = _gdn(layer.linear_attn, h, p, layer.slot)
    else:
        h = _attention(layer.self_attn, h, cos, sin, p, layer.slot)
    if fused:
        h, x = zc_rmsnorm(x, h, ln2.weight, ln2.eps)
    else:
        x = x + h
        h = ln2(x)
    return x + (moe_static(layer.mlp, h, p.prof) if isinstance(layer.mlp, SparseMoE) else layer.mlp(h, p.prof))


def forward_static(model, tokens: torch.Tensor, positions: torch.Tensor, cache, start: torch.Tensor,
                   tree_mask: torch.Tensor, prof=None, features: list | None = None,
                   feature_layers: tuple[int, ...] = ()) -> torch.Tensor:
    """Final-norm hidden states of an exact pass of ``B`` rows whose shapes depend only on ``B`` (module doc).

    Args:
        model: the :class:`~specpilot.model.hybrid.HybridTransformer`; cache: its
            :class:`~specpilot.model.hybrid_cache.HybridCache` (committed GDN state read, never written).
        tokens / positions: ``[B] long``; start: 0-d long device tensor, the committed length (a hybrid pass must
            start there: the caller declares the pass with ``cache.begin_pass(start, rows, B)`` for the commit);
        tree_mask: ``[B, B]`` bool among the rows (ancestor-or-self; padding rows see themselves);
        prof / features / feature_layers: as :meth:`~specpilot.model.transformer.Transformer.forward`.
    Returns:
        ``[B, hidden_size]`` in the model dtype. Writes the rows' K/V at ``start + arange(B)`` and the rows' step
        and conv inputs into ``cache.static_record(B)``.
    """
    b, dev = tokens.shape[0], tokens.device
    a = model.args
    parents = parents_on_device(tree_mask)
    kernels = cache.gdn_kernels
    wy = kernels and model.kernels.gdn_wy and b <= WY_ROWS
    attn_kernel = dev.type == "cuda" and _triton is not None and a.head_dim in SUPPORTED_HEAD_DIMS
    p = _Pass(cache=cache, start=start, tree_mask=tree_mask,
              conv_idx=conv_index_on_device(parents, a.linear_conv_kernel_dim),
              parents=parents if kernels else parents.tolist(),  # the CPU reference walks parents on the host
              paths=root_paths(parents.to(torch.int32)) if kernels and not wy else None,
              wy_mask=wy_tree_mask(parents.to(torch.int32)) if wy else None,
              attend=None if attn_kernel else attend_mask(tree_mask, start, cache.max_len),
              packed=pack_tree_mask(tree_mask) if attn_kernel else None,
              rec=cache.static_record(b), prof=prof)
    x, cos, sin = model._embed(tokens, positions, prof)
    return model._layers(x, lambda i, layer, h: _layer(layer, h, cos, sin, p), prof, features, feature_layers)


def commit_path(state: torch.Tensor, window: torch.Tensor, rec: StaticRecord, rows: torch.Tensor,
                kernels: bool) -> None:
    """Move every GDN layer's committed state and conv window along an accepted path, in place (graph-capturable
    with ``kernels``).

    Args:
        state: ``[L, H, d_k, d_v]`` float32; window: ``[L, K − 1, C]``: the cache's committed tensors.
        rec: the static pass's :class:`StaticRecord` (``B`` rows).
        rows: ``[B] int32`` on the state's device: the accepted rows root first, then −1 entries.
        kernels: replay with the Triton commit kernel (the pass ran the path kernel: the same bits), else the
            PyTorch reference (the pass ran the reference).
    """
    if kernels:
        gdn_commit(state, rec.k, rec.v, rec.g, rec.beta, rows)
    else:
        state.copy_(gdn_commit_reference(state, rec.k, rec.v, rec.g, rec.beta, rows))
    w, b = window.shape[1], rows.shape[0]
    if w == 0:
        return
    n = (rows >= 0).sum()
    pos = n + torch.arange(w, device=rows.device)  # the new window: entries n .. n + w − 1 of cat(window, path)
    from_path = rows[(pos - w).clamp(0, b - 1)].long().clamp(min=0)
    old = window.gather(1, pos.clamp(max=w - 1)[None, :, None].expand(window.shape[0], w, window.shape[2]))
    new = rec.mixed.gather(1, from_path[None, :, None].expand(window.shape[0], w, window.shape[2]))
    window.copy_(torch.where((pos < w)[None, :, None], old, new.to(window.dtype)))
