"""Exact replay: τ of any tree policy without running the target again (§2.4, §4.2).

Greedy decoding is deterministic, so the target's greedy continuation of every prefix of an AR output is
that output itself. Record once, per request and per committed length m, the drafter's lattice at the
prefix ``prompt + ar[:m]``; then simulate the engine's step sequence for a policy (tree builder, N, depth,
top-K): build the tree, accept the longest path that matches the AR output, add the bonus. The step
bookkeeping mirrors :meth:`specpilot.engine.engine.Engine.generate` exactly, so replay τ equals the
engine's τ on the same prompts (tested). The ``oracle`` policy accepts while the AR token is anywhere in
the lattice's candidates (the top-K oracle of §2.4).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from specpilot.config import SystemConfig
from specpilot.spec.lattice import Lattice
from specpilot.spec.drafter import propose_one
from specpilot.spec.trees import SequoiaBuilder, build_tree


class TruncatedLattice(Lattice):
    """A lattice cut to its first ``depth`` positions and ``top_k`` candidates per position.

    For a sequential drafter (greedy top-1 chain), this equals drafting ``depth`` positions with
    ``top_k`` candidates, so one recording at the largest depth / top-K serves every smaller policy.
    """

    def __init__(self, base: Lattice, depth: int, top_k: int):
        self.base, self.depth, self.top_k = base, min(depth, base.depth), top_k

    def children(self, path):
        return self.base.children(path)[: self.top_k] if len(path) < self.depth else []

    def marginal(self, path):
        """Parent-free candidates, cut the same way (Markov conditioning stays in :meth:`children`)."""
        return self.base.marginal(path)[: self.top_k] if len(path) < self.depth else []


@dataclass
class Recording:
    """Lattices of one drafter along AR outputs.

    Attributes:
        prompts / ar: prompt ids and AR output ids per request.
        lattices: per request, ``{committed_len_after_prompt: Lattice | None}`` at the recorded depth / K.
        depth / top_k: what was recorded (policies may use less).
        draft_ms: mean wall time of one ``propose`` call at ``depth`` positions after a request's first, ms.
        first_ms: mean wall time of a request's first ``propose`` call, ms (None where not timed): a drafter that
            catches up on the committed tokens there (a draft model's cache, an index) reads the whole prompt, and
            live that cost falls on the request's first step.
        draft1_ms: mean wall time of one ``propose`` call at one position on the same prefixes, ms, for a
            drafter whose work grows with the positions it drafts (a draft model: one pass per position, after a
            catch-up pass and a host read that do not); None where not timed.
        observe_ms: mean wall time of one ``observe`` call (a step's newly committed target features handed to a
            drafter with ``target_layers``: a block drafter's context K/V), ms; 0 for drafters that read none.
        max_new: per request, the generation budget the AR output was made with (None: each output's own length).
            An output shorter than its budget ended at a stop token; the engine still drafts as deep as the budget
            allows there, and replay does the same (:func:`replay_steps`).
        drafter_path: the block drafter's directory (block recordings), else None.
        target_layers: the drafter's :attr:`~specpilot.spec.drafter.Drafter.target_layers` (``()``: none): a system
            with it runs exact passes that also gather these layers' outputs.
    """

    prompts: list[list[int]]
    ar: list[list[int]]
    lattices: list[dict[int, Lattice | None]] = field(default_factory=list)
    depth: int = 0
    top_k: int = 0
    draft_ms: float = 0.0
    drafter_path: str | None = None
    first_ms: float | None = None
    draft1_ms: float | None = None
    observe_ms: float = 0.0
    max_new: list[int] | None = None
    target_layers: tuple[int, ...] = ()

    def subset(self, requests) -> "Recording":
        """The recording of requests ``requests`` (indices into :attr:`prompts`, in the given order) only: their
        prompts, outputs, lattices and budgets; the drafter's timings are kept (per call, not per request).

        Raises:
            ValueError: an index outside ``[0, len(prompts))``, or no index.
        """
        idx = [int(i) for i in requests]
        if not idx or any(not 0 <= i < len(self.prompts) for i in idx):
            raise ValueError(f"request indices {idx} outside the recording's {len(self.prompts)} requests")
        return replace(self, prompts=[self.prompts[i] for i in idx], ar=[self.ar[i] for i in idx],
                       lattices=[self.lattices[i] for i in idx],
                       max_new=None if self.max_new is None else [self.max_new[i] for i in idx])


def _start() -> float:
    """A timer's start once the GPU has finished what was queued before it (the untimed causal pass that gives a
    block drafter its features, an observation): otherwise the first call after it waits for that work and is timed
    with it."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def record(drafter, prompts, ar_outputs, depth: int, top_k: int, target=None,
           max_new_tokens: list[int] | None = None) -> Recording:
    """Propose a lattice at every committed length of every AR output (one drafter pass per position), timing
    each ``propose`` (:attr:`Recording.draft_ms`, :attr:`Recording.first_ms`), each ``observe`` of a drafter with
    ``target_layers`` (:attr:`Recording.observe_ms`) and, for a draft model or an EAGLE-3 drafter (one pass per
    depth), a second ``propose`` of one position on the same prefix (:attr:`Recording.draft1_ms`; its lattice is
    dropped).

    Args:
        drafter: a :class:`~specpilot.spec.drafter.Drafter` built with ``top_k`` candidates (slot 0 is used).
        prompts / ar_outputs: lists of token-id lists.
        depth / top_k: the largest depth and K any replayed policy will use.
        target: the target :class:`~specpilot.model.transformer.Transformer`; required for a drafter with
            ``target_layers`` (block drafters): the target runs once causally over prompt + AR output to
            give every prefix's features (equal, up to float rounding, to those the engine hands it).
        max_new_tokens: per request, the budget each AR output was generated with (None: its own length; see
            :attr:`Recording.max_new`).
    Raises:
        ValueError: a block drafter without ``target``; ``max_new_tokens`` of another length than the outputs, or a
            budget shorter than its output.
    """
    rec = Recording([list(p) for p in prompts], [list(a) for a in ar_outputs], depth=depth, top_k=top_k,
                    max_new=None if max_new_tokens is None else [int(n) for n in max_new_tokens])
    if rec.max_new is not None and (len(rec.max_new) != len(rec.ar)
                                    or any(n < len(a) for n, a in zip(rec.max_new, rec.ar))):
        raise ValueError(f"max_new_tokens {rec.max_new} does not match AR outputs of lengths {[len(a) for a in rec.ar]}")
    layers = rec.target_layers = tuple(drafter.target_layers)
    if layers and target is None:
        raise ValueError("recording a block drafter needs the target (its hidden states are the context)")
    sequential = drafter.kind in ("draft_model", "eagle3")  # one pass per drafted position: time one position too
    calls, t_total, firsts, t_first, t_one, observes, t_obs = 0, 0.0, 0, 0.0, 0.0, 0, 0.0
    if not layers and rec.ar and len(rec.ar[0]) > 1:  # untimed, then forgotten: a static draft model captures its
        drafter.reset(0)  # drafting loop's graph per depth on first use (a block drafter captures when built)
        for d in (depth, 1) if sequential else (depth,):
            propose_one(drafter, rec.prompts[0] + rec.ar[0][:1], d)
    for prompt, ar in zip(rec.prompts, rec.ar):
        drafter.reset(0)
        if layers:  # every prefix's features from one causal pass; observed slot by slot as the engine does
            seq = prompt + ar
            feats: list = []
            with torch.inference_mode():
                target.forward(torch.tensor(seq[:-1], device=target.device),
                               torch.arange(len(seq) - 1, device=target.device), target.new_cache(len(seq)), 0,
                               features=feats, feature_layers=layers)
            feats = torch.cat(feats, -1)
            drafter.observe(0, feats[: len(prompt)], 0)
        lats = {}
        for m in range(1, len(ar)):
            n = len(prompt) + m  # committed tokens; the context is committed[:-1]
            if layers and m > 1:  # the engine observes once per step, after its acceptance (Engine._observe)
                t0 = _start()
                drafter.observe(0, feats[n - 2 : n - 1], n - 2)
                t_obs += time.perf_counter() - t0
                observes += 1
            t0 = _start()
            lats[m] = propose_one(drafter, prompt + ar[:m], depth)
            dt = time.perf_counter() - t0
            if m == 1:
                t_first, firsts = t_first + dt, firsts + 1
            else:
                t_total, calls = t_total + dt, calls + 1
            if sequential:  # the same prefix again (the drafter rewinds to it), one position
                t0 = _start()
                propose_one(drafter, prompt + ar[:m], 1)
                t_one += time.perf_counter() - t0
        rec.lattices.append(lats)
    rec.first_ms = 1e3 * t_first / firsts if firsts else None
    rec.draft_ms = 1e3 * t_total / calls if calls else (rec.first_ms or 0.0)
    rec.draft1_ms = 1e3 * t_one / max(calls + firsts, 1) if sequential else None
    rec.observe_ms = 1e3 * t_obs / max(observes, 1) if observes else 0.0
    return rec


def replay(rec: Recording, config: SystemConfig, policy: str | None = None,
           sequoia: SequoiaBuilder | None = None) -> tuple[float, int]:
    """τ of ``config`` (tree builder, nodes, depth, top_k) on the recording: ``(tau, steps)``.

    ``policy="oracle"`` replaces the tree with the top-K oracle limited to ``min(nodes, depth)`` positions;
    ``sequoia``: the builder of ``tree="sequoia"`` (a measured profile; None: the default one).
    Mirrors the engine: after the prefill token, each step drafts ``min(depth, remaining − 1)`` positions
    (none when one token remains; ``remaining`` counts to the request's budget, :attr:`Recording.max_new`),
    accepts the matching path plus the bonus, and cuts at the request's end (its budget or its stop token).

    Raises:
        ValueError: when ``config`` asks for more depth or candidates than were recorded.
    """
    steps = replay_steps(rec, config, policy, sequoia)
    return (sum(k for k, _ in steps) / len(steps) if steps else 0.0), len(steps)


def replay_steps(rec: Recording, config: SystemConfig, policy: str | None = None,
                 sequoia: SequoiaBuilder | None = None) -> list[tuple[int, int]]:
    """:func:`replay`'s steps one by one: ``[(tokens kept, rows verified)]``, rows = 1 + the tree's nodes (1 where
    the drafter proposed nothing; the oracle's ``min(nodes, depth)`` nodes). The cost model prices each step's
    own row count (a pass's cost is not linear in rows). Raises ValueError as :func:`replay`."""
    return [(kept, rows) for kept, rows, _ in replay_trace(rec, config, policy, sequoia)]


def replay_trace(rec: Recording, config: SystemConfig, policy: str | None = None,
                 sequoia: SequoiaBuilder | None = None) -> list[tuple[int, int, int]]:
    """:func:`replay_steps` with each step's moved rows: ``[(tokens kept, rows verified, rows moved)]``. Rows moved
    is the accepted path's length (root + accepted nodes) when the path is not the tree's rows ``0 … k−1`` in
    place (the tree laid out top chain first, :meth:`~specpilot.spec.trees.Tree.chain_first`), else 0: the engine then compacts the target's cache (and gathers the rows' features for a drafter
    that reads them) so the path lies in place (``Engine._step``); a chain never moves. The oracle policy moves
    nothing (it is no tree the engine runs). Raises ValueError as :func:`replay`."""
    if config.depth > rec.depth or config.top_k > rec.top_k:
        raise ValueError(f"recorded depth {rec.depth} / top-K {rec.top_k} cannot replay {config.label()}")
    out = []
    budgets = rec.max_new if rec.max_new is not None else [len(a) for a in rec.ar]
    for ar, lats, budget in zip(rec.ar, rec.lattices, budgets):
        m = 1  # the prefill committed ar[0]
        while m < len(ar):
            remaining = budget - m  # the engine drafts toward the budget; a stop token ends ``ar`` before it
            lat = lats.get(m) if remaining > 1 else None
            n_acc, rows, in_place = 0, 1, True
            if lat is not None:
                lat = TruncatedLattice(lat, min(config.depth, remaining - 1), config.top_k)
                n_acc, rows, in_place = _walk(lat, ar[m:], config, policy, sequoia)
            kept = min(n_acc + 1, len(ar) - m)  # past the stop token the engine keeps nothing
            out.append((kept, rows, 0 if in_place else n_acc + 1))
            m += kept
    return out


def _accepted(lat: Lattice, target: list[int], config: SystemConfig, policy: str | None,
              sequoia: SequoiaBuilder | None) -> tuple[int, int]:
    """Drafted tokens accepted at one step, the longest tree path equal to ``target``'s prefix, and the rows the
    step verifies (1 + the tree's nodes)."""
    return _walk(lat, target, config, policy, sequoia)[:2]


def _walk(lat: Lattice, target: list[int], config: SystemConfig, policy: str | None,
          sequoia: SequoiaBuilder | None) -> tuple[int, int, bool]:
    """:func:`_accepted` and whether the accepted path is the tree's rows ``0 … n`` in place (True for the
    oracle)."""
    if policy == "oracle":
        path: tuple[int, ...] = ()
        limit = min(config.nodes, lat.depth)
        while len(path) < limit and len(path) < len(target):
            if target[len(path)] not in {t for t, _ in lat.children(path)}:
                break
            path += (target[len(path)],)
        return len(path), 1 + limit, True
    tree = build_tree(config.tree, lat, config.nodes, sequoia).chain_first()  # laid out as the engine verifies it
    kids, row, n = tree.child_maps(), 0, 0
    while n < len(target) and target[n] in kids[row]:
        row = kids[row][target[n]]
        n += 1
    return n, 1 + len(tree), row == n  # rows increase along a path: it ends at row n only if it is 0 … n


def profile_steps(rec: Recording, depth: int | None = None):
    """``(lattice, target tokens)`` per recorded position, for :func:`~specpilot.spec.trees.acceptance_profile`."""
    for ar, lats in zip(rec.ar, rec.lattices):
        for m, lat in lats.items():
            if lat is not None:
                yield (TruncatedLattice(lat, depth or lat.depth, rec.top_k), ar[m:])
