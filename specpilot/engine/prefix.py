"""Prompt prefixes reused across the requests of a batch: a new request's prompt starts from the K/V another request
left in the pool (vLLM's automatic prefix caching, at token granularity; §2.2's prefill is the cost it skips).

K/V at a position depend only on the tokens up to it, so when a new prompt shares its first ``L`` tokens with the
tokens whose K/V a slot holds (a running request's committed tokens, or those a finished request left in a slot
that is free and not yet reused), those ``L`` positions are copied into the new request's slot (nothing copied
when it is that very slot) and its prefill starts at ``L``. At least the prompt's last token is always prefilled:
its logits give the first new token. Reuse starts at :data:`MIN_TOKENS` shared tokens (shorter prefixes save less
than a copy of every layer costs). In float32 on the CPU the copied K/V are what the other request's prefill pass
computed, which may round differently from this request's own pass (the GEMMs' rows differ), as batching prompts
together already does; outputs stay AR greedy's (``tests/test_prefix.py``).

Not for a hybrid target (its recurrent states are not per position: the pool says ``prefix_reuse = False``) nor for
a drafter that reads the target's features of every prompt row (EAGLE-3, the block drafter): the skipped rows would
give it none.
"""

from __future__ import annotations

from typing import Iterable

MIN_TOKENS = 16  # shared tokens below which a prompt is prefilled whole


def shared_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Which slots of a :class:`~specpilot.model.cache.KVPool` hold whose K/V, and their reuse (module doc).

    Args:
        pool: the batch's pool (its ``copy_prefix``).
        min_tokens: shared tokens from which a prefix is reused (>= 1).
    Attributes:
        kept: free slot -> the tokens whose K/V it still holds (a finished request's), until a new request takes it;
            in the order :meth:`pick` evicts them (least recently released or read first).
        hits / reused_tokens: prompts that started from a resident prefix, and the prompt tokens they did not prefill.
        queried_tokens: prompt tokens of every prompt looked up (vLLM's prefix-cache queries; hits are
            ``reused_tokens``).
    Raises:
        ValueError: ``min_tokens < 1``.
    """

    def __init__(self, pool, min_tokens: int = MIN_TOKENS):
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be at least 1, got {min_tokens}")
        self.pool, self.min_tokens = pool, min_tokens
        self.kept: dict[int, list[int]] = {}
        self.hits = self.reused_tokens = self.queried_tokens = 0

    def release(self, slot: int, tokens: list[int]) -> None:
        """``slot`` is free and still holds the K/V of ``tokens`` (positions ``[0, len(tokens))``)."""
        self.kept.pop(slot, None)
        self.kept[slot] = list(tokens)  # the newest entry last: :meth:`pick` evicts from the front

    def pick(self, prompt: list[int], free: list[int]) -> int:
        """The free slot a new request with ``prompt`` takes (``free`` non-empty), keeping as many finished
        requests' prefixes resident as the slots allow (vLLM's block cache evicts least recently used blocks; here
        whole slots):

        1. a kept slot whose tokens and ``prompt`` cover one another (the same prompt again, whose greedy output is
           what the slot holds; or a later turn of its conversation): nothing it holds is lost, nothing is copied;
        2. else the lowest free slot that keeps nothing (the prefix, if any, is copied into it);
        3. else the kept slot least recently released or read.

        Raises ValueError: no free slot."""
        if not free:
            raise ValueError("no free slot")
        best, own = 0, None
        for s in free:
            toks = self.kept.get(s)
            if toks is not None:
                n = shared_prefix(prompt, toks)
                if n >= self.min_tokens and n >= min(len(prompt), len(toks)) and n > best:
                    best, own = n, s
        if own is not None:
            return own
        empty = [s for s in free if s not in self.kept]
        if empty:
            return min(empty)
        return min(free, key=list(self.kept).index)

    def claim(self, slot: int) -> None:
        """A new request took ``slot``: what it kept will be overwritten."""
        self.kept.pop(slot, None)

    def clear(self) -> None:
        """Forget every kept slot (the engine's reset)."""
        self.kept.clear()

    def _best(self, prompt: list[int], resident) -> tuple[int, int | None]:
        best, src = 0, None
        for s, toks in (*self.kept.items(), *resident):
            n = shared_prefix(prompt, toks)
            if n > best:
                best, src = n, s
        return best, src

    def waits(self, prompt: list[int], admitted: list[list[int]], resident: Iterable[tuple[int, list[int]]]) -> bool:
        """Whether ``prompt`` should wait a step: a prompt ``admitted`` in this step (its K/V not computed yet)
        shares more of it than any slot holds, and at least :attr:`min_tokens`, so next step it copies what it would
        prefill now (identical prompts arriving together are prefilled once)."""
        held = self._best(prompt, resident)[0]
        return any(shared_prefix(prompt, a) >= max(held + 1, self.min_tokens) for a in admitted)

    def reuse(self, slot: int, prompt: list[int], resident: Iterable[tuple[int, list[int]]]) -> int:
        """Start ``prompt``'s request in ``slot`` from the longest resident prefix: among the kept slots and
        ``resident`` (``(slot, tokens whose K/V it holds)`` of the running requests), copy the first ``L`` positions
        of the best into ``slot``, claim ``slot``, and return ``L`` (0: nothing reused; at most ``len(prompt) - 1``):
        the prefill's rows start there. The engine commits the cache's length, as for every pass."""
        self.queried_tokens += len(prompt)
        best, src = self._best(prompt, resident)
        if slot in self.kept and shared_prefix(prompt, self.kept[slot]) == best:  # a tie: the slot itself, no copy
            src = slot
        self.claim(slot)
        n = min(best, len(prompt) - 1)
        if n < self.min_tokens:
            return 0
        if src != slot:
            self.pool.copy_prefix(src, slot, n)
            if src in self.kept:  # read: the last to be evicted
                self.kept[src] = self.kept.pop(src)
        self.hits += 1
        self.reused_tokens += n
        return n
