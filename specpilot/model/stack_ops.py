"""The two ops the compiled CPU stack (:mod:`~specpilot.model.compiled_stack`) leaves opaque to Inductor, their
per-owner table, and the decode attention forms they choose between.

- ``specpilot::stack_linear(x, owner, index)``: a projection through the target's own module (the oneDNN-prepacked
  :class:`~specpilot.kernels.cpu_linear.PackedLinear`, a plain ``nn.Linear``, a W12 layer), the eager pass's GEMM.
- ``specpilot::window_attention(q, k, v, k_pool, v_pool, owner, layer)``: the rows' K/V written into the pool, then
  the layer's attention over the requests' slots. It declares that it mutates the pool (K/V written by index
  assignment inside the graph made the functionalized ``index_put`` copy the whole pool every step: 590 ms a step on
  SmolLM2). A pass of a few rows a request attends through the C++ kernel over each request's own keys
  (:mod:`~specpilot.kernels.cpu_attention`) where the owner has it; a decode pass of a few rows a request through
  :func:`masked_attention`, compiled on its own with dynamic sizes; wider passes through the eager pass's masked SDPA
  (:func:`~specpilot.model.layers.batch_sdpa`), over a view of the pool where the slots form a window, else gathered.

``owner`` is an int key into :data:`_TABLES`, a row per :class:`~specpilot.model.compiled_stack.CompiledStack`. The
ops are registered once, when this module is first imported (the package imports it only for an engine that asks
for the compiled stack).
"""

from __future__ import annotations

import itertools
import types
from dataclasses import dataclass

import torch

from specpilot.kernels import cpu_attention
from specpilot.model.batch import Prepared
from specpilot.model.layers import batch_sdpa, padded_attention


#: the fewest requests (with a window's padding slots) a decode pass needs to take :func:`masked_attention`, by
#: default (:func:`takes_decode`; per owner: :attr:`CompiledStack.decode_min_requests`).
DECODE_MIN_REQUESTS = 16


@dataclass
class _Entry:
    """One owner's row of :data:`_TABLES`: its projections' forwards (bound, so a call skips ``Module.__call__``),
    their output widths, the rows of the pass it is running (set by :meth:`CompiledStack.forward_batch` for the
    length of one pass, read by ``specpilot::window_attention``) and that pass's :class:`_PassViews` (built by its
    first layer), its compiled :func:`masked_attention` (None: every pass takes the SDPA), the fewest requests a
    pass needs to take it (:attr:`CompiledStack.decode_min_requests`) and whether its one-row passes take the C++
    decode attention (:mod:`~specpilot.kernels.cpu_attention`; :attr:`CompiledStack.decode_kernel`)."""

    forwards: list
    widths: list[int]
    rows: Prepared | None = None
    views: "_PassViews | None" = None
    attend: object = None
    decode_min: int = DECODE_MIN_REQUESTS
    kernel: bool = False


@dataclass
class _PassViews:
    """What every layer of one pass reads of the pool alike, built once by its first layer
    (:func:`_pass_views`): ``k, v`` (the window's slots
    ``[W, L, span, KVH, D]``, a view; None: gathered per layer), whether the pass attends through
    :func:`masked_attention`, and whether it attends through the C++ kernel instead."""

    k: torch.Tensor | None
    v: torch.Tensor | None
    decode: bool
    kernel: bool = False


#: the most rows a request a pass may have to attend through the C++ kernel (SmolLM2's shape, 2 threads, against the
#: SDPA's time at 1, 8 and 32 requests over two runs: 2 rows each 0.39-0.67x, 4 rows 0.64-1.12x, 7 rows 0.86-1.39x;
#: ``results/decode_attention_cpu_2026-12-06_adb92fe/run.json``, ``by_rows``): its dot products run per query row, the
#: SDPA's as GEMMs
KERNEL_ROWS = 3


#: owner key -> that owner's :class:`_Entry`: what the custom ops read. A :class:`CompiledStack` adds its row when
#: built and removes it in :meth:`CompiledStack.close` or when it is garbage-collected; nothing else writes here.
_TABLES: dict[int, _Entry] = {}
_KEYS = itertools.count(1)


@torch.library.custom_op("specpilot::stack_linear", mutates_args=())
def stack_linear(x: torch.Tensor, owner: int, index: int) -> torch.Tensor:
    """``specpilot::stack_linear``: ``x [R, in]`` through projection ``index`` of owner ``owner`` -> ``[R, out]`` (the
    module's own forward: the oneDNN-prepacked :class:`~specpilot.kernels.cpu_linear.PackedLinear`, a plain
    ``nn.Linear``, a W12 layer). Raises KeyError: the owner was closed."""
    return _TABLES[owner].forwards[index](x)


def _pass_views(p: Prepared, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: int, e: _Entry) -> _PassViews:
    """:class:`_PassViews` of pass ``p`` of owner ``e`` over ``k_pool, v_pool [slots, L, slot_len, KVH, D]``;
    ``rows``: its query rows per KV head. A pass of at most :data:`KERNEL_ROWS` rows a request over a contiguous
    float32 pool attends through the C++ kernel where the owner has it: one row each at SmolLM2's shape took
    0.40-0.78x the SDPA's time at 1-32 requests, 0.54x :func:`masked_attention`'s at 32
    (``probes/decode_attention_cpu.py``)."""
    if (e.kernel and p.r_max <= KERNEL_ROWS and k_pool.is_contiguous() and v_pool.is_contiguous()
            and k_pool.dtype == v_pool.dtype == torch.float32):
        return _PassViews(None, None, False, kernel=True)
    k = v = None
    if p.window is not None:
        w = slice(p.window[0], p.window[0] + p.window[1])
        k, v = k_pool[w, :, : p.span], v_pool[w, :, : p.span]
    b = p.window[1] if p.window is not None else p.slots.shape[0]
    return _PassViews(k, v, e.attend is not None and takes_decode(b, p.span, rows, e.decode_min))


@torch.library.custom_op("specpilot::window_attention", mutates_args=("k_pool", "v_pool"))
def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     owner: int, layer: int) -> torch.Tensor:
    """``specpilot::window_attention``: layer ``layer`` of the batched pass's attention, as the eager pass runs it
    (:meth:`~specpilot.model.layers.Attention.forward_batch` without the kernel), over the rows ``p`` of owner
    ``owner``'s current pass: the rows' ``k, v [R, KVH, D]`` written into ``k_pool, v_pool [slots, layers, slot_len,
    KVH, D]`` at ``(p.slot, layer, p.pos)`` (in place: declared, so the pool is never copied), then ``q [R, H, D]``
    attends to each request's keys: through the C++ kernel (:func:`~specpilot.kernels.cpu_attention.
    tree_decode_attention`) where :func:`_pass_views` says so, else over its slot, a view of the pool where
    ``p.window`` says the slots form one, else gathered: through the owner's compiled :func:`masked_attention` where
    :func:`takes_decode` says so, else the masked SDPA. Returns ``[R, H * D]`` in ``q``'s dtype. Raises KeyError: the owner was closed."""
    e = _TABLES[owner]
    p, kvh = e.rows, k.shape[1]
    if e.views is None:
        e.views = _pass_views(p, k_pool, v_pool, p.r_max * (q.shape[1] // kvh), e)
    pv = e.views
    k_pool[p.slot, layer, p.pos] = k.to(k_pool.dtype)
    v_pool[p.slot, layer, p.pos] = v.to(v_pool.dtype)
    if pv.kernel:  # a few rows a request: the C++ kernel over each request's own keys
        o = cpu_attention.tree_decode_attention(q.float().contiguous(), k_pool, v_pool, layer, p.slots, p.starts,
                                                p.counts, p.row_off, p.words)
        return o.to(q.dtype).reshape(q.shape[0], q.shape[1] * q.shape[2])
    if pv.k is not None:
        keys, vals = pv.k[:, layer], pv.v[:, layer]
    else:
        keys = k_pool[:, layer, : p.span].index_select(0, p.slots)
        vals = v_pool[:, layer, : p.span].index_select(0, p.slots)
    if pv.decode:
        o = padded_attention(q, p, keys.shape[0], kvh,  # the query rows' strides as warmed (Dynamo guards on them)
                             lambda qg, mask: e.attend(qg.contiguous(), keys, vals, mask))
    else:
        o = batch_sdpa(q, keys, vals, p)
    return o.reshape(q.shape[0], q.shape[1] * q.shape[2])


@stack_linear.register_fake
def _stack_linear_fake(x, owner, index):
    return x.new_empty(x.shape[0], _TABLES[owner].widths[index])


@window_attention.register_fake
def _window_attention_fake(q, k, v, k_pool, v_pool, owner, layer):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


#: the most query rows per KV head (query heads per KV head x the pass's most rows per request) the compiled
#: :func:`masked_attention` takes; above, the SDPA's blocked GEMMs win (SmolLM2's 3 query heads per KV head, 32
#: requests, 2 threads, an interactive check: four rows each 2.45 against 1.76 ms a layer).
DECODE_ROWS = 4


def takes_decode(batch: int, span: int, rows: int, min_batch: int = DECODE_MIN_REQUESTS) -> bool:
    """Whether a layer's attention runs :func:`masked_attention`: at least ``min_batch`` (and 2) requests, with the
    window's padding slots, ``batch``, of at most :data:`DECODE_ROWS` query ``rows`` per KV head, over ``span >= 2``
    keys. Below 16 requests its gain shrinks to what a compiled call costs: on SmolLM2's shape 0.73x the SDPA's time
    at 32 requests, 0.78x at 16, 0.83x at 8 and 1.28x at 2 (``results/decode_attention_cpu_2026-12-05_ef6e89d``),
    while a whole step of 8 requests ran 45 ms both ways. A size of 1 would also be one more compiled graph (Dynamo
    specializes it)."""
    return batch >= max(2, min_batch) and span >= 2 and rows <= DECODE_ROWS


def masked_attention(qg: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The SDPA of a few query rows per request, written for ``torch.compile`` to fuse into one pass over each
    request's keys as the pool holds them: ``qg [W, KVH, G, D]`` (the G query rows of each KV head), ``keys, vals
    [W, S, KVH, D]`` (a view of the pool's slots, or gathered), ``mask [W, 1, G, S]`` bool (True = may attend; every
    row sees a key) -> ``[W, KVH, G, D]`` in ``qg``'s dtype: softmax(q k / sqrt(D)) v, accumulated in float32.

    Why. A decode step's attention reads each request's K/V once for a handful of query rows. The CPU flash SDPA
    tiles them as GEMMs over the longest request's keys and ran at under a third of the memory's speed; Inductor's
    loop over the keys in their stored layout, masked by a select, took 0.73x its time (SmolLM2's shape, 32
    requests, 2 threads: 1.00 against 1.37 ms a layer; reading the K/V once 0.40; keys gathered first, copy
    included, 0.96x; ``results/decode_attention_cpu_2026-12-05_ef6e89d/run.json``; gathering the slots inside the
    graph lost the gain). The same math as the SDPA rounded in another order (float32: within ~4e-7).
    """
    k = keys.permute(0, 2, 1, 3)[:, :, None].float()  # [W, KVH, 1, S, D]
    v = vals.permute(0, 2, 1, 3)[:, :, None].float()
    scores = (qg[:, :, :, None, :].float() * k).sum(-1) * qg.shape[-1] ** -0.5  # [W, KVH, G, S]
    w = torch.softmax(torch.where(mask, scores, float("-inf")), dim=-1)
    return (w[..., None] * v).sum(-2).to(qg.dtype)


def _attention_of(owner: int):
    """A copy of :func:`masked_attention` with its own code object, compiled for one owner: Dynamo keeps compiled
    graphs (and its recompile limit) per code object, so owners never share or evict each other's."""
    code = masked_attention.__code__.replace(co_name=f"masked_attention_{owner}")
    fn = types.FunctionType(code, masked_attention.__globals__, code.co_name)
    return torch.compile(fn, dynamic=True)
