"""The state of every request a batch of a hybrid target holds: one :class:`~specpilot.model.hybrid_cache.HybridCache`
per slot, its tensors views of the pool's (§2.2, §4.2).

A dense target's batch keeps its requests' K/V in a :class:`~specpilot.model.cache.KVPool`; a hybrid target's request
also has, per Gated DeltaNet (GDN) layer, a recurrent state and a conv window. :class:`HybridPool` holds all three
for every slot, so one batched exact pass (:mod:`specpilot.model.hybrid_batch`) writes each request's attention K/V
into its slot and runs its GDN rows from its slot's committed state and window. Slot ``i`` is a full
:class:`HybridCache` (:meth:`HybridPool.cache`): the batched engine compacts and commits it exactly as the
single-request engine commits its own cache (``snapshot`` or ``replay`` along the accepted path), and ``commit(0)``
frees it (zero state and window). Which request owns a slot is the batched engine's business.
"""

from __future__ import annotations

import torch

from specpilot.model.args import ModelArgs
from specpilot.model.cache import allocate_pool
from specpilot.model.hybrid_cache import HybridCache


class PooledHybridCache(HybridCache):
    """A :class:`HybridCache` whose committed tensors are slot ``slot`` of ``pool`` (views, no copy).

    Built through :class:`HybridCache`'s own constructor on the meta device (so its bookkeeping is the parent's,
    and no memory is taken), then pointed at the pool's tensors. A batched pass is eager (no static pass, no GDN
    kernels), so ``gdn_kernels`` is off.
    """

    def __init__(self, pool: "HybridPool", slot: int, args: ModelArgs, mode: str):
        super().__init__(args, 1, pool.k.dtype, "meta", mode, gdn_kernels=False)
        self.k, self.v, self.state, self.window = pool.k[slot], pool.v[slot], pool.state[slot], pool.window[slot]
        self.max_len = pool.slot_len


class HybridPool:
    """Per-slot K/V, GDN states and conv windows of a hybrid target's batch.

    Attributes:
        k, v: ``[num_slots, n_attn, slot_len, n_kv_heads, head_dim]``, the full-attention layers' K/V (model dtype).
        state: ``[num_slots, n_gdn, H, d_k, d_v]`` float32, each slot's committed GDN states.
        window: ``[num_slots, n_gdn, K − 1, C]``, each slot's committed conv inputs (oldest first), model dtype.
        num_slots, slot_len: as :class:`~specpilot.model.cache.KVPool`.
        padded_passes: False: the padded :class:`~specpilot.engine.batch_runner.BatchRunner` (padding rows in a
            scratch slot, CUDA graphs) does not run on it; a hybrid batch runs the eager pass.
    Args:
        args: a hybrid :class:`ModelArgs`; num_slots: requests held at once; slot_len: positions a slot holds;
        dtype / device: of K/V and windows; mode: ``snapshot`` | ``replay`` (:class:`HybridCache`), every slot's.
    Raises:
        ValueError: ``num_slots < 1``, ``slot_len < 1`` or an unknown mode.
        SpecPilotError: the pool's tensors cannot be allocated on ``device`` (one line with their size, K/V, states
            and windows together, and what to lower; :func:`~specpilot.model.cache.allocate_pool`).
    """

    padded_passes = False
    prefix_reuse = False  # a GDN layer's recurrent state is not per position: no prefix of it can be copied

    def __init__(self, args: ModelArgs, num_slots: int, slot_len: int, dtype: torch.dtype,
                 device: torch.device | str, mode: str = "snapshot"):
        if num_slots < 1 or slot_len < 1:
            raise ValueError(f"a hybrid pool needs at least one slot of one position, got {num_slots} x {slot_len}")
        n_attn = args.layer_types.count("full_attention")
        n_gdn = len(args.layer_types) - n_attn
        kv = (num_slots, n_attn, slot_len, args.n_kv_heads, args.head_dim)
        conv_dim = 2 * args.linear_num_key_heads * args.linear_key_head_dim + \
            args.linear_num_value_heads * args.linear_value_head_dim
        state = (num_slots, n_gdn, args.linear_num_value_heads, args.linear_key_head_dim, args.linear_value_head_dim)
        window = (num_slots, n_gdn, args.linear_conv_kernel_dim - 1, conv_dim)
        self.k, self.v, self.state, self.window = allocate_pool(
            "hybrid pool (K/V, GDN states, conv windows)",
            [(kv, dtype), (kv, dtype), (state, torch.float32), (window, dtype)], device, num_slots, slot_len)
        self.num_slots, self.slot_len = num_slots, slot_len
        self._caches = [PooledHybridCache(self, i, args, mode) for i in range(num_slots)]

    def cache(self, slot: int) -> HybridCache:
        """The :class:`HybridCache` of ``slot`` (its length is that request's committed tokens)."""
        return self._caches[slot]

    def nbytes(self) -> int:
        """Bytes held by the pool's tensors (K/V, states, windows)."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.state, self.window))
