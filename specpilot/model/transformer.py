"""The target (and draft) model: a dense decoder (llama / qwen2 / qwen3) in plain PyTorch.

A pass takes any set of rows: token ids ``[R]``, explicit position ids ``[R]`` and a mask, so the same call
serves prefill (causal), AR decode (one row) and tree verification (ancestor mask, positions
prefix_len + depth; §1.1, §4.2). Two entry points, named for what they are:

- :meth:`Transformer.forward`: the eager reference at an int prefix, masked SDPA; a pass kind says whether it
  writes its rows' K/V (``EXACT``) or nothing (``INSPECT``, :class:`~specpilot.model.cache.PassKind`);
- :meth:`Transformer.forward_static`: the graph-capturable exact pass (``start`` on the device, ``[R, R]`` tree
  mask), through the fused Triton kernels of :mod:`specpilot.model.fused` or the plain layers, as the model's
  :class:`KernelConfig` says.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specpilot.model.args import ModelArgs, rope_inv_freq
from specpilot.model.batch import BatchRows, Prepared
from specpilot.model.cache import KVCache, KVPool, PassKind
from specpilot.model.layers import Backbone, region


@dataclass(frozen=True)
class KernelConfig:
    """The model's kernel choices on the static path (one typed place; per model object, not per process).

    Attributes:
        fused: fused Triton kernels (:mod:`specpilot.model.fused`): None = on CUDA when triton is installed and
            the head dim is 64 or 128; True / False force it (tests run it in the Triton interpreter). Needs
            fused projections (:meth:`Transformer.fuse_projections`).
        skinny_gemm: projections through the skinny Triton GEMM (:func:`specpilot.kernels.gemm.linear`, 1–64
            rows) instead of cuBLAS. Off: on the H200 cuBLAS is as fast or faster for bf16
            (``results/kernels_probe_sweep_qwen3-8b_h200_2026-11-30.json``).
        fuse_swiglu: one row, a W12 down projection computes ``silu(gate) · up`` in its activation load (the same
            bits, one launch a layer fewer).
        fuse_norm: one row, W12 projections on the one-row GEMV: the residual add and RMSNorm split across the
            GEMVs around them (no ``add_rmsnorm`` launches but the first and the final norm).
        batch_kernel: batched passes (:meth:`Transformer.forward_batch`) attend through the Triton batched tree
            attention (:mod:`specpilot.kernels.batch_attention`) instead of the masked-SDPA reference. Off: tested
            against the reference in the Triton interpreter, not yet run and timed on a GPU.
        batch_invariant: batched passes on the fused path run every projection and the LM head through the
            batch-invariant GEMM (:func:`~specpilot.kernels.gemm.invariant_linear`: tiles and split-K from the
            weight's shape alone), so a request's output does not depend on the requests it shares steps with.
            Off: cuBLAS, which picks its algorithm by the step's rows (outputs then vary with the batch in bf16).
        gdn_wy: a hybrid target's static pass verifies its GDN layers with the WY-form kernel
            (:func:`~specpilot.kernels.gdn_wy.gdn_tree_wy`) in buckets of at most
            :data:`~specpilot.model.hybrid_static.WY_ROWS` rows, the path kernel above; the commit still replays
            the accepted path recurrently. Off by default: on the H200 it verified 48 layers of a 32-node tree in
            0.95 ms against the path kernel's 1.65 (results/gdn_wy_h200_2026-12-04_b5f1f3c/), but a whole step
            with it has not been timed at a bucket it verifies, and its outputs match the committed state only up
            to rounding.
        aligned: single-request static passes on the fused path (the engine's row buckets: AR steps, tree
            verification, prompt chunks) take the batched engine's kernels: every ``nn.Linear`` projection and
            the LM head through the batch-invariant GEMM, the attention through the AR-aligned batched kernel
            (:mod:`specpilot.kernels.batch_attention`) as one request. A tree's top chain, laid out first
            (:meth:`~specpilot.spec.trees.Tree.chain_first`), then carries the one-row AR pass's bits in bf16, so
            near ties resolve as AR's do and a recorded greedy continuation (the calibrated drafter's) holds in
            tree passes. Off by default: cuBLAS and split-KV attention are faster (``specpilot pilot --aligned``
            measures every system on it); W12 and Q-view layers keep their own kernels either way.
    """

    fused: bool | None = None
    skinny_gemm: bool = False
    fuse_swiglu: bool = True
    fuse_norm: bool = True
    batch_kernel: bool = False
    batch_invariant: bool = True
    gdn_wy: bool = False
    aligned: bool = False


class Transformer(nn.Module):
    """A dense llama / qwen2 / qwen3 decoder over a static KV cache.

    :meth:`forward` / :meth:`forward_static` give the final-norm hidden states of any set of rows, :meth:`greedy`
    their argmax through the LM head, :meth:`logits` the logits. Built by
    :func:`specpilot.model.checkpoint.load_model`.

    Attributes:
        kernels: :class:`KernelConfig` of the static path.
        int8_head: the ``lm_head_int8`` mechanism (§4.1): a
            :class:`~specpilot.head.certified.CertifiedInt8Head` that :meth:`greedy` uses (set by
            :func:`specpilot.head.certified.with_int8_head` on a shallow copy); None = the plain head.
    """

    backbone_class = Backbone  # the decoder stack a subclass swaps (hybrid targets)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = self.backbone_class(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # float32 on purpose and not a buffer, so ``.to(bfloat16)`` leaves it exact
        self.inv_freq = rope_inv_freq(args)
        self.kernels = KernelConfig()
        self.int8_head = None

    @property
    def device(self) -> torch.device:
        """The device of the weights (the embeddings': the LM head may be a W12 layer, §4.1)."""
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The model dtype (the embeddings')."""
        return self.model.embed_tokens.weight.dtype

    def fused_on(self, x: torch.Tensor) -> bool:
        """Whether :meth:`forward_static` over ``x`` runs the fused kernels (see :attr:`kernels`)."""
        if not hasattr(self.model.layers[0].self_attn, "qkv_proj"):
            return False
        if self.kernels.fused is not None:
            return self.kernels.fused
        from specpilot.kernels.fused import triton

        return x.is_cuda and triton is not None and self.args.head_dim in (64, 128)

    def fuse_projections(self) -> "Transformer":
        """Fuse q/k/v and gate/up projections of every layer (fewer, larger GEMMs). Returns self."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

    def new_cache(self, max_len: int) -> KVCache:
        """A zeroed static cache of ``max_len`` slots in the model's dtype and device."""
        return KVCache(self.args, max_len, self.dtype, self.device)

    def new_pool(self, num_slots: int, slot_len: int) -> KVPool:
        """A zeroed :class:`KVPool` of ``num_slots`` slots of ``slot_len`` positions in the model's dtype and device:
        the state the batched engine holds for its requests (a hybrid target's holds recurrent states too)."""
        return KVPool(self.args, num_slots, slot_len, self.dtype, self.device)

    def compiled_stack(self):
        """A :class:`~specpilot.model.compiled_stack.CompiledStack` of this target: its batched CPU pass's decoder
        stack as one ``torch.compile`` graph (that module, and its custom ops, imported on this first use).
        Raises SpecPilotError: a target it cannot compile (off the CPU, not a dense decoder)."""
        from specpilot.model.compiled_stack import CompiledStack

        return CompiledStack(self)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """``cos, sin [R, head_dim]`` for ``positions [R] long`` (computed in float32)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = rope_inv_freq(self.args).to(positions.device)
        f = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((f, f), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _embed(self, tokens, positions, prof):
        with region(prof, "other"):
            x = self.model.embed_tokens(tokens)
            return (x, *self.rope(positions, x.dtype))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, start: int,
                mask: torch.Tensor | None = None, kind: PassKind = PassKind.EXACT, prof=None,
                features: list | None = None, feature_layers: tuple[int, ...] = ()) -> torch.Tensor:
        """Final-norm hidden states of a set of rows: the eager reference pass.

        Args:
            tokens: ``[R] long`` token ids of the rows.
            positions: ``[R] long`` position ids (prefix_len + depth for tree rows, §4.2).
            cache: the request's cache; the rows attend to its slots ``[0, start)``.
            start: committed slots the rows attend to (an int).
            mask: ``[R, start + R] bool`` (True = may attend); None = causal over the rows.
            kind: ``EXACT`` writes the rows' K/V to slots ``[start, start + R)``; ``INSPECT`` writes nothing.
            prof: optional step profiler with ``region(name)`` (cost model, §3.2).
            features / feature_layers: when ``feature_layers`` is non-empty, the outputs of those decoder layers
                (0-based) are appended to the list ``features`` as ``[R, hidden_size]`` tensors, in the order
                given (the context a block drafter reads, DFlash-style, §1.1).
        Returns:
            ``[R, hidden_size]`` in the model dtype.
        Raises:
            ValueError: the rows do not fit the cache, or ``start`` is not an int.
        """
        if isinstance(start, torch.Tensor):
            raise ValueError("forward takes an int prefix length; a device-tensor prefix is forward_static's")
        r = tokens.shape[0]
        if start + r > cache.max_len:
            raise ValueError(f"{start + r} slots needed, cache holds {cache.max_len}")
        x, cos, sin = self._embed(tokens, positions, prof)
        return self._layers(x, lambda i, layer, h: layer(h, cos, sin, cache, i, start, mask, kind, prof), prof,
                            features, feature_layers)

    def forward_static(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, start: torch.Tensor,
                       tree_mask: torch.Tensor, prof=None, features: list | None = None,
                       feature_layers: tuple[int, ...] = ()) -> torch.Tensor:
        """Final-norm hidden states of an exact pass whose shapes depend only on R (CUDA-graph capturable).

        Args:
            tokens / positions: ``[R] long``; start: 0-d long device tensor, the committed slots;
            tree_mask: ``[R, R] bool`` among the rows (every row sees the whole prefix);
            prof / features / feature_layers: as :meth:`forward`.
        The rows' K/V are written at ``start + arange(R)``; no host sync. Returns ``[R, hidden_size]``.
        """
        x, cos, sin = self._embed(tokens, positions, prof)
        if self.fused_on(x):
            from specpilot.model.fused import forward_fused

            return forward_fused(self, x, cos, sin, cache, start, tree_mask, features, feature_layers)
        return self._layers(x, lambda i, layer, h: layer.forward_static(h, cos, sin, cache, i, start, tree_mask, prof),
                            prof, features, feature_layers)

    def forward_batch(self, tokens: torch.Tensor, positions: torch.Tensor, pool: KVPool, rows: BatchRows, prof=None,
                      features: list | None = None, feature_layers: tuple[int, ...] = (),
                      kernel: bool | None = None) -> torch.Tensor:
        """Final-norm hidden states of one exact pass over the rows of several requests (§2.2, §4.4).

        Args:
            tokens / positions: ``[R] long``, request 0's rows, then request 1's, ... (positions: prefix + depth).
            pool: the :class:`KVPool`; rows: the :class:`~specpilot.model.batch.BatchRows` (slots, starts, counts,
                masks); each request's rows' K/V go to ``[start, start + count)`` of its slot.
            prof / features / feature_layers: as :meth:`forward` (features ``[R, hidden]`` over all rows).
            kernel: attend through the Triton batched tree attention (None: :attr:`kernels`' ``batch_kernel``).
        Returns:
            ``[R, hidden_size]``.
        Raises:
            ValueError: malformed rows, or rows past a slot's end.
        """
        if tokens.shape[0] != sum(rows.counts):
            raise ValueError(f"{tokens.shape[0]} tokens for {sum(rows.counts)} rows")
        if max(s + c for s, c in zip(rows.starts, rows.counts)) > pool.slot_len:
            raise ValueError(f"rows past a slot's {pool.slot_len} positions")
        kernel = self.kernels.batch_kernel if kernel is None else kernel
        return self.forward_prepared(tokens, positions, pool, rows.prepared(tokens.device), kernel, prof, features,
                                     feature_layers)

    def forward_prepared(self, tokens: torch.Tensor, positions: torch.Tensor, pool: KVPool, p: Prepared, kernel: bool,
                         prof=None, features: list | None = None, feature_layers: tuple[int, ...] = ()) -> torch.Tensor:
        """:meth:`forward_batch` on index tensors already on the device (no validation, no host sync with
        ``kernel``: the CUDA-graph capturable form, :class:`~specpilot.engine.batch_runner.BatchRunner`'s).

        Args:
            tokens / positions: ``[R] long``; p: the :class:`~specpilot.model.batch.Prepared` rows (with ``kernel``
                only ``slot``, ``pos``, ``slots``, ``starts``, ``counts``, ``row_off``, ``words`` and ``r_max``
                are read); kernel: attend through the Triton batched tree attention, else the masked-SDPA reference;
                with ``kernel`` and :meth:`fused_on`, each layer in the fused Triton kernels
                (:func:`~specpilot.model.fused.forward_batch_fused`).
        Returns:
            ``[R, hidden_size]``.
        """
        x, cos, sin = self._embed(tokens, positions, prof)
        if kernel and self.fused_on(x):
            from specpilot.model.fused import forward_batch_fused

            return forward_batch_fused(self, x, cos, sin, pool, p, features, feature_layers)
        return self._layers(x, lambda i, layer, h: layer.forward_batch(h, cos, sin, pool, i, p, prof, kernel), prof,
                            features, feature_layers)

    def _layers(self, x, call, prof, features, feature_layers) -> torch.Tensor:
        """``call(i, layer, x)`` through every decoder layer, the outputs of ``feature_layers`` appended to
        ``features`` in the order given, then the final norm."""
        captured = {}
        for i, layer in enumerate(self.model.layers):
            x = call(i, layer, x)
            if i in feature_layers:
                captured[i] = x
        if feature_layers:
            features.extend(captured[i] for i in feature_layers)
        with region(prof, "norms_elementwise"):
            return self.model.norm(x)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """Argmax token ids ``[R] long`` of the LM head for ``hidden [R, hidden_size]``, computed on logits in
        the model dtype: the float32 cast of :meth:`logits` is exact, so the argmax (first index on ties) is
        the same, without writing and re-reading ``R x vocab`` float32 logits. With the ``lm_head_int8``
        mechanism (:attr:`int8_head`) the certified INT8 head finds the same argmax (§4.1)."""
        if self.int8_head is not None:  # rows the bound leaves undecided take this model's own head
            return self.int8_head.argmax(hidden, full=self.full_greedy)
        if self.kernels.aligned and self.fused_on(hidden):  # the head of an aligned pass (KernelConfig.aligned)
            from specpilot.kernels.gemm import invariant_linear

            return invariant_linear(hidden, self.lm_head).argmax(dim=-1)
        return self.full_greedy(hidden)

    def batch_invariant_on(self, x: torch.Tensor, kernel: bool) -> bool:
        """Whether a batched pass over ``x`` (through the batched kernels when ``kernel``) runs its projections and
        LM head through the batch-invariant GEMM (:attr:`kernels`' ``batch_invariant``, fused path only)."""
        return bool(kernel) and self.kernels.batch_invariant and self.fused_on(x)

    def batch_greedy(self, hidden: torch.Tensor, kernel: bool) -> torch.Tensor:
        """:meth:`greedy` for the rows of a batched pass (:meth:`forward_prepared` with the same ``kernel``):
        the LM head through the batch-invariant GEMM where :meth:`batch_invariant_on`. ``hidden [R, hidden]`` ->
        ``[R] long``. (On the CPU the head's cost at 2-3 rows, MKL's slow path, is gone with the prepacked head of
        :mod:`specpilot.kernels.cpu_linear`.)"""
        if self.int8_head is None and self.batch_invariant_on(hidden, kernel):
            from specpilot.kernels.gemm import invariant_linear

            return invariant_linear(hidden, self.lm_head).argmax(dim=-1)
        return self.greedy(hidden)

    def full_greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """:meth:`greedy` through the full head always (``[R] long``; the int8 head's fallback)."""
        return self.lm_head(hidden).argmax(dim=-1)

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The LM head's rows of the target ids ``ids [n] long`` as a dense ``[n, hidden_size]`` weight (model dtype,
        a copy): the head a drafter with a draft vocabulary multiplies by (§1.1). A W12 head is decoded exactly."""
        from specpilot.w12.linear import W12Linear

        head = self.lm_head
        w = head.decoded_weight() if isinstance(head, W12Linear) else head.weight
        return w[ids.to(w.device)].contiguous()

    def logits(self, hidden: torch.Tensor, prof=None) -> torch.Tensor:
        """LM head: ``hidden [R, hidden_size]`` -> logits ``[R, vocab_size]`` float32."""
        with region(prof, "lm_head"):
            return self.lm_head(hidden).float()
