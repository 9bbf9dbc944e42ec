"""The target state of one request: a static KV cache with its committed length.

The model writes K/V *contents* at the slots of the rows it runs; how many slots hold committed tokens (the
length) changes only through :meth:`KVCache.commit`, which the request loop calls (the target's cache: only
:class:`~specpilot.engine.engine.Engine`; a draft model's private cache: only its drafter). Slots at or past
the length are scratch: a pass writes its rows there, and whatever is not committed is never read as history.
A hybrid target (Gated DeltaNet layers) will keep its recurrent state and conv window beside these tensors
under the same contract: changed by exact passes only, made equal to a fresh prefill of the committed tokens
by :meth:`commit` / :meth:`compact`.
"""

from __future__ import annotations

import enum
import math

import torch

from specpilot.errors import SpecPilotError
from specpilot.model.args import ModelArgs


class PassKind(enum.Enum):
    """What a target pass may write (§1.2, §4.3).

    ``EXACT``: the exact pass, the only one that commits: it writes its rows' K/V at ``[start, start + R)``
    (scratch slots until the request loop commits an accepted prefix or path of them). ``INSPECT``: reads the
    committed prefix and writes no state at all (TLV's Q pass inspects a tree this way; its K/V stay in
    temporaries), so the cache after it is bit for bit the cache before.
    """

    EXACT = "exact"
    INSPECT = "inspect"


class KVCache:
    """Static KV cache of one request: ``k, v [num_layers, max_len, n_kv_heads, head_dim]``.

    Slot ``i`` holds the keys/values of the token at position ``i`` of the committed sequence; slots
    ``[0, length)`` are committed. Rows of a pass are written at ``[start, start + R)``.

    Raises:
        ValueError: ``max_len < 1``.
    """

    def __init__(self, args: ModelArgs, max_len: int, dtype: torch.dtype, device: torch.device | str,
                 storage: tuple[torch.Tensor, torch.Tensor] | None = None):
        if max_len < 1:
            raise ValueError(f"a cache needs at least one slot, got max_len {max_len}")
        shape = (args.num_layers, max_len, args.n_kv_heads, args.head_dim)
        if storage is None:
            storage = (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        self.k, self.v = storage  # ``storage``: a slot of a KVPool (views of its tensors)
        self.max_len = max_len
        self._length = 0

    @property
    def length(self) -> int:
        """Committed slots (read-only: see :meth:`commit`)."""
        return self._length

    def commit(self, n: int) -> None:
        """Declare slots ``[0, n)`` committed (the K/V of the committed tokens but the last, in the engine's
        invariant); ``n = 0`` frees the request's slots (R14).

        Raises:
            ValueError: ``n`` outside ``[0, max_len]``.
        """
        if not 0 <= n <= self.max_len:
            raise ValueError(f"cannot commit {n} slots of a cache of {self.max_len}")
        self._length = n

    def checkpoint(self) -> int:
        """A mark of the committed state for :meth:`rollback` (here the length: K/V past it are scratch)."""
        return self._length

    def rollback(self, mark: int) -> None:
        """Go back to the committed state of :meth:`checkpoint`'s ``mark`` (a draft model's drafted positions
        are dropped this way)."""
        self.commit(mark)

    def rewind(self, n: int) -> int:
        """Commit back to ``n`` tokens (a K/V cache can: its slots past the length are rewritten by the next pass);
        returns the length kept, ``min(n, length)`` (a recurrent cache may keep fewer: :meth:`HybridCache.rewind`)."""
        self.commit(min(n, self._length))
        return self._length

    def nbytes(self) -> int:
        """Bytes held by the cache tensors."""
        return self.k.numel() * self.k.element_size() * 2

    def compact(self, start: int, rows: torch.Tensor) -> None:
        """Move an accepted path into place: copy slots ``start + rows[j]`` to ``start + j`` (§1.1, R8).

        Args:
            start: first slot of the verified rows (the root's slot).
            rows: ``[k] long``, increasing row indices of the accepted path (root = row 0 first).
        The length is not changed: the request loop commits what it keeps.
        """
        k = rows.numel()
        src = rows.to(self.k.device) + start
        self.k[:, start : start + k] = self.k[:, src]
        self.v[:, start : start + k] = self.v[:, src]


def allocate_pool(what: str, specs: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device | str,
                  num_slots: int, slot_len: int) -> list[torch.Tensor]:
    """Zeroed tensors of a batch's pool (:class:`KVPool`, :class:`~specpilot.model.hybrid_pool.HybridPool`), one
    per ``(shape, dtype)`` of ``specs``, on ``device``.

    Raises:
        SpecPilotError: a tensor cannot be allocated (the CPU allocator's refusal, or ``torch.OutOfMemoryError``, a
            RuntimeError, on a GPU): one line naming ``what``, ``num_slots`` x ``slot_len`` and the GiB of all of
            ``specs`` together, and what to lower (the slots are ``--max-num-seqs`` / ``--batch``, the length
            ``--max-model-len``), instead of the allocator's traceback.
    """
    try:
        return [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in specs]
    except RuntimeError:
        gib = sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs) / 2**30
        raise SpecPilotError(f"cannot allocate the {what} on {device}: {num_slots} slots x {slot_len} positions "
                             f"is {gib:,.1f} GiB; hold fewer requests at once (--max-num-seqs, --batch) or a "
                             "shorter context (--max-model-len)") from None


class KVPool:
    """The K/V of every request a batch can hold: ``k, v [num_slots, num_layers, slot_len, n_kv_heads, head_dim]``.

    Slot ``i`` is one request's :class:`KVCache` (:meth:`cache`, views of the pool's tensors: the same layout as a
    request's own cache), so one exact pass can write and read every request's K/V (``forward_batch``). Which
    request owns a slot is the batch engine's business; a slot's length is its cache's, committed by that engine.

    Args:
        args: the model's architecture; num_slots: requests held at once; slot_len: positions a slot holds (the
            context plus room for a pass's rows).
    Raises:
        ValueError: ``num_slots < 1`` or ``slot_len < 1``.
        SpecPilotError: the pool's two tensors cannot be allocated on ``device`` (one line with their size and what
            to lower: the slots are ``--max-num-seqs`` / ``--batch`` sizes, the length ``--max-model-len``).
    Attributes:
        prefix_reuse: a new request may start from K/V copied from another slot (:meth:`copy_prefix`).
        padded_passes: the padded :class:`~specpilot.engine.batch_runner.BatchRunner` (CUDA graphs, padding rows in
            a scratch slot) runs on this pool (a hybrid target's pool says False).
    """

    padded_passes = True
    prefix_reuse = True

    def __init__(self, args: ModelArgs, num_slots: int, slot_len: int, dtype: torch.dtype,
                 device: torch.device | str):
        if num_slots < 1 or slot_len < 1:
            raise ValueError(f"a KV pool needs at least one slot of one position, got {num_slots} x {slot_len}")
        shape = (num_slots, args.num_layers, slot_len, args.n_kv_heads, args.head_dim)
        self.k, self.v = allocate_pool("K/V pool", [(shape, dtype)] * 2, device, num_slots, slot_len)
        self.num_slots, self.slot_len = num_slots, slot_len
        self._caches = [KVCache(args, slot_len, dtype, device, storage=(self.k[i], self.v[i])) for i in range(num_slots)]

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Copy positions ``[0, n)`` of slot ``src``'s K/V, every layer, into slot ``dst`` (a shared prompt prefix,
        :mod:`specpilot.engine.prefix`). Raises ValueError: ``n`` past the slots' length."""
        if not 0 <= n <= self.slot_len:
            raise ValueError(f"cannot copy {n} positions of slots of {self.slot_len}")
        self.k[dst, :, :n] = self.k[src, :, :n]
        self.v[dst, :, :n] = self.v[src, :, :n]

    def cache(self, slot: int) -> KVCache:
        """The :class:`KVCache` of ``slot`` (its length is that request's committed slots)."""
        return self._caches[slot]

    def nbytes(self) -> int:
        """Bytes held by the pool's tensors."""
        return self.k.numel() * self.k.element_size() * 2
