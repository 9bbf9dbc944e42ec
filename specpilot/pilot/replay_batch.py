"""Exact replay of the batched engine (§2.4, §4.4): tokens accepted per step for a row-selection rule, with no
target pass.

Greedy decoding is deterministic and a request's output does not depend on what shares its batch, so a
:class:`~specpilot.pilot.replay.Recording` (each request's lattice at every committed length of its AR output)
is all a batched run needs: :func:`replay_batch` steps the requests through the same queue as
:class:`~specpilot.engine.batch.BatchEngine` (``max_num_seqs`` slots, admission up to ``max_prefill_rows`` prompt
rows, the prefill commits the first token, then one step over every running request in admission order; under
``prompt_admission`` prompts that fit ride in the step's pass and decode from the next step), builds
the step's trees by the config's row selection (each request's own ``nodes``-node tree, or the shared budget of
:func:`~specpilot.spec.trees_batch.build_shared`), and accepts along the AR output. Under ``drafter_block`` each
request's depth comes from the same per-request history as the engine's
(:class:`~specpilot.spec.drafter_block.BlockHistory`), its recorded lattice cut to that depth. Tested equal, step by
step, to the engine's own :class:`~specpilot.engine.batch.StepOutput` counts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from specpilot.config import SystemConfig
from specpilot.pilot.replay import Recording, TruncatedLattice
from specpilot.spec.drafter_block import BlockHistory
from specpilot.spec.trees import build_tree
from specpilot.spec.trees_batch import build_shared


@dataclass
class BatchStep:
    """One replayed decode step (one exact pass).

    Attributes:
        requests: request indices (into the recording) in the step, in the engine's order.
        nodes: tree nodes verified per request (the step's rows are ``sum(nodes) + len(requests)``).
        accepted: draft tokens accepted per request (bonus excluded, cut at the request's end, as
            ``StepOutput.accepted``).
        kept: tokens committed per request (accepted + bonus, cut at the request's end).
        depths: draft positions asked of the drafter per request (0: none; ``StepOutput.draft_depth``); their sum is
            the step's drafter rows for a drafter that runs one row per asked position and request.
    """

    requests: list[int]
    nodes: list[int]
    accepted: list[int]
    kept: list[int]
    depths: list[int] = field(default_factory=list)


def replay_batch(rec: Recording, config: SystemConfig, max_num_seqs: int, max_prefill_rows: int = 2048,
                 history: Callable[[], BlockHistory] = BlockHistory) -> list[BatchStep]:
    """The decode steps of a :class:`~specpilot.engine.batch.BatchEngine` with ``max_num_seqs`` slots serving every
    request of ``rec`` (all queued at once, in order; ``max_new_tokens`` = its AR output's length).

    ``history`` makes each request's drafter block state under ``config.drafter_block`` (the engine's
    :class:`~specpilot.spec.drafter_block.BlockHistory`; a subclass overriding ``pick`` measures another rule).

    Raises:
        ValueError: ``config`` asks for more depth or candidates than were recorded, or ``max_num_seqs < 1``.
    """
    if config.depth > rec.depth or config.top_k > rec.top_k:
        raise ValueError(f"recorded depth {rec.depth} / top-K {rec.top_k} cannot replay {config.label()}")
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    waiting = deque(range(len(rec.ar)))
    m: dict[int, int] = {}  # running request -> tokens committed after the prompt, in admission order
    hist: dict[int, BlockHistory] = {}  # running request -> its drafter block history (§4.4)
    steps: list[BatchStep] = []
    while waiting or m:
        rows = admitted = 0  # admission: while a slot is free and the prompt rows fit (one prompt always)
        free = max_num_seqs - len(m)  # a one-token request holds its slot until its prefill ends
        before = list(m)
        while waiting and admitted < free:
            n = len(rec.prompts[waiting[0]])
            if admitted and rows + n > max_prefill_rows:
                break
            i = waiting.popleft()
            rows, admitted = rows + n, admitted + 1
            if len(rec.ar[i]) > 1:  # the prefill commits ar[0]; a one-token request ends there
                m[i], hist[i] = 1, history()
        if not m:
            continue
        ride = bool(admitted and before and rows <= config.prompt_admission)  # prompt admission: no decode yet
        running = before if ride else list(m)
        lats, depths = [], []
        for i in running:
            remaining = len(rec.ar[i]) - m[i]
            want = hist[i].pick(config.drafter_block) if config.drafter_block else config.depth
            depth = max(0, min(want, remaining - 1)) if config.drafter != "none" else 0
            lat = rec.lattices[i].get(m[i]) if depth >= 1 else None
            lats.append(TruncatedLattice(lat, depth, config.top_k) if lat is not None else None)
            depths.append(depth)
            if config.drafter_block and depth >= 1:
                hist[i].drafted(lats[-1], depth)
        if config.row_selection == "shared_budget":
            trees = build_shared(lats, config.step_budget(len(running)))
        else:
            trees = [build_tree(config.tree, lat, config.nodes) if lat is not None else None for lat in lats]
        step = BatchStep(running, [], [], [], depths)
        for i, tree, depth in zip(running, trees, depths):
            target = rec.ar[i][m[i]:]
            n_acc = 0
            if tree is not None:
                kids, row = tree.child_maps(), 0
                while n_acc < len(target) and target[n_acc] in kids[row]:
                    row = kids[row][target[n_acc]]
                    n_acc += 1
            kept = min(n_acc + 1, len(target))
            if config.drafter_block and depth >= 1:  # the engine's count: a step cut at the end is the last anyway
                hist[i].accepted(n_acc)
            step.nodes.append(len(tree) if tree is not None else 0)
            step.accepted.append(min(n_acc, kept))
            step.kept.append(kept)
            m[i] += kept
            if m[i] >= len(rec.ar[i]):
                del m[i], hist[i]
        steps.append(step)
    return steps


def batch_summary(steps: list[BatchStep]) -> dict:
    """Totals of a replayed run: ``steps``, ``accepted_per_step`` (draft tokens accepted per exact pass, all
    requests), ``tokens_per_step`` (tokens committed per exact pass), ``nodes_per_step`` (tree nodes verified per
    exact pass), ``tau`` (tokens committed per request-step), ``draft_rows_per_step`` (draft positions asked of the
    drafter per exact pass, all requests: :attr:`BatchStep.depths` summed), ``max_draft_rows`` (the most in one
    step)."""
    n = max(len(steps), 1)
    req_steps = max(sum(len(s.requests) for s in steps), 1)
    return {"steps": len(steps), "accepted_per_step": sum(sum(s.accepted) for s in steps) / n,
            "tokens_per_step": sum(sum(s.kept) for s in steps) / n,
            "nodes_per_step": sum(sum(s.nodes) for s in steps) / n,
            "tau": sum(sum(s.kept) for s in steps) / req_steps,
            "draft_rows_per_step": sum(sum(s.depths) for s in steps) / n,
            "max_draft_rows": max((sum(s.depths) for s in steps), default=0)}
