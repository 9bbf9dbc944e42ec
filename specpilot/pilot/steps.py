"""One source of truth for T_AR and T_step (paper §3.2): decode-step times from interleaved runs.

c(N) = T_step(N) / T_AR means something only when both step times were measured under the same
conditions: on a shared machine a T_AR taken minutes apart from T_step can be off several-fold (a fresh
user's report read c = 0.122 because of that). So every c the pilot uses or reports is the ratio of two
step times taken from *one* interleaved measurement of AR and the system:

- :func:`interleaved_steps` runs several engines on the same requests in a palindrome per request
  (A B B A for two systems) and keeps, per system and request, the faster run (interference only adds);
  the pilot's ``measure`` (planner input, ceiling, rounds table, screening) uses it;
- :class:`StepRecorder` wraps the controller's factories of the seal's interleaved headline run (AR,
  stock, sealed) and records each timed call's :class:`~specpilot.engine.types.Generation`, so the
  report's τ, T_AR, T_step and c come from the very runs that give its speedups.

**Definition.** A step is one exact pass after the prefill (an AR decode step or one speculative step,
drafting and acceptance included); its time is the engine's ``time_s - prefill_s`` divided by ``steps``
(ms). The per-step overhead outside the pass (Python, sampling, cache bookkeeping) is inside both T_AR
and T_step, so c(0) of AR itself is exactly 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class StepStats:
    """Decode-step figures of one system over a request set.

    Attributes:
        tau: tokens committed per exact pass (bonus included; 1.0 for AR).
        rows: mean rows verified per exact pass (1 for AR).
        step_ms: mean wall time per decode step, ms (prefill excluded), Σ decode ms / Σ steps.
        steps: decode steps counted. runs: generations counted (one per request: the faster run).
    """

    tau: float
    rows: float
    step_ms: float
    steps: int
    runs: int

    def to_dict(self) -> dict:
        """JSON-ready figures (ms, tokens per pass)."""
        return {"tau": self.tau, "rows": self.rows, "step_ms": self.step_ms, "steps": self.steps, "runs": self.runs}


def _decode_ms(g) -> float:
    return 1e3 * (g.time_s - g.prefill_s)


def fastest(gens: Sequence) -> object:
    """The run with the lowest decode ms per step among ``gens`` (Generations of one request and system).

    Raises:
        ValueError: when no run has a decode step (every output ended at the prefill).
    """
    usable = [g for g in gens if g.steps > 0]
    if not usable:
        raise ValueError("no run with a decode step (outputs of one token?): raise max_new_tokens")
    return min(usable, key=lambda g: _decode_ms(g) / g.steps)


def step_stats(gens: Sequence) -> StepStats:
    """Aggregate Generations (one per request) into :class:`StepStats`: τ = Σ accepted / Σ steps,
    rows = Σ rows / Σ steps, step_ms = Σ (time_s − prefill_s) / Σ steps (ms); runs without a decode step
    are skipped.

    Raises:
        ValueError: when no generation has a decode step.
    """
    gens = [g for g in gens if g.steps > 0]
    steps = sum(g.steps for g in gens)
    if steps == 0:
        raise ValueError("no decode step to time (outputs of one token?): raise max_new_tokens")
    return StepStats(tau=sum(sum(g.accepted) for g in gens) / steps, rows=sum(sum(g.rows) for g in gens) / steps,
                     step_ms=sum(_decode_ms(g) for g in gens) / steps, steps=steps, runs=len(gens))


def c_of(system: StepStats, ar: StepStats) -> float:
    """c = T_step / T_AR of two :class:`StepStats` from the same interleaved measurement (§3.2)."""
    return system.step_ms / ar.step_ms


def prepare_untimed(system, prompt, max_new: int) -> None:
    """A simulation's untimed setup before a timed run (:meth:`~specpilot.engine.engine.Engine.prepare`: a
    ``calibrated`` drafter learns the prompt's greedy continuation); nothing for any other system. Callers start
    their clock after it."""
    from specpilot.engine.engine import Engine

    while isinstance(system, _Recorded):
        system = system._system
    if isinstance(system, Engine):
        system.prepare(list(prompt), max_new)


def interleaved_steps(engines: dict[str, object], requests: Sequence, repeats: int = 2) -> dict[str, StepStats]:
    """Run ``engines`` (name -> object with ``generate(prompt_ids, max_new_tokens) -> Generation``) on the
    same ``requests`` (objects with ``prompt_ids`` and ``max_new_tokens``), in a palindrome per request
    (A B ... then ... B A, ``repeats`` runs each), and aggregate each system's faster run per request.

    Unsalted and untimed by the controller: this measures step times for the cost model, it judges
    nothing (the controller does that, §3.3).

    Returns:
        ``{name: StepStats}``.
    Raises:
        ValueError: no engines / requests, ``repeats < 1``, or a system without decode steps.
    """
    names = list(engines)
    if not names or not requests or repeats < 1:
        raise ValueError("interleaved_steps needs engines, requests and repeats >= 1")
    picked: dict[str, list] = {n: [] for n in names}
    for req in requests:
        runs: dict[str, list] = {n: [] for n in names}
        for r in range(repeats):
            for n in (names if r % 2 == 0 else names[::-1]):
                prepare_untimed(engines[n], req.prompt_ids, req.max_new_tokens)  # a simulation's; the engine times
                runs[n].append(engines[n].generate(list(req.prompt_ids), req.max_new_tokens))
        for n in names:
            if any(g.steps > 0 for g in runs[n]):  # a request that ended at its first token has no step to time
                picked[n].append(fastest(runs[n]))
    return {n: step_stats(picked[n]) for n in names}


class _Recorded:
    """A system whose ``generate`` calls are logged into a :class:`StepRecorder`; everything else forwards."""

    def __init__(self, system, name: str, log: list):
        self._system, self._name, self._log = system, name, log

    def generate(self, prompt_ids, max_new_tokens, *args, **kw):
        g = self._system.generate(prompt_ids, max_new_tokens, *args, **kw)
        self._log.append([self._name, tuple(int(t) for t in prompt_ids), g, False])
        return g

    def __getattr__(self, item):
        return getattr(self._system, item)


class StepRecorder:
    """Records the Generations of the systems of one controller run, to read step times from the very runs
    that give the headline (§3.2, §5.1).

    Wrap each factory with :meth:`wrap` and pass :meth:`progress` as the controller's ``progress``
    callback: the controller calls it right after every *timed* run, so the last logged call is marked
    timed; warm-up and determinism re-runs stay unmarked and are ignored.
    """

    def __init__(self):
        self.log: list[list] = []  # [name, prompt ids, Generation, timed]

    def wrap(self, name: str, make: Callable[[], object]) -> Callable[[], object]:
        """A factory building ``make()`` wrapped so its ``generate`` calls are logged under ``name``."""
        return lambda: _Recorded(make(), name, self.log)

    def progress(self, inner: Callable[[], None] | None = None) -> Callable[[], None]:
        """The controller's progress callback: marks the last logged call timed, then calls ``inner``."""

        def mark():
            if self.log:
                self.log[-1][3] = True
            if inner is not None:
                inner()

        return mark

    def stats(self, name: str, prompts: Sequence[Sequence[Sequence[int]]]) -> StepStats:
        """:class:`StepStats` of ``name`` over its timed runs, the faster run per request.

        Args:
            prompts: ``[request][variant]`` salted prompts of the run (``InterleavedRun.prompts``), to
                group the timed runs by request.
        Requests whose runs all ended at their first token (a real model's EOS) have no step and are skipped.

        Raises:
            ValueError: no timed run of ``name``, or none with a decode step.
        """
        where = {tuple(p): i for i, ps in enumerate(prompts) for p in ps}
        by_req: dict[int, list] = {}
        for n, p, g, timed in self.log:
            if n == name and timed:
                by_req.setdefault(where.get(p, -1), []).append(g)
        if not by_req:
            raise ValueError(f"no timed run of {name!r} was recorded (progress callback not passed?)")
        return step_stats([fastest(gs) for gs in by_req.values() if any(g.steps > 0 for g in gs)])
