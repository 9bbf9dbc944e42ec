"""A load plan: one sealed system per batch size, and the rule that picks the one a batched step runs (§4.4, §5.1).

Every verified row costs in batching, so the system that wins at one request loses at sixteen (§2.2), and
``specpilot pilot --batch 1,8,32`` seals one system per size. A server's load moves between those sizes from one
step to the next; a :class:`LoadPlan` lets the batched engine follow it: a step over ``m`` running requests runs the
system sealed at the size nearest ``m`` (:meth:`LoadPlan.index_for`). Every system of a plan is lossless, so the
switch never changes a token; it changes only which rows a step verifies.

The systems of one plan share the target (dtype, W12, certified head: one set of weights serves them all) and at
most one drafter that reads target features (it must observe every pass). Drafters that read none (n-gram, draft
model) may differ between sizes: each catches up on the committed tokens when its size's step next asks it.
"""

from __future__ import annotations

from dataclasses import dataclass

from specpilot.config import SystemConfig
from specpilot.errors import DrafterError, SpecPilotError
from specpilot.spec.drafter import Drafter, check_fits

#: Fields that shape the target's weights: every system of a plan must agree on them.
TARGET_FIELDS = ("dtype", "w12", "lm_head_int8")
#: Fields that shape a drafter: systems agreeing on them share one drafter object.
DRAFTER_FIELDS = ("drafter", "drafter_path", "top_k", "ngram_max", "ngram_min")
#: Drafter kinds that read target features (observe every pass): at most one of them per plan.
FEATURE_DRAFTERS = ("block", "eagle3", "calibrated")


@dataclass(frozen=True)
class LoadPlan:
    """Systems sealed at batch sizes ``sizes`` (increasing, distinct, each ≥ 1), ``configs[i]`` sealed at
    ``sizes[i]``.

    Raises:
        SpecPilotError: no system, sizes not increasing or below 1, a TLV system (single requests only), systems
            that disagree on the target (:data:`TARGET_FIELDS`), or more than one feature-reading drafter.
    """

    sizes: tuple[int, ...]
    configs: tuple[SystemConfig, ...]

    def __post_init__(self):
        if not self.sizes or len(self.sizes) != len(self.configs):
            raise SpecPilotError(f"a load plan needs one system per size: {len(self.sizes)} sizes, "
                                 f"{len(self.configs)} systems")
        if self.sizes[0] < 1 or any(b <= a for a, b in zip(self.sizes, self.sizes[1:])):
            raise SpecPilotError(f"a load plan's sizes must increase from 1 or more, got {list(self.sizes)}")
        if any(c.tlv for c in self.configs):
            raise SpecPilotError("tlv runs single requests only: it cannot be a load plan's system")
        for f in TARGET_FIELDS:
            values = {getattr(c, f) for c in self.configs}
            if len(values) > 1:
                raise SpecPilotError(f"the systems of a load plan share one target, but their {f} values differ: "
                                     f"{sorted(map(str, values))}")
        feature_kinds = {self.drafter_key(i) for i, c in enumerate(self.configs) if c.drafter in FEATURE_DRAFTERS}
        if len(feature_kinds) > 1:
            raise SpecPilotError("a load plan may hold one drafter that reads target features (block, eagle3, "
                                 f"calibrated); these systems use {len(feature_kinds)}: {sorted(map(str, feature_kinds))}")

    @classmethod
    def single(cls, config: SystemConfig) -> "LoadPlan":
        """The plan of one system at every load."""
        return cls((1,), (config,))

    @classmethod
    def from_sizes(cls, systems: dict[int, SystemConfig]) -> "LoadPlan":
        """``{size: config}`` (any order) as a plan. Raises as the constructor."""
        sizes = tuple(sorted(systems))
        return cls(sizes, tuple(systems[n] for n in sizes))

    def __len__(self) -> int:
        return len(self.sizes)

    def index_for(self, m: int) -> int:
        """Index of the system a step over ``m`` running requests runs: the sealed size nearest ``m`` on a log
        scale (between sealed sizes nothing was measured; relative distance is what moves a step's cost), a tie
        going to the larger size, whose system verifies fewer rows per request. Below the smallest size, the
        smallest; above the largest, the largest. Raises ValueError for ``m < 1``."""
        if m < 1:
            raise ValueError(f"a step has at least one request, got {m}")
        above = next((i for i, n in enumerate(self.sizes) if n >= m), len(self.sizes) - 1)
        if above == 0 or self.sizes[above] < m:
            return above
        below = above - 1  # sizes[below] < m <= sizes[above]: m nearer sizes[below] when m / a < b / m, in integers
        return below if m * m < self.sizes[below] * self.sizes[above] else above

    def config_for(self, m: int) -> SystemConfig:
        """The :class:`SystemConfig` a step over ``m`` running requests runs (:meth:`index_for`)."""
        return self.configs[self.index_for(m)]

    def drafter_key(self, i: int) -> tuple:
        """What shapes system ``i``'s drafter (:data:`DRAFTER_FIELDS`); systems with equal keys share a drafter."""
        return tuple(getattr(self.configs[i], f) for f in DRAFTER_FIELDS)

    def tree_rows(self, max_num_seqs: int, drafts: list[bool] | None = None) -> int:
        """Most drafted nodes one request's tree can hold in any step of up to ``max_num_seqs`` requests (a shared
        budget may go to a single request; each system counted at the loads it runs at); 0 when no system drafts. ``drafts``: per system, whether it drafts
        (default: whether its config names a drafter). Sizes a slot of the pool."""
        return max((self._rows_of(i, max_num_seqs) for i in self._drafting(drafts)), default=0)

    def step_extra_rows(self, max_num_seqs: int, drafts: list[bool] | None = None) -> int | None:
        """Most drafted rows a step adds in all when every drafting system shares its budget (the largest shared
        budget); None when a per-request system drafts (then ``tree_rows`` per request bounds a step) or none does."""
        drafting = self._drafting(drafts)
        if not drafting or any(self.configs[i].row_selection != "shared_budget" for i in drafting):
            return None
        return self.tree_rows(max_num_seqs, drafts)

    def _drafting(self, drafts: list[bool] | None) -> list[int]:
        drafts = [c.drafter != "none" for c in self.configs] if drafts is None else drafts
        return [i for i, d in enumerate(drafts) if d]

    def _rows_of(self, i: int, max_num_seqs: int) -> int:
        """Most nodes one request's tree holds under system ``i``, over the loads (1..``max_num_seqs``) at which a
        step runs it (:meth:`index_for`): a shared budget's entries for other loads never size a step."""
        c = self.configs[i]
        loads = [m for m in range(1, max_num_seqs + 1) if self.index_for(m) == i]
        if c.row_selection == "shared_budget":
            return max((c.step_budget(m) for m in loads), default=0)
        return c.nodes if loads else 0

    def describe(self) -> str:
        """One line: each size and its system's label, e.g. ``1: ngram/best_first N=4 ...; 16: AR``."""
        return "; ".join(f"{n}: {c.label()}" for n, c in zip(self.sizes, self.configs))


def bind_drafters(plan: LoadPlan, drafter, target, max_num_seqs: int) -> tuple[list, tuple, Drafter | None]:
    """A batched engine's drafters for ``plan``: ``drafter`` is one :class:`Drafter` (or None: AR) for every system,
    or a list with one per system. Returns ``(per-system list, the distinct drafters, the one that reads target
    features or None)``.

    Raises:
        ValueError: a list of another length than the plan.
        DrafterError: a drafter that does not fit ``target`` or holds fewer than ``max_num_seqs`` slots; two
            drafters that read target features (each must observe every pass; a pass gathers one set).
    """
    per = list(drafter) if isinstance(drafter, (list, tuple)) else [drafter] * len(plan)
    if len(per) != len(plan):
        raise ValueError(f"{len(plan)} systems in the plan, {len(per)} drafters")
    distinct = tuple({id(d): d for d in per if d is not None}.values())
    for d in distinct:
        check_fits(d, target.args.vocab_size, target.args.num_layers)
        if d.max_slots < max_num_seqs:
            raise DrafterError(f"the {d.kind} drafter holds {d.max_slots} requests, the batch {max_num_seqs}")
    readers = [d for d in distinct if d.target_layers]
    if len(readers) > 1:
        raise DrafterError(f"at most one drafter may read target features, got {[d.kind for d in readers]}")
    return per, distinct, (readers[0] if readers else None)


__all__ = ["LoadPlan", "bind_drafters", "TARGET_FIELDS", "DRAFTER_FIELDS", "FEATURE_DRAFTERS"]
