"""Batch runs, their paired comparison and its bound: the measuring half of the batched pilot (paper §4.4, §5.1).

A *batch run* of a system at size ``n`` on one benchmark queues that benchmark's requests all at once in a
:class:`~specpilot.engine.batch.BatchEngine` of ``n`` slots (``Deployment.batch_system(cfg, max_num_seqs=n)``) and
runs the queue to its end (``generate_all``). Every prompt is a fresh salted variant (``SALT_TOKENS`` random ids
prefixed, as the single-request controller does, :mod:`specpilot.pilot.paired`); the benchmark's prompts are
cycled until there are at least ``n`` of them, each copy with its own salt, so no two rows of a batch share a
prompt. Its throughput is generated tokens / wall seconds of the timed region: the ``generate_all`` call, every
token read to the host and the device synced, with the clock, the sync and the thread listing bound when this
module is imported. A simulated drafter's untimed preparation (``calibrated``) runs before the clock starts.

**Order.** Per size, each system is built once (untimed, its CUDA graphs captured) and warmed by one untimed batch run; then per round and
benchmark (benchmarks shuffled) two fresh variant sets run in a palindrome: A B on the first, B A on the second
(A B B A; with three systems A S X, X S A), so slow drift cancels within every (benchmark, size, round) cell. A
system's throughput in a cell is the higher of its two runs (interference only lowers throughput). Per size,
each system re-runs one random variant set untimed: different tokens mark it nondeterministic.

**Gain.** A cell's ratio is B's throughput over A's. The gain is the geometric mean over benchmarks AND sizes
(§5.1) of the geometric mean over rounds; its one-sided 95% lower bound is the paired bootstrap of
:func:`specpilot.pilot.bootstrap.gain_and_bound` with each (benchmark, size) as its own stratum and the rounds as
the paired samples resampled within it (so at least two rounds are needed for a bound).
"""

from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from specpilot.pilot.bootstrap import gain_and_bound
from specpilot.pilot.paired import Req, _device_sync, _salter, new_threads
from specpilot.spec.calibrated import CalibratedDrafter

Cell = tuple  # (benchmark, size, round)
BatchFactory = Callable[[int], object]  # size n -> a BatchEngine of n slots


def variant_set(reqs: Sequence[Req], n: int, salted: Callable) -> list[tuple[int, ...]]:
    """The prompts of one batch run: ``reqs`` cycled to ``max(n, len(reqs))`` prompts, each freshly salted."""
    if not reqs or n < 1:
        raise ValueError("a batch run needs at least one request and a size of at least 1")
    return [salted(reqs[i % len(reqs)].prompt_ids) for i in range(max(n, len(reqs)))]


def prepare_batch_untimed(engine, prompts, max_new: int) -> None:
    """A simulated drafter's untimed setup before a timed batch run: a ``calibrated`` drafter learns each prompt's
    greedy continuation; nothing for a real drafter. Callers start their clock after it."""
    for d in engine.drafters:  # a BatchEngine's distinct drafters (a load plan may hold several)
        if isinstance(d, CalibratedDrafter):
            d.prepare_all([list(p) for p in prompts], max_new)


def timed_batch(engine, prompts, max_new: int, _clock=time.perf_counter, _sync=_device_sync,
                _enum=threading.enumerate) -> tuple[tuple[tuple[int, ...], ...], float, set[str]]:
    """One batch run: every prompt queued at once, run to the end. Returns (tokens per prompt, wall seconds of the
    timed region, names of Python threads it left running, less :func:`~specpilot.pilot.paired.library_threads`)."""
    prepare_batch_untimed(engine, prompts, max_new)
    before = set(_enum())
    t0 = _clock()
    gens = engine.generate_all([list(p) for p in prompts], max_new)
    tokens = tuple(tuple(int(t) for t in g.tokens) for g in gens)
    _sync()
    dt = _clock() - t0
    return tokens, dt, new_threads(before, _enum)


@dataclass
class BatchMeasured:
    """What :func:`measure_batches` measured. Keys of ``tps`` / ``outputs``: ``(benchmark, size, round)``.

    Attributes:
        tps: name -> cell -> tokens/s (the higher of the cell's two runs).
        outputs: name -> cell -> (tokens of variant set 1, tokens of variant set 2), tokens per prompt.
        prompts: cell -> (variant set 1, variant set 2), the salted prompts both systems ran.
        outside: name -> names of threads left running. nondeterministic: name -> a re-run gave other tokens.
    """

    tps: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    prompts: dict = field(default_factory=dict)
    outside: dict = field(default_factory=dict)
    nondeterministic: dict = field(default_factory=dict)

    def tokens_per_s(self, name: str, size: int) -> float:
        """``name``'s throughput at ``size`` (tokens/s): geometric mean over benchmarks of the geometric mean over
        rounds, so the ratio of two systems' figures is their gain at that size."""
        by_bench: dict = {}
        for (b, n, _), t in self.tps[name].items():
            if n == size:
                by_bench.setdefault(b, []).append(math.log(t))
        return math.exp(sum(sum(v) / len(v) for v in by_bench.values()) / len(by_bench))

    def samples(self, name: str) -> list[tuple[tuple[int, ...], tuple[int, ...], str]]:
        """``(prompt_ids, output_ids, benchmark)`` of every prompt ``name`` ran timed: token forcing's input
        (:func:`specpilot.pilot.forcing.audit`)."""
        return [(p, o, cell[0]) for cell, sets in sorted(self.prompts.items())
                for ps, os_ in zip(sets, self.outputs[name][cell]) for p, o in zip(ps, os_)]

    def differing(self, a: str, b: str) -> list[tuple[tuple[int, ...], tuple[int, ...], str]]:
        """``(prompt_ids, output_ids, benchmark)`` of every variant on which ``b``'s output differs from ``a``'s (the
        same prompt, ``b``'s tokens): what the float32 rounding-tie check audits."""
        return [(p, ob, cell[0]) for cell, sets in sorted(self.prompts.items())
                for ps, oa, obs in zip(sets, self.outputs[a][cell], self.outputs[b][cell])
                for p, x, ob in zip(ps, oa, obs) if x != ob]

    def equal_outputs(self, a: str, b: str) -> bool:
        """Whether ``b``'s tokens equal ``a``'s on every variant of every cell."""
        return all(self.outputs[a][c] == self.outputs[b][c] for c in self.outputs[a])

    def at(self, size: int) -> "BatchMeasured":
        """The cells of batch size ``size`` only (thread and determinism flags as measured, over every size)."""
        keep = lambda d: {c: v for c, v in d.items() if c[1] == size}  # noqa: E731
        return BatchMeasured({k: keep(v) for k, v in self.tps.items()}, {k: keep(v) for k, v in self.outputs.items()},
                             keep(self.prompts), dict(self.outside), dict(self.nondeterministic))

    @staticmethod
    def merged(parts: Sequence["BatchMeasured"]) -> "BatchMeasured":
        """One measurement from several over disjoint cells (e.g. one per batch size) of the same system names:
        cells united, threads left running united, nondeterminism if any part saw it.

        Raises:
            ValueError: no parts, parts of different names, or a cell measured twice.
        """
        if not parts or any(set(p.tps) != set(parts[0].tps) for p in parts):
            raise ValueError("merge measurements of the same systems")
        names = list(parts[0].tps)
        m = BatchMeasured({k: {} for k in names}, {k: {} for k in names}, {}, {k: () for k in names},
                          {k: False for k in names})
        for p in parts:
            if set(p.prompts) & set(m.prompts):
                raise ValueError("a (benchmark, size, round) cell is measured twice")
            m.prompts.update(p.prompts)
            for k in names:
                m.tps[k].update(p.tps[k])
                m.outputs[k].update(p.outputs[k])
                m.outside[k] = tuple(sorted({*m.outside[k], *p.outside[k]}))
                m.nondeterministic[k] |= p.nondeterministic[k]
        return m

    def aliased(self, name: str, source: str) -> "BatchMeasured":
        """A copy where system ``name``'s cells, outputs and flags are ``source``'s (a size that seals AR after all
        reports AR's own runs as its sealed system's). Raises KeyError: either name not measured."""
        pick = lambda d: {**d, name: d[source]}  # noqa: E731
        return BatchMeasured(pick(self.tps), pick(self.outputs), dict(self.prompts), pick(self.outside),
                             pick(self.nondeterministic))


def measure_batches(makers: dict[str, BatchFactory], groups: dict[str, list[Req]], sizes: Sequence[int],
                    rounds: int, vocab_size: int, *, avoid_ids=(), rng=None,
                    progress: Callable[[], None] | None = None) -> BatchMeasured:
    """Batch runs of every system in ``makers`` at every size, benchmark and round (module doc).

    Args:
        makers: name -> factory of size n -> batched engine (built untimed, once per size).
        groups: benchmark -> its requests (prompt ids and ``max_new_tokens``).
        sizes: batch sizes (slots). rounds: rounds of A B B A per (benchmark, size).
        vocab_size / avoid_ids: salt ids are drawn from ``[0, vocab_size)`` less ``avoid_ids``.
        rng: source of salts, order and recheck picks; default OS entropy (a seeded Random only in tests).
        progress: called after every timed run.
    Raises:
        ValueError: no systems, benchmarks, sizes or rounds; a run that produced no tokens.
    """
    if not makers or not groups or not sizes or rounds < 1:
        raise ValueError("batch runs need systems, benchmarks, sizes and rounds >= 1")
    rng = rng if rng is not None else random.SystemRandom()
    salted = _salter(vocab_size, avoid_ids, rng)
    names = list(makers)
    m = BatchMeasured({k: {} for k in names}, {k: {} for k in names}, {}, {k: set() for k in names},
                      {k: False for k in names})
    for n in sizes:
        engines = {}
        for k in names:  # build and warm untimed
            before = set(threading.enumerate())
            engines[k] = makers[k](n)
            engines[k].capture_graphs()  # every (requests, rows) bucket's CUDA graph now, not in a timed run
            engines[k].compile_shapes()  # and a compiled CPU stack's graphs (compile_cpu)
            m.outside[k] |= new_threads(before)
            reqs = groups[rng.choice(list(groups))]
            m.outside[k] |= timed_batch(engines[k], variant_set(reqs, n, salted), reqs[0].max_new_tokens)[2]
        for r in range(rounds):
            benches = list(groups)
            rng.shuffle(benches)
            for b in benches:
                cell, max_new = (b, n, r), groups[b][0].max_new_tokens
                sets = (variant_set(groups[b], n, salted), variant_set(groups[b], n, salted))
                m.prompts[cell] = sets
                runs = {k: [None, None] for k in names}
                for v, order in ((0, names), (1, names[::-1])):
                    for k in order:
                        toks, dt, left = timed_batch(engines[k], sets[v], max_new)
                        runs[k][v] = (toks, dt)
                        m.outside[k] |= left
                        if progress is not None:
                            progress()
                for k in names:
                    made = [sum(len(t) for t in toks) for toks, _ in runs[k]]
                    if min(made) == 0 or min(dt for _, dt in runs[k]) <= 0:
                        raise ValueError(f"{k} produced no tokens or took no time on {b} at size {n}")
                    m.tps[k][cell] = max(c / dt for c, (_, dt) in zip(made, runs[k]))
                    m.outputs[k][cell] = (runs[k][0][0], runs[k][1][0])
        for k in names:  # determinism: one random variant set again, untimed
            cell = rng.choice([c for c in m.prompts if c[1] == n])
            v = rng.randrange(2)
            toks, _, left = timed_batch(engines[k], m.prompts[cell][v], groups[cell[0]][0].max_new_tokens)
            m.nondeterministic[k] |= toks != m.outputs[k][cell][v]
            m.outside[k] |= left
        engines.clear()
    m.outside = {k: tuple(sorted(v)) for k, v in m.outside.items()}
    return m


def cell_gain(tps_a: dict, tps_b: dict, sizes: Sequence[int] | None = None) -> tuple[float, float, str]:
    """Gain of B over A over the cells ``(benchmark, size, round)`` (of ``sizes`` only, when given): the geometric
    mean over (benchmark, size) of the geometric mean over rounds of B/A, its one-sided 95% lower bound (paired
    bootstrap, each (benchmark, size) a stratum, rounds resampled within it) and the bootstrap's method.

    Returns:
        ``(gain, lower_bound, method)``; the bound is NaN (method ``none``) without a stratum of two rounds.
    Raises:
        ValueError: A and B measured on different cells, no cell, or a throughput <= 0.
    """
    if set(tps_a) != set(tps_b):
        raise ValueError("A and B must be measured on the same (benchmark, size, round) cells")
    cells = sorted(c for c in tps_a if sizes is None or c[1] in sizes)
    if not cells:
        raise ValueError("no (benchmark, size, round) cell to compare")
    strata = [f"{b}@{n}" for b, n, _ in cells]
    _, gain, low, method = gain_and_bound(strata, [tps_a[c] for c in cells], [tps_b[c] for c in cells])
    return gain, low, method


@dataclass(frozen=True)
class BatchPaired:
    """A vs B over the cells of one :func:`measure_batches`: the fields :func:`specpilot.pilot.controller.approve`
    and :func:`~specpilot.pilot.controller.noise_from_aa` read (gain, lower_bound, outputs_differ, outside_a / b,
    nondeterministic_a / b), the bootstrap's ``ci_method`` and ``per_size``: size -> {gain, lower_bound, method}."""

    gain: float
    lower_bound: float
    ci_method: str
    per_size: dict
    outputs_differ: bool
    outside_a: tuple
    outside_b: tuple
    nondeterministic_a: bool
    nondeterministic_b: bool

    def to_dict(self) -> dict:
        """JSON-ready figures (ratios; NaN bounds as None)."""
        nan = lambda x: None if not math.isfinite(x) else x  # noqa: E731
        return {"gain": self.gain, "lower_bound": nan(self.lower_bound), "ci_method": self.ci_method,
                "per_size": {str(n): {**v, "lower_bound": nan(v["lower_bound"])} for n, v in self.per_size.items()},
                "outputs_differ": self.outputs_differ, "threads_left_running": [*self.outside_a, *self.outside_b],
                "nondeterministic": self.nondeterministic_a or self.nondeterministic_b}


def compare(m: BatchMeasured, a: str, b: str) -> BatchPaired:
    """B against A over every cell of ``m`` and per size (:func:`cell_gain`)."""
    gain, low, method = cell_gain(m.tps[a], m.tps[b])
    sizes = sorted({c[1] for c in m.tps[a]})
    per = {}
    for n in sizes:
        g, lo, me = cell_gain(m.tps[a], m.tps[b], [n])
        per[n] = {"gain": g, "lower_bound": lo, "method": me}
    return BatchPaired(gain, low, method, per, not m.equal_outputs(a, b), m.outside[a], m.outside[b],
                       m.nondeterministic[a], m.nondeterministic[b])
