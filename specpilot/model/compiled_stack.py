"""The batched CPU pass's decoder stack as one ``torch.compile`` graph (opt-in: ``BatchEngine(compile_cpu=True)``,
``specpilot serve --compile``).

Why. On the CPU a batched decode step of a small model is dispatch-bound: each layer runs ~20 small elementwise ops
(RMSNorm, RoPE, SiLU·mul, residual adds) around its projections. One compiled function over all layers lets Inductor
fuse them (the prototype: ``results/cpu_stack_compile_cpu_2026-12-05_1f9f580/``). Two ops stay opaque to it
(:mod:`~specpilot.model.stack_ops`): ``specpilot::stack_linear``, a projection through the target's own module, and
``specpilot::window_attention``, the rows' K/V written into the pool and the layer's attention over the requests'
slots. Everything that depends on the requests (slots, starts, masks) stays inside the latter, so the graph's only
dynamic size is the row count ``R``: two graphs (``R = 1``, ``R >= 2``) serve every pass.

Each :class:`CompiledStack` owns a row of :data:`~specpilot.model.stack_ops._TABLES` (its projections, and the rows
of the pass it is running), added when built and removed in :meth:`CompiledStack.close` or when it is
garbage-collected, and compiles its own copy of the stack function (its own code object), so two targets in one
process never share, evict or recompile each other's graphs, and nothing process-wide is switched. Passes the stack
does not take (the Triton batched attention, a profiler, a drafter reading target features) run the eager pass;
:attr:`CompiledStack.passes` counts both.

Numerics: the projections are the eager pass's own calls; the fused norms and RoPE, and the attention's forms,
round differently in the last bits (float32: hidden states within ~5e-7 of the eager pass's on a tiny target), as
another GEMM order would. Every committed token is still the argmax of an exact pass of the target's weights; in the
tests the tokens equal the eager engine's.
"""

from __future__ import annotations

import itertools
import types
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specpilot.errors import SpecPilotError
from specpilot.kernels import cpu_attention
from specpilot.model.batch import BatchRows
from specpilot.model.cache import KVPool
from specpilot.model.stack_ops import (DECODE_MIN_REQUESTS, DECODE_ROWS, KERNEL_ROWS, _KEYS, _TABLES, _attention_of,
                                       _Entry, masked_attention, stack_linear, takes_decode, window_attention)

__all__ = ["CompiledStack", "DECODE_MIN_REQUESTS", "DECODE_ROWS", "masked_attention", "supported", "takes_decode",
           "stack_linear", "window_attention"]


@dataclass(frozen=True)
class _Spec:
    """What the stack function reads of one target: its owner key, shapes, epsilon and norm weights."""

    owner: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float
    qk_norm: bool
    norms: tuple  # per layer (input norm, post-attention norm, q norm or None, k norm or None) weights
    final_norm: torch.Tensor


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`~specpilot.model.layers.RMSNorm`'s arithmetic: in float32, cast back, times the weight."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None, :] + torch.cat((-x2, x1), dim=-1) * sin[:, None, :]


def _stack(x, cos, sin, k_pool, v_pool):
    """Every decoder layer and the final norm over ``x [R, hidden]`` (``cos, sin [R, head_dim]``; see
    :meth:`CompiledStack.forward_batch`), for the target of ``_SPEC``: a global of each owner's copy of this function
    (:func:`_stack_of`)."""
    s = _SPEC  # noqa: F821  (each copy's own globals)
    h, kvh, d, eps = s.n_heads, s.n_kv_heads, s.head_dim, s.eps
    r, nq = x.shape[0], h + kvh
    for i in range(s.n_layers):
        n1, n2, qn, kn = s.norms[i]
        qkv = stack_linear(_rms(x, n1, eps), s.owner, 4 * i)
        qk = qkv[:, : nq * d].reshape(r, nq, d)
        if s.qk_norm:
            q, k = _rope(_rms(qk[:, :h], qn, eps), cos, sin), _rope(_rms(qk[:, h:], kn, eps), cos, sin)
        else:
            qk = _rope(qk, cos, sin)
            q, k = qk[:, :h], qk[:, h:]
        o = window_attention(q, k, qkv[:, nq * d:].reshape(r, kvh, d), k_pool, v_pool, s.owner, i)
        x = x + stack_linear(o, s.owner, 4 * i + 1)
        gu = stack_linear(_rms(x, n2, eps), s.owner, 4 * i + 2)
        gate, up = gu.chunk(2, dim=-1)
        x = x + stack_linear(F.silu(gate) * up, s.owner, 4 * i + 3)
    return _rms(x, s.final_norm, eps)


def _stack_of(spec: _Spec):
    """A copy of :func:`_stack` for ``spec``'s target: its own code object (Dynamo keeps compiled graphs per code
    object, so one owner's never meet, evict or recompile another's) and its own globals holding ``spec`` as
    ``_SPEC`` (Dynamo specializes on a global's ints, the owner key and the head counts; an argument's or a closure's
    it may make symbolic, and a symbolic owner key cannot index the table)."""
    code = _stack.__code__.replace(co_name=f"compiled_stack_{spec.owner}")
    return types.FunctionType(code, dict(_stack.__globals__, _SPEC=spec), code.co_name)


def supported(target) -> str | None:
    """Why ``target`` cannot run the compiled stack (None: it can): a dense :class:`~specpilot.model.transformer.
    Transformer` on the CPU with fused q/k/v and gate/up projections and plain SwiGLU MLPs."""
    from specpilot.model.layers import MLP, Backbone, DecoderLayer

    if target.device.type != "cpu":
        return f"it compiles the CPU pass only (the target is on {target.device}; CUDA runs its graphs and kernels)"
    if type(target.model) is not Backbone:
        return f"it compiles dense decoders only, not {type(target).__name__}"
    for layer in target.model.layers:
        if type(layer) is not DecoderLayer or type(layer.mlp) is not MLP:
            return "it compiles dense decoder layers with SwiGLU MLPs only"
        if not (hasattr(layer.self_attn, "qkv_proj") and hasattr(layer.mlp, "gate_up_proj")):
            return "it needs fused q/k/v and gate/up projections (Transformer.fuse_projections)"
    return None


class CompiledStack:
    """One target's batched CPU pass through its compiled decoder stack, with the eager pass as the fallback.

    Args:
        target: a dense :class:`~specpilot.model.transformer.Transformer` on the CPU with fused projections (as
            :func:`~specpilot.model.checkpoint.load_model` builds it).
        decode_kernel: whether passes of a few rows a request attend through the C++ kernel (None: where it
            builds, :func:`~specpilot.kernels.cpu_attention.available`; the first build takes about 20 s).
    Raises:
        SpecPilotError: the target is not on the CPU, or not a dense decoder with fused projections
            (:func:`supported` says why, in one line).
    Attributes:
        target: the target; owner: this stack's key in :data:`_TABLES`.
        passes: ``{"compiled": n, "eager": m}``: passes run through the compiled stack and through the eager fallback.
    The only dynamic size of the graph is the pass's row count ``R`` (everything that varies with the requests, their
    slots and masks stays inside ``specpilot::window_attention``), so two graphs serve every pass: ``R = 1`` and
    ``R >= 2``. Each compiles on first use (seconds on a tiny target, minutes on SmolLM2's 30 layers on 2 cores), or
    at start through :meth:`warm_up`. Not thread-safe: one engine thread drives it.
    """

    def __init__(self, target, decode_kernel: bool | None = None):
        why = supported(target)
        if why is not None:
            raise SpecPilotError(f"cannot compile the batched CPU pass (compile_cpu, serve --compile): {why}")
        self.target = target
        self.owner = next(_KEYS)
        layers = target.model.layers
        mods = [m for ly in layers for m in (ly.self_attn.qkv_proj, ly.self_attn.o_proj, ly.mlp.gate_up_proj,
                                              ly.mlp.down_proj)]
        _TABLES[self.owner] = _Entry([m.forward for m in mods], [int(m.out_features) for m in mods],
                                     attend=_attention_of(self.owner),
                                     kernel=cpu_attention.available() if decode_kernel is None else decode_kernel)
        self._finalizer = weakref.finalize(self, _TABLES.pop, self.owner, None)
        a = target.args
        qk = bool(a.qk_norm)
        norms = tuple((ly.input_layernorm.weight, ly.post_attention_layernorm.weight,
                       ly.self_attn.q_norm.weight if qk else None, ly.self_attn.k_norm.weight if qk else None)
                      for ly in layers)
        self._spec = _Spec(self.owner, len(layers), a.n_heads, a.n_kv_heads, a.head_dim,
                           float(target.model.norm.eps), qk, norms, target.model.norm.weight)
        self._fn = torch.compile(_stack_of(self._spec))  # R marked dynamic per call (forward_batch)
        self.passes = {"compiled": 0, "eager": 0}

    @property
    def decode_kernel(self) -> bool:
        """Whether passes of at most :data:`~specpilot.model.stack_ops.KERNEL_ROWS` rows a request attend through
        the C++ kernel (:func:`~specpilot.kernels.cpu_attention.tree_decode_attention`; the constructor's
        ``decode_kernel``, by default where it builds); the others keep :func:`masked_attention` or the SDPA."""
        return _TABLES[self.owner].kernel

    @property
    def decode_min_requests(self) -> int:
        """The fewest requests (with a window's padding slots) a decode pass needs for its attention to run the
        compiled :func:`masked_attention` (default :data:`DECODE_MIN_REQUESTS`, :func:`takes_decode`); fewer take the
        SDPA."""
        return _TABLES[self.owner].decode_min

    @decode_min_requests.setter
    def decode_min_requests(self, n: int) -> None:
        _TABLES[self.owner].decode_min = int(n)

    def close(self) -> None:
        """Drop this owner's row of :data:`_TABLES` (a later compiled pass raises KeyError). Idempotent."""
        self._finalizer()

    @staticmethod
    def takes(kernel: bool, prof=None, feature_layers: tuple[int, ...] = ()) -> bool:
        """Whether a pass runs compiled: attention is the masked-SDPA reference (not the Triton ``kernel``) and
        nothing reads inside the stack (no profiler regions, no target features for a drafter)."""
        return not kernel and prof is None and not feature_layers

    def forward_batch(self, tokens: torch.Tensor, positions: torch.Tensor, pool: KVPool, rows: BatchRows,
                      prof=None, features: list | None = None, feature_layers: tuple[int, ...] = (),
                      kernel: bool | None = None) -> torch.Tensor:
        """:meth:`~specpilot.model.transformer.Transformer.forward_batch`, compiled where :meth:`takes` says so.

        Args:
            tokens / positions: ``[R] long`` (request 0's rows, then request 1's, ...); pool: the target's
                :class:`KVPool` (K/V of each row written at its slot and position); rows: the
                :class:`~specpilot.model.batch.BatchRows`; prof / features / feature_layers / kernel: as the
                target's (any of them set sends the pass to the eager fallback).
        Returns:
            ``[R, hidden_size]`` final-norm hidden states in the model dtype.
        Raises:
            ValueError: as the target's ``forward_batch`` (malformed rows, rows past a slot's end).
            KeyError: :meth:`close` was called.
        """
        t = self.target
        kernel = t.kernels.batch_kernel if kernel is None else kernel
        if not self.takes(kernel, prof, feature_layers):
            self.passes["eager"] += 1
            return t.forward_batch(tokens, positions, pool, rows, prof, features, feature_layers, kernel)
        if tokens.shape[0] != sum(rows.counts):
            raise ValueError(f"{tokens.shape[0]} tokens for {sum(rows.counts)} rows")
        if max(s + c for s, c in zip(rows.starts, rows.counts)) > pool.slot_len:
            raise ValueError(f"rows past a slot's {pool.slot_len} positions")
        entry = _TABLES[self.owner]
        entry.rows, entry.views = rows.prepared(tokens.device), None
        x, cos, sin = t._embed(tokens, positions, None)
        if x.shape[0] > 1:  # one graph for every R >= 2; R = 1 compiles its own (a size of 1 is specialized)
            for u in (x, cos, sin):
                torch._dynamo.mark_dynamic(u, 0)
        for u in (pool.k, pool.v):  # engines of other slot counts and lengths share the graphs (Deployment's stack)
            torch._dynamo.maybe_mark_dynamic(u, 0)
            torch._dynamo.maybe_mark_dynamic(u, 2)
        try:
            out = self._fn(x, cos, sin, pool.k, pool.v)
        finally:
            entry.rows = entry.views = None
        self.passes["compiled"] += 1
        return out

    def warm_up(self, pool: KVPool, slot: int) -> int:
        """Compile both graphs now (``R = 1`` and ``R >= 2``) and the decode attention's (:meth:`_warm_attention`),
        not in a served step: two passes of rows at positions 0 and 1 of ``slot`` of ``pool`` (their K/V written
        there, nothing committed: give a slot no request holds, as the batched engine's scratch slot). Runs under
        ``torch.inference_mode``, as the engines' steps do (compiled graphs are kept per grad mode). Returns the
        passes and attention calls run."""
        with torch.inference_mode():
            for r in (1, 2):
                tokens = torch.zeros(r, dtype=torch.long, device=self.target.device)
                positions = torch.arange(r, device=tokens.device)
                self.forward_batch(tokens, positions, pool, BatchRows([slot], [0], [r], [None]))
            return 2 + self._warm_attention(pool)

    def _warm_attention(self, pool: KVPool) -> int:
        """Compile :func:`masked_attention` for each query-row count per KV head it takes (:func:`takes_decode`) and
        keys in a window of the pool or gathered, with a request count and a key count unlike any fixed size of the
        call where the pool allows: Dynamo assumes sizes that are equal when it compiles stay equal ("duck" sizes),
        and a real pass whose count differed would compile again. Returns the calls made."""
        a, attend = self.target.args, _TABLES[self.owner].attend
        g = a.n_heads // a.n_kv_heads
        # passes of up to KERNEL_ROWS rows a request (g query rows a KV head each) take the C++ kernel where the
        # owner has it
        rows_each = [r for r in range(g, DECODE_ROWS + 1, g) if not (self.decode_kernel and r // g <= KERNEL_ROWS)]
        taken = {a.n_kv_heads, a.head_dim, pool.num_slots, *rows_each}
        w = min(next(n for n in itertools.count(2) if n not in taken), pool.num_slots)
        span = min(next(n for n in itertools.count(2) if n not in taken | {w}), pool.slot_len)
        calls = 0
        for rows in rows_each:
            qg = pool.k.new_zeros(w, a.n_kv_heads, rows, a.head_dim)
            mask = torch.ones(w, 1, rows, span, dtype=torch.bool, device=qg.device)
            keys, vals = pool.k[:w, 0, :span], pool.v[:w, 0, :span]  # the slots as one window
            for kv in ((keys, vals), (keys.contiguous(), vals.contiguous())):  # and gathered
                attend(qg, *kv, mask)
                calls += 1
        return calls
