"""Request and result types shared by the engines, the server and the pilot."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Generation:
    """Output and statistics of one request.

    Attributes:
        tokens: generated token ids (the prompt excluded; a stop token that ended it included).
        steps: exact passes after the prefill (one per speculative step / AR decode step).
        accepted: tokens committed by each of those passes (len == steps; bonus included).
        rows: rows verified by each of those passes (root + tree nodes).
        stop_reason: ``eos`` | ``stop`` | ``length``.
        time_s: wall time of the whole request (prefill included), seconds.
        prefill_s: wall time of the prefill pass, seconds.
        cache_length: valid cache slots when the request ended (= prompt + kept tokens − 1, R2).
        chains: with TLV (§4.3), the length of each cycle's commit chain C (0 where draft ① proposed nothing);
            empty without TLV.
    The prefill pass commits the first token; tau counts only the ``steps`` after it.
    """

    tokens: list[int]
    steps: int
    accepted: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    stop_reason: str = "length"
    time_s: float = 0.0
    prefill_s: float = 0.0
    cache_length: int = 0
    chains: list[int] = field(default_factory=list)  # last: positional construction predates it

    @property
    def tau(self) -> float:
        """τ: mean tokens committed per exact pass after the prefill (1.0 for AR)."""
        return sum(self.accepted) / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second of wall time (prefill included)."""
        return len(self.tokens) / self.time_s if self.time_s > 0 else 0.0


@dataclass
class Request:
    """One request to the batched engine.

    Attributes:
        request_id: unique among the engine's unfinished requests.
        prompt_ids: the prompt's token ids (non-empty).
        max_new_tokens: most tokens to generate (≥ 1).
        stop_ids: extra ids that end it (kept in the output, like EOS, which is the engine's own).
    """

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()


@dataclass
class StepOutput:
    """What one step did for one request.

    Attributes:
        request_id: the request.
        new_tokens: tokens committed this step, already cut at a stop id (which they include, as EOS is kept in
            a :class:`~specpilot.engine.types.Generation`) or at ``max_new_tokens``.
        finished: the request ended this step (its slot is free again).
        finish_reason: ``stop`` (EOS or a stop id), ``length``, or None while it runs.
        drafted: draft tokens verified for it this step (its tree's nodes); accepted: of those, accepted (bonus
            excluded); accepted_by_pos: 1 per accepted draft position 0 .. accepted − 1.
        draft_depth: draft positions asked of the drafter for it this step (0: none asked; under
            ``drafter_block`` the depth its rule picked, cut at the request's remaining tokens).
    """

    request_id: str
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None
    drafted: int = 0
    accepted: int = 0
    accepted_by_pos: list[int] = field(default_factory=list)
    draft_depth: int = 0


def run_to_end(engine, prompts: list[list[int]], max_new_tokens: int | list[int],
               stop_ids: list[int] | None = None) -> list[Generation]:
    """:meth:`~specpilot.engine.batch.BatchEngine.generate_all`: ``prompts`` queued at once in a batched ``engine``
    and stepped to the end; one :class:`Generation` per prompt, in order. Raises PromptError for a bad request
    (none is queued then)."""
    from specpilot.engine.requests import check_prompt

    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    stops = frozenset(stop_ids or ())
    reqs = [Request(f"g{i}", list(p), n, stops) for i, (p, n) in enumerate(zip(prompts, budgets))]
    for q in reqs:
        check_prompt(q.prompt_ids, q.max_new_tokens, engine.target.args.vocab_size, engine.max_len)
    gens = {q.request_id: Generation(tokens=[], steps=-1) for q in reqs}
    t0 = time.perf_counter()
    for q in reqs:
        engine.add_request(q)
    while engine.has_work():
        for o in engine.step():
            g = gens[o.request_id]
            g.tokens += o.new_tokens
            if g.steps >= 0:
                g.accepted.append(len(o.new_tokens))
                g.rows.append(o.drafted + 1)
            g.steps += 1
            if o.finished:
                g.stop_reason = "length" if o.finish_reason == "length" else (
                    "eos" if g.tokens and g.tokens[-1] in engine.eos_ids else "stop")
    for g in gens.values():
        g.time_s = time.perf_counter() - t0
    return [gens[q.request_id] for q in reqs]
