"""Typed configuration of one system: which drafter, which tree builder, which budget.

A :class:`SystemConfig` is what the pilot's planner proposes, what the controller compares, what a memory
entry's delta changes and what the seal freezes (§3.3, §3.5). ``stock`` is the published baseline of §1.1:
top-1 chain verification of the deployment's drafter, no mechanism on.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

DrafterKind = Literal["none", "ngram", "draft_model", "block", "eagle3", "calibrated"]
TreeKind = Literal["chain", "best_first", "ddtree_marginal", "eagle2_topk", "sequoia"]
RowSelection = Literal["per_request", "shared_budget"]
QWeights = Literal["view8", "int8", "int6"]


class SystemConfig(BaseModel):
    """One speculative decoding system (a point in the planner's search space).

    Attributes:
        drafter: ``none`` (AR greedy), ``ngram`` (prompt lookup), ``draft_model`` (small causal LM) or
            ``block`` (DFlash-style block drafter; its checkpoint says whether it has a Markov head), ``eagle3``
            (EAGLE-3-style drafter, ours or a public head: :mod:`specpilot.spec.eagle3`); ``calibrated``:
            SIMULATED acceptance from a real pair's calibration (:mod:`specpilot.spec.calibrated`).
        drafter_path: checkpoint directory of the draft model / block / eagle3 drafter (``None``: the deployment's); the
            calibration file of ``calibrated``.
        tree: tree builder over the drafter's lattice: ``chain`` (stock, §1.1), ``best_first`` (§4.2),
            ``ddtree_marginal``, ``eagle2_topk`` or ``sequoia`` (see :mod:`specpilot.spec.trees`).
        nodes: tree budget N, the number of drafted nodes verified per exact pass (root excluded).
        depth: draft positions per step (the lattice's length); a tree's depth is at most this.
        top_k: candidates per draft position kept in the lattice.
        ngram_max / ngram_min: longest / shortest suffix the n-gram drafter matches.
        dtype: dtype of target and drafter weights and activations.
        w12: the target's projection layers (q/k/v/o, gate/up/down; not the LM head or embeddings) run from
            W12 lossless 12-bit weights (§4.1, :mod:`specpilot.w12.convert`), in AR and speculative
            decoding alike. Needs bf16-valued target weights (a bf16 checkpoint, in any ``dtype``).
        lm_head_int8: the target's greedy argmax (AR steps, verify passes) goes through the certified INT8
            LM head (§4.1, :mod:`specpilot.head.certified`): an INT8 pass discards tokens proven
            unable to be the argmax, survivors are rescored exactly; the argmax never changes.
        tlv: two-level verification (§4.3, :mod:`specpilot.engine.tlv`): each step drafts, runs a Q pass over the
            tree with approximate weights, commits nothing, drafts again from the end of the Q pass's chain and
            verifies chain + subtree (``nodes`` in all) in the one exact pass. Single requests only; needs a drafter.
        q_weights: the Q pass's weights (:mod:`specpilot.model.qview`): ``view8`` (the 8-bit view nested in W12
            records; with ``w12`` off, a copy encoded from the target's bf16 rounding), ``int8`` or ``int6`` (per-row
            scaled copies, §5.4). Only read with ``tlv``.
        row_selection: how a batched step chooses the rows it verifies (§4.4). ``per_request``: each request
            verifies its own tree of ``nodes`` nodes (stock batching: each its own top-1 chain). ``shared_budget``:
            the step's requests share one node budget, filled best-first by path log-probability across all of
            their lattices (:func:`specpilot.spec.trees_batch.build_shared`); needs ``tree="best_first"``.
            Single-request engines ignore it (one request: the shared budget is its own best-first tree).
        shared_budget: the step's node budget per batch size under ``shared_budget``: entry ``n - 1`` is the
            budget of a step over ``n`` requests (the planner's per-batch-size budgets, from the flat region of the
            target's GEMM cost); batch sizes past its end, or all of them when it is empty, get ``nodes * n``
            (the total of an equal split). See :meth:`step_budget`.
        prompt_admission: prompt rows a batched decode step may carry (§4.4 prompt admission): prompts admitted
            while requests run are prefilled inside that step's exact pass, not in a pass of their own, when their
            rows together are at most this many (more: their own prefill pass, as with 0 = off). Lossless: prompt
            rows attend only to their own prompt.
        drafter_block: the per-request drafter block (§4.4): the depths a request of a batched step may draft, e.g.
            ``(16, 12, 8)``, each at most ``depth``; every step each request drafts one of them, picked from its
            recent acceptance and its last draft's confidence (:func:`specpilot.spec.drafter_block.pick_block`), and
            its tree is at most that deep. ``()``: off (every request drafts ``depth``). Lossless: only the depth
            asked of the drafter changes. Single-request engines ignore it (one request: no other request's
            drafter rows to make room for).

    Fields are strict: a value is taken as given or refused, never converted (``w12="yes"``, ``nodes=6.0`` or
    ``nodes="6"`` are errors, not ``True`` / ``6``); JSON's ints, bools and lists (for the tuples) are already
    typed, so system.json files and memory entries read as they were written.

    Raises:
        pydantic.ValidationError: on out-of-range values (e.g. ``nodes < 1``) or values of another type
            (:func:`specpilot.errors.validation_message` turns it into one line).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    drafter: DrafterKind = "ngram"
    drafter_path: StrictStr | None = None
    tree: TreeKind = "chain"
    nodes: StrictInt = Field(default=6, ge=1, le=256)
    depth: StrictInt = Field(default=6, ge=1, le=64)
    top_k: StrictInt = Field(default=1, ge=1, le=64)
    ngram_max: StrictInt = Field(default=4, ge=1, le=16)
    ngram_min: StrictInt = Field(default=1, ge=1, le=16)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    w12: StrictBool = False
    lm_head_int8: StrictBool = False
    row_selection: RowSelection = "per_request"
    shared_budget: tuple[StrictInt, ...] = ()  # a JSON list is a tuple; its entries stay strict
    prompt_admission: StrictInt = Field(default=0, ge=0, le=8192)
    drafter_block: tuple[StrictInt, ...] = ()
    tlv: StrictBool = False
    q_weights: QWeights = "view8"

    @model_validator(mode="after")
    def _check(self) -> "SystemConfig":
        if self.ngram_min > self.ngram_max:
            raise ValueError("ngram_min must be <= ngram_max")
        if self.row_selection == "shared_budget" and self.tree != "best_first":
            raise ValueError(f"row_selection shared_budget fills best-first trees: needs tree best_first, not {self.tree}")
        if self.shared_budget and self.row_selection != "shared_budget":
            raise ValueError("shared_budget is set but row_selection is not shared_budget")
        if self.tlv and self.drafter == "none":
            raise ValueError("tlv needs a drafter: its cycle drafts twice around a Q pass")
        if self.q_weights != "view8" and not self.tlv:
            raise ValueError(f"q_weights {self.q_weights} is set but tlv is off (the Q pass's weights apply with tlv)")
        if self.drafter_block and self.drafter == "none":
            raise ValueError("drafter_block is set but there is no drafter (it picks each request's draft depth)")
        if any(not 1 <= d <= self.depth for d in self.drafter_block):
            raise ValueError(f"drafter_block depths must be in 1..depth ({self.depth}), got {list(self.drafter_block)}")
        if len(set(self.drafter_block)) != len(self.drafter_block):
            raise ValueError(f"drafter_block depths must be distinct, got {list(self.drafter_block)}")
        if any(not 1 <= b <= 8192 for b in self.shared_budget):
            raise ValueError(f"shared_budget entries must be in 1..8192 nodes, got {list(self.shared_budget)}")
        return self

    def step_budget(self, n: int) -> int:
        """Nodes verified in one batched step over ``n`` requests under ``shared_budget`` (§4.4):
        ``shared_budget[n - 1]`` when given, else ``nodes * n``. Raises ValueError for ``n < 1``."""
        if n < 1:
            raise ValueError(f"a step has at least one request, got {n}")
        return self.shared_budget[n - 1] if n <= len(self.shared_budget) else self.nodes * n

    @classmethod
    def stock(cls, drafter: DrafterKind = "ngram", depth: int = 6, **kw) -> "SystemConfig":
        """Stock (§1.1): top-1 chain of ``depth`` positions from ``drafter``, nothing else on."""
        return cls(drafter=drafter, tree="chain", nodes=depth, depth=depth, top_k=1, **kw)

    @classmethod
    def ar(cls, **kw) -> "SystemConfig":
        """Plain autoregressive greedy decoding (the oracle)."""
        return cls(drafter="none", tree="chain", nodes=1, depth=1, top_k=1, **kw)

    def delta(self, base: "SystemConfig") -> dict:
        """Fields that differ from ``base``: ``{field: value}`` (a memory entry's config delta, §3.5)."""
        a, b = self.model_dump(), base.model_dump()
        return {k: v for k, v in a.items() if b.get(k) != v}

    def apply(self, delta: dict) -> "SystemConfig":
        """A copy with ``delta`` applied. Raises pydantic.ValidationError on an invalid delta."""
        return SystemConfig(**{**self.model_dump(), **delta})

    def seal(self) -> str:
        """SHA-256 of the canonical JSON of this config (the seal of §3.3). Fields added later (``w12``,
        ``lm_head_int8``, ``row_selection``, ``shared_budget``, ``prompt_admission``, ``tlv``, ``q_weights``,
        ``drafter_block``) enter only when set, so configs sealed before they existed keep their seals."""
        d = {k: v for k, v in self.model_dump().items() if not (k in _LATER_FIELDS and v == _LATER_FIELDS[k])}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()

    def label(self) -> str:
        """Short human label, e.g. ``ngram/best_first N=16 D=6 k=4`` (``+w12`` / ``+int8head`` / ``+shared`` /
        ``+admitR`` / ``+block16/12/8`` / ``+tlv`` (``+tlv:int8``) appended when those mechanisms are on)."""
        w12 = (" +w12" if self.w12 else "") + (" +int8head" if self.lm_head_int8 else "")
        w12 += " +shared" if self.row_selection == "shared_budget" else ""
        w12 += f" +admit{self.prompt_admission}" if self.prompt_admission else ""
        w12 += " +block" + "/".join(map(str, self.drafter_block)) if self.drafter_block else ""
        w12 += (" +tlv" + ("" if self.q_weights == "view8" else f":{self.q_weights}")) if self.tlv else ""
        if self.drafter == "none":
            return "AR" + w12
        return f"{self.drafter}/{self.tree} N={self.nodes} D={self.depth} k={self.top_k}{w12}"


#: fields added after configs were first sealed, with the default that leaves them out of the seal
_LATER_FIELDS = {"w12": False, "lm_head_int8": False, "row_selection": "per_request", "shared_budget": (),
                 "prompt_admission": 0, "tlv": False, "q_weights": "view8", "drafter_block": ()}
