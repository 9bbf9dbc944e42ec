"""The per-request drafter block (§4.4): each request of a batched step drafts one of a few depths (e.g. 16, 12 or
8 positions), chosen from its own recent acceptance and its drafter's recent confidence, and its tree is cut to that
depth.

Why: in a batched step every drafted position costs drafter rows for every request (a block drafter's rows are its
block positions, a sequential drafter's passes its depth), so a request that will not use deep positions should not
draft them; keeping the step's drafter rows inside the flat region of the drafter's GEMM cost is what the paper's
mechanism is for. Only the depth asked of the drafter (hence the lattice's and the tree's depth) changes; greedy
acceptance is unchanged, so the output stays AR greedy's whatever depth is picked.

The rule (:func:`pick_block`) is made before the step drafts, so it reads what the request's previous steps left
(:class:`BlockHistory`): the moving average of its accepted tokens and how far its last draft stayed confident
(:func:`confident_positions`). The batched engine and its exact replay keep the same history, so the replay
reproduces the engine's depths step for step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from specpilot.spec.lattice import Lattice

#: weight of the newest step in the moving average of accepted tokens (0.5: about the last 2-3 steps count)
DECAY = 0.5
#: a draft position whose cumulative top-1 probability (the chance the top-1 chain is still right there, by the
#: drafter's own estimate) is below this ends the useful block
THRESHOLD = 0.25
#: the block should reach this many times the recent mean acceptance: acceptance has a long tail, and a block
#: that ends at the mean would cut every above-average step
HEADROOM = 2.0


def confident_positions(lattice: Lattice | None, threshold: float = THRESHOLD) -> int:
    """Leading positions of ``lattice``'s top-1 chain whose cumulative top-1 probability stays ``>= threshold``.

    Follows ``children(path)[0]`` from the root (the drafter's own best guess at each position, conditioned on the
    guesses before it where the lattice conditions), summing log-probs, and stops at the first position whose sum is
    below ``log(threshold)`` or that has no candidate. 0 for ``None``.

    Raises:
        ValueError: ``threshold`` not in ``(0, 1]``.
    """
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"the confidence threshold is a probability in (0, 1], got {threshold}")
    if lattice is None:
        return 0
    floor, total, path = math.log(threshold), 0.0, ()
    while len(path) < lattice.depth:
        kids = lattice.children(path)
        if not kids or total + kids[0][1] < floor:
            break
        total += kids[0][1]
        path += (kids[0][0],)
    return len(path)


def pick_block(allowed: Sequence[int], accept_ema: float | None, confident: int, last_depth: int,
               headroom: float = HEADROOM) -> int:
    """The depth a request drafts this step: one of ``allowed`` (§4.4).

    Inputs, and why each is there:
        accept_ema: moving average of the draft tokens the request accepted per step (None: no step yet). Recent
            acceptance is the direct evidence of how deep the target follows this request's drafts; the block
            should reach ``headroom`` times it.
        confident / last_depth: positions of the request's last draft that stayed confident
            (:func:`confident_positions`), and that draft's depth. Acceptance lags (an average over past steps); the
            drafter's confidence reacts at once when a request enters predictable text. A draft confident to its very
            end (``confident >= last_depth``) says nothing of where confidence would end: it asks for a deeper
            block than the last one.

    Rule: with no history (the request's first step), the smallest allowed depth: there is no evidence yet, and
    starting every admitted request at the deepest block would make the steps where requests start the widest of
    all; a request grows on evidence within a step or two (docs/batching.md compares both starts by exact
    replay). Else ``want = max(headroom * accept_ema, confident)``, plus
    one when the last draft was confident to its end; the smallest allowed depth ``>= want``, or the largest allowed
    when none is. Either signal alone can ask for depth: a request is cut short only when both say it will not use
    the positions.

    Raises:
        ValueError: ``allowed`` empty or holding a depth < 1.
    """
    if not allowed or min(allowed) < 1:
        raise ValueError(f"allowed drafter blocks must be depths >= 1, got {list(allowed)}")
    if accept_ema is None:
        return min(allowed)
    want = max(headroom * accept_ema, confident + (1 if confident >= last_depth else 0))
    fits = [d for d in allowed if d >= want]
    return min(fits) if fits else max(allowed)


@dataclass
class BlockHistory:
    """What one request's past steps leave for :func:`pick_block` (kept per request by the batched engine and its
    replay, from the same inputs, so both pick the same depths).

    Attributes:
        accept_ema: moving average (weight :data:`DECAY` on the newest) of draft tokens accepted per decode step,
            bonus excluded; None before the first step.
        confident: :func:`confident_positions` of the last draft (0: no draft, or none yet).
        last_depth: depth asked of the drafter at the last step (0: none yet).
    """

    accept_ema: float | None = None
    confident: int = 0
    last_depth: int = 0

    def pick(self, allowed: Sequence[int]) -> int:
        """:func:`pick_block` on this history."""
        return pick_block(allowed, self.accept_ema, self.confident, self.last_depth)

    def drafted(self, lattice: Lattice | None, depth: int) -> None:
        """Record a step's draft: its lattice (None: the drafter proposed nothing) and the depth asked."""
        self.confident, self.last_depth = confident_positions(lattice), depth

    def accepted(self, n: int) -> None:
        """Record a step's accepted draft tokens (0 when nothing was drafted or nothing matched)."""
        self.accept_ema = float(n) if self.accept_ema is None else DECAY * n + (1 - DECAY) * self.accept_ema
