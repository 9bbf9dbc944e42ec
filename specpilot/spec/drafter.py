"""The drafter protocol: what the engine, the pilot's replay and a future batch scheduler see of a drafter (§1.1).

A drafter proposes, for each request it is asked about, a :class:`~specpilot.spec.lattice.Lattice` of
candidate tokens for the next positions; a tree builder then picks the rows the exact pass verifies. It keeps
per-request state (an n-gram index, a draft model's cache, a block drafter's context K/V) in *slots*: the
request loop gives each running request a slot, resets it when the request starts and ends, and calls
:meth:`Drafter.propose` with a batch of :class:`DraftRequest` (one for a single request). A drafter that reads
target features names the target layers it wants (:attr:`Drafter.target_layers`) and gets their outputs for
every newly committed slot through :meth:`Drafter.observe`.

Every fact the engine must check before trusting a drafter is an attribute here, so a drafter that does not fit
its target is refused when the system is built (R16), not in the middle of a request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from specpilot.errors import DrafterError
from specpilot.spec.lattice import Lattice


@dataclass(frozen=True)
class DraftRequest:
    """One request's question to a drafter.

    Attributes:
        slot: the request's drafter state (``0 <= slot < max_slots``).
        committed: the committed token ids (prompt + output so far).
        depth: draft positions wanted (≥ 1); the lattice may be shorter (the drafter's block size, its context).
    """

    slot: int
    committed: list[int]
    depth: int


@runtime_checkable
class Drafter(Protocol):
    """What every drafter provides.

    Attributes:
        kind: ``ngram`` | ``draft_model`` | ``block``.
        target_layers: 0-based target decoder layers whose outputs it reads (``()``: none).
        vocab_size: the ids it proposes lie in ``[0, vocab_size)`` and must mean the target's tokens (None: it only
            proposes ids it saw in the committed tokens, as the n-gram drafter does).
        max_context: the most positions it can read and draft at (a draft model's ``max_position_embeddings``);
            None: no limit of its own. Asked for more, it drafts fewer positions or none.
        max_slots: requests it can hold at once.
    """

    kind: str
    target_layers: tuple[int, ...]
    vocab_size: int | None
    max_context: int | None
    max_slots: int

    def reset(self, slot: int = 0) -> None:
        """Forget the request held in ``slot`` (a new request starts there)."""

    def propose(self, batch: Sequence[DraftRequest]) -> list[Lattice | None]:
        """One lattice per request of ``batch`` (None: nothing to propose; the step is a plain decode step)."""

    def observe(self, slot: int, features: torch.Tensor, start: int) -> None:
        """Target features ``[k, len(target_layers) * hidden]`` of the committed slots ``[start, start + k)`` of the
        request in ``slot`` (called only when :attr:`target_layers` is non-empty)."""


def check_fits(drafter: Drafter, vocab_size: int, num_layers: int) -> None:
    """Refuse a drafter that does not fit a target of ``vocab_size`` ids and ``num_layers`` layers (R16).

    Raises:
        DrafterError: not a :class:`Drafter`; its vocabulary differs from the target's (ids would index other
            tokens, or past the target's embedding); it reads target layers the target does not have.
    """
    if not isinstance(drafter, Drafter):
        raise DrafterError(f"{type(drafter).__name__} is not a drafter (it needs kind, target_layers, vocab_size, "
                           "max_context, max_slots, reset, propose, observe: specpilot.spec.drafter.Drafter)")
    if drafter.vocab_size is not None and drafter.vocab_size != vocab_size:
        raise DrafterError(f"the {drafter.kind} drafter's vocabulary ({drafter.vocab_size} ids) does not fit the "
                           f"target's ({vocab_size} ids)")
    bad = [i for i in drafter.target_layers if not 0 <= i < num_layers]
    if bad:
        raise DrafterError(f"the {drafter.kind} drafter reads target layers {list(drafter.target_layers)}; the target "
                           f"has {num_layers} layers")


def propose_one(drafter: Drafter, committed: list[int], depth: int, slot: int = 0) -> Lattice | None:
    """:meth:`Drafter.propose` for a single request: its lattice or None."""
    return drafter.propose([DraftRequest(slot, committed, depth)])[0]


def draft_depth(drafter: Drafter, n_committed: int, depth: int) -> int:
    """Positions a drafter may draft after ``n_committed`` tokens: ``depth`` cut so that every drafted token's
    position stays below its :attr:`Drafter.max_context` (positions ``n_committed … n_committed + d − 1``); 0 when
    none fits."""
    if drafter.max_context is None:
        return depth
    return max(0, min(depth, drafter.max_context - n_committed))


class OneSlotDrafter:
    """Base of drafters that hold one request (slot 0): a subclass implements :meth:`draft` and :meth:`clear`
    (and :meth:`observe` when it reads target features) and sets the :class:`Drafter` attributes it changes."""

    kind = "custom"
    target_layers: tuple[int, ...] = ()
    vocab_size: int | None = None
    max_context: int | None = None
    max_slots = 1

    def check_slot(self, slot: int) -> None:
        """Raise :class:`DrafterError` unless ``slot`` is 0."""
        if slot != 0:
            raise DrafterError(f"the {self.kind} drafter holds one request (slot 0), asked for slot {slot}")

    def reset(self, slot: int = 0) -> None:
        """Forget the request (slot 0)."""
        self.check_slot(slot)
        self.clear()

    def propose(self, batch: Sequence[DraftRequest]) -> list[Lattice | None]:
        """:meth:`draft` of each request (slot 0 only)."""
        out = []
        for q in batch:
            self.check_slot(q.slot)
            out.append(self.draft(q.committed, q.depth))
        return out

    def observe(self, slot: int, features: torch.Tensor, start: int) -> None:
        """Reads no target features: nothing to do (beyond checking the slot)."""
        self.check_slot(slot)

    def clear(self) -> None:
        """Forget the request's state."""

    def draft(self, committed: list[int], depth: int) -> Lattice | None:
        """The lattice after ``committed`` for ``depth`` positions, or None."""
        raise NotImplementedError


class SlotFanout:
    """Single-request drafters, one per slot, as one :class:`Drafter` of ``len(drafters)`` slots: slot ``i`` is slot 0
    of ``drafters[i]``. For drafters that cannot hold several requests (a draft model's cache); a batch of them is
    drafted one request after another, not in one pass.

    Raises:
        DrafterError: no drafters, or drafters of different kinds or facts.
    """

    def __init__(self, drafters: Sequence[Drafter]):
        if not drafters:
            raise DrafterError("a slot fan-out needs at least one drafter")
        d0 = drafters[0]
        facts = (d0.kind, tuple(d0.target_layers), d0.vocab_size, d0.max_context)
        if any((d.kind, tuple(d.target_layers), d.vocab_size, d.max_context) != facts for d in drafters):
            raise DrafterError("the drafters of a slot fan-out must be of one kind, with the same facts")
        self.drafters = list(drafters)
        self.kind, self.target_layers, self.vocab_size, self.max_context = facts
        self.max_slots = len(self.drafters)

    def _of(self, slot: int) -> Drafter:
        if not 0 <= slot < self.max_slots:
            raise DrafterError(f"drafter slot {slot} outside [0, {self.max_slots})")
        return self.drafters[slot]

    def reset(self, slot: int = 0) -> None:
        """Reset slot ``slot`` (slot 0 of its drafter)."""
        self._of(slot).reset(0)

    def propose(self, batch: Sequence[DraftRequest]) -> list[Lattice | None]:
        """Each request drafted by its slot's drafter."""
        return [self._of(q.slot).propose([DraftRequest(0, q.committed, q.depth)])[0] for q in batch]

    def observe(self, slot: int, features: torch.Tensor, start: int) -> None:
        """Features of ``slot``'s request to its drafter."""
        self._of(slot).observe(0, features, start)


class SlotTable:
    """Per-request state of a drafter, one object per slot, built on first use (``new()``).

    Raises (from :meth:`get`): DrafterError for a slot outside ``[0, max_slots)``.
    """

    def __init__(self, max_slots: int, new):
        self.max_slots, self._new, self._slots = max_slots, new, {}

    def get(self, slot: int):
        """The state of ``slot`` (a fresh one the first time)."""
        if not 0 <= slot < self.max_slots:
            raise DrafterError(f"drafter slot {slot} outside [0, {self.max_slots})")
        if slot not in self._slots:
            self._slots[slot] = self._new()
        return self._slots[slot]

    def put(self, slot: int, state) -> None:
        """Replace ``slot``'s state."""
        self.get(slot)
        self._slots[slot] = state

    def drop(self, slot: int) -> None:
        """Forget ``slot``'s state (nothing when it has none)."""
        self._slots.pop(slot, None)
