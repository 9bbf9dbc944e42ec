"""Paired and interleaved runs: how the controller builds, times and compares systems (paper §3.3).

The guarantees these runs give (fresh salted variants, the timed region, the import-time clock, the
output comparison, the determinism recheck) and their limits are stated in :mod:`specpilot.pilot.controller`,
the only caller that decides anything from them.

A request's throughput for a system is the highest over its runs (one per variant): interference from
other processes only ever lowers throughput, so the maximum is the estimator least disturbed by it.

**Executors.** Where systems are built and timed is the executor's choice; the salts, the order, the
comparison of outputs, the bootstrap, token forcing and the approval rule stay in this process either way.
:class:`LocalExecutor` (default) builds every system in this process from its factory.
:class:`specpilot.pilot.workers.WorkerExecutor` runs each system in its own worker process
(:mod:`specpilot.pilot.worker_main`, started from the stock tree by file path, with the clock, the device
sync and the thread listing bound before the candidate's source tree is importable): on one device A and
B run one at a time A B B A; on two devices A on device 0 and B on device 1 concurrently on a request's
first variant, swapped (A on 1, B on 0) on its second, so a device difference enters both systems'
best-of-two throughput alike. Systems of the same source tree (config candidates: stock code) share one
worker per device, so a process-to-process difference cancels the same way (an A vs A of two stock
workers on one CPU measured a 1.19x "gain" in CI); a code candidate's tree always gets its own worker. The
recheck and the thread listing run in the worker on the system that ran the variant and are reported back.
"""

from __future__ import annotations

import math
import random
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from specpilot.pilot.bootstrap import gain_and_bound
from specpilot.pilot.steps import prepare_untimed

SALT_TOKENS = 4  # random token ids prefixed to every timed prompt

Factory = Callable[[], object]


@dataclass(frozen=True)
class Req:
    """One request of a paired run.

    Attributes:
        benchmark: name of the benchmark the prompt comes from (gain is averaged per benchmark).
        index: index of the request within its benchmark.
        prompt_ids: prompt token ids (the controller prefixes a fresh salt for every timed run).
        max_new_tokens: generation budget (tokens).
    """

    benchmark: str
    index: int
    prompt_ids: tuple[int, ...]
    max_new_tokens: int


def _device_sync() -> None:
    """Wait for queued CUDA work when CUDA is in use (no-op on the CPU)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def library_threads(enum=threading.enumerate) -> set:
    """Threads running now that a library owns and that do no work of a system: tqdm's idle monitor (torch.compile's
    progress bar opens one per compile and it outlives the compile) and the threads of Inductor's compile pool
    (started by the first compile of a CPU stack with parallel compile threads, then kept idle for the process).
    The pool's threads are matched by identity, not by their generic ``ThreadPoolExecutor-N_M`` names, so a
    system's own executor is still seen."""
    owned = {t for t in enum() if t.name == "tqdm_monitor"}
    inductor = sys.modules.get("torch._inductor.async_compile")
    if inductor is not None and inductor.AsyncCompile.pool.cache_info().currsize:  # only if Inductor made it
        owned |= set(inductor.AsyncCompile.pool()._threads)  # CPython's ThreadPoolExecutor keeps them here
    return owned


def new_threads(before: set, enum=threading.enumerate) -> set[str]:
    """Names of threads running now that were not in ``before``, less :func:`library_threads`: work a system left
    running outside the timed region."""
    return {t.name for t in set(enum()) - before - library_threads(enum)}


def _build(make: Factory, _enum=threading.enumerate) -> tuple[object, set[str]]:
    """``make()`` untimed; returns (system, names of threads it started that are still running)."""
    before = set(_enum())
    system = make()
    return system, new_threads(before, _enum)


def _timed(system, prompt: tuple[int, ...], max_new: int, _clock=time.perf_counter, _sync=_device_sync,
           _enum=threading.enumerate) -> tuple[tuple[int, ...], float, set[str]]:
    """Time ``system.generate`` with the import-time clock, tokens read to the host and the device synced
    inside the timed region (a simulation's untimed setup before it, :func:`~specpilot.pilot.steps.prepare_untimed`); returns (tokens, seconds, names of threads
    it left running)."""
    prepare_untimed(system, prompt, max_new)
    before = set(_enum())
    t0 = _clock()
    gen = system.generate(list(prompt), max_new)
    tokens = tuple(int(t) for t in gen.tokens)
    _sync()
    dt = _clock() - t0
    return tokens, dt, new_threads(before, _enum)


def _salter(vocab_size: int, avoid_ids, rng) -> Callable[[Sequence[int]], tuple[int, ...]]:
    """A function prefixing ``SALT_TOKENS`` fresh random ids (in ``[0, vocab_size)``, not in ``avoid_ids``)."""
    allowed = vocab_size - len({int(t) for t in avoid_ids if 0 <= int(t) < vocab_size})
    if vocab_size < 1 or allowed < 2:
        raise ValueError(f"need at least two salt token ids, got vocab_size {vocab_size} and {len(avoid_ids)} avoided")
    avoid = frozenset(int(t) for t in avoid_ids)

    def salted(prompt: Sequence[int]) -> tuple[int, ...]:
        salt: list[int] = []
        while len(salt) < SALT_TOKENS:
            t = rng.randrange(vocab_size)
            if t not in avoid:
                salt.append(t)
        return tuple(salt) + tuple(int(t) for t in prompt)

    return salted


@dataclass(frozen=True)
class _Measured:
    prompts: tuple  # [request][variant] salted prompt
    tokens: dict  # name -> [request][variant] tokens
    tps: dict  # name -> per-request throughput (tokens/s)
    outside: dict  # name -> sorted thread names left running
    nondeterministic: dict  # name -> bool


class LocalExecutor:
    """The in-process executor (default): systems built from factories in this process, run one at a
    time, A B B A per variant pair (§3.3). ``open(makers)`` takes ``{name: factory}``.

    An executor's session has ``schedule(parity)`` (the runs of one variant: a list of groups run one
    after another; a group is ``[(name, key)]`` run concurrently, ``key`` naming the physical system),
    ``build() -> {key: thread names left running}`` (untimed), ``run(group, prompt, max_new) -> [(tokens,
    seconds, thread names left running)]`` timed with the executor's bound clock, and ``close()``.
    The worker executor is :class:`specpilot.pilot.workers.WorkerExecutor`.
    """

    def open(self, makers: dict[str, Factory]) -> "_LocalSession":
        """A session over ``makers`` (``{name: factory}``)."""
        return _LocalSession(dict(makers))


class _LocalSession:
    def __init__(self, makers: dict[str, Factory]):
        self.makers, self.systems = makers, {}

    def schedule(self, parity: int) -> list[list[tuple[str, str]]]:
        names = list(self.makers)
        return [[(n, n)] for n in (names if parity == 0 else names[::-1])]

    def build(self) -> dict[str, set[str]]:
        left = {}
        for n, make in self.makers.items():
            self.systems[n], left[n] = _build(make)
        return left

    def run(self, group, prompt, max_new):
        return [_timed(self.systems[k], prompt, max_new) for _, k in group]

    def close(self) -> None:
        self.systems.clear()


def _run_systems(makers: dict, requests: Sequence[Req], vocab_size: int, avoid_ids, repeats: int,
                 rng, recheck: int, progress, executor=None) -> _Measured:
    """Build, warm, time (palindromic order per variant pair, or the executor's swapped device placement)
    and recheck every system; see the module doc."""
    if not makers or not requests or repeats < 1:
        raise ValueError("the controller needs systems, at least one request and repeats >= 1")
    rng = rng if rng is not None else random.SystemRandom()
    salted = _salter(vocab_size, avoid_ids, rng)
    names = list(makers)
    session = (executor or LocalExecutor()).open(makers)
    try:
        return _measure(session, names, requests, repeats, rng, salted, recheck, progress)
    finally:
        session.close()


def _measure(session, names, requests, repeats, rng, salted, recheck, progress) -> _Measured:
    outside = {n: set() for n in names}
    owner = {}  # key -> name
    for parity in (0, 1):
        for group in session.schedule(parity):
            owner.update({k: n for n, k in group})
    for k, left in session.build().items():
        outside[owner[k]] |= set(left)
    for k, n in owner.items():  # warm-up (allocators, lazy init, graph capture): untimed, on a fresh variant
        req = requests[rng.randrange(len(requests))]
        outside[n] |= set(session.run([(n, k)], salted(req.prompt_ids), req.max_new_tokens)[0][2])
    order = list(range(len(requests)))
    rng.shuffle(order)
    prompts = [[] for _ in requests]
    toks = {n: [[] for _ in requests] for n in names}
    secs = {n: [[] for _ in requests] for n in names}
    keys = {n: [[] for _ in requests] for n in names}  # which physical system ran each variant
    for i in order:
        req = requests[i]
        for _ in range(repeats):
            for parity in (0, 1):
                p = salted(req.prompt_ids)
                prompts[i].append(p)
                for group in session.schedule(parity):
                    for (n, k), (t, dt, left) in zip(group, session.run(group, p, req.max_new_tokens)):
                        toks[n][i].append(t)
                        secs[n][i].append(dt)
                        keys[n][i].append(k)
                        outside[n] |= set(left)
                        if progress is not None:
                            progress()
    tps = {n: [] for n in names}
    for n in names:
        for i, req in enumerate(requests):
            rates = [len(t) / s for t, s in zip(toks[n][i], secs[n][i]) if t and s > 0]
            if len(rates) != len(toks[n][i]):
                raise ValueError(f"request {req.benchmark}#{req.index}: {n} produced no tokens or took no time")
            tps[n].append(max(rates))
    cells = [(i, v) for i in range(len(requests)) for v in range(len(prompts[i]))]
    picks = rng.sample(cells, min(recheck, len(cells)))
    nondet = {n: False for n in names}
    for n in names:
        for i, v in picks:  # re-run on the same physical system (same device) that ran the variant
            t, _, left = session.run([(n, keys[n][i][v])], prompts[i][v], requests[i].max_new_tokens)[0]
            nondet[n] |= tuple(t) != tuple(toks[n][i][v])
            outside[n] |= set(left)
    return _Measured(
        prompts=tuple(tuple(p) for p in prompts),
        tokens={n: tuple(tuple(tuple(x) for x in v) for v in toks[n]) for n in names},
        tps={n: tuple(v) for n, v in tps.items()},
        outside={n: tuple(sorted(v)) for n, v in outside.items()},
        nondeterministic=nondet,
    )


def _samples(requests, prompts, outputs) -> list[tuple[tuple[int, ...], tuple[int, ...], str]]:
    return [(p, o, r.benchmark) for r, ps, os_ in zip(requests, prompts, outputs) for p, o in zip(ps, os_)]


@dataclass(frozen=True)
class PairedRun:
    """Result of :func:`paired_run` (§3.3). Throughputs in output tokens/s of controller-measured wall time.

    Attributes:
        requests: the requests, in the caller's order (they ran in a shuffled order).
        prompts: ``[request][variant]`` the salted prompts that were run (2 variants per repeat).
        outputs_a / outputs_b: ``[request][variant]`` output tokens of A / B.
        tps_a / tps_b: per-request throughput of A / B (tokens/s; the highest over the variants).
        outputs_differ: B's tokens != A's on at least one variant.
        nondeterministic_a / nondeterministic_b: an untimed re-run of a variant gave other tokens.
        outside_a / outside_b: names of Python threads the system left running (work outside the timer).
        benchmark_gain: per benchmark, the geometric mean over its requests of tps_b / tps_a.
        gain: geometric mean over benchmarks of ``benchmark_gain``.
        lower_bound: 95% one-sided lower confidence bound of ``gain`` (stratified paired bootstrap);
            NaN when no benchmark has two requests.
        ci_method: ``BCa``, ``percentile``, ``degenerate`` (all ratios equal) or ``none``.
    """

    requests: tuple[Req, ...]
    prompts: tuple[tuple[tuple[int, ...], ...], ...]
    outputs_a: tuple[tuple[tuple[int, ...], ...], ...]
    outputs_b: tuple[tuple[tuple[int, ...], ...], ...]
    tps_a: tuple[float, ...]
    tps_b: tuple[float, ...]
    outputs_differ: bool
    nondeterministic_a: bool
    nondeterministic_b: bool
    outside_a: tuple[str, ...]
    outside_b: tuple[str, ...]
    benchmark_gain: dict[str, float]
    gain: float
    lower_bound: float
    ci_method: str

    def samples(self, which: str = "b") -> list[tuple[tuple[int, ...], tuple[int, ...], str]]:
        """``(prompt_ids, output_ids, benchmark)`` of every variant run by ``which`` (``a`` or ``b``): the
        input of token forcing (:func:`specpilot.pilot.forcing.audit`)."""
        return _samples(self.requests, self.prompts, self.outputs_a if which == "a" else self.outputs_b)


def paired_run(make_a: Factory, make_b: Factory, requests: Sequence[Req], vocab_size: int, *,
               avoid_ids=(), repeats: int = 1, recheck: int = 1, rng=None,
               progress: Callable[[], None] | None = None, executor=None) -> PairedRun:
    """Paired run of systems A and B on one device, A B B A per request on fresh salted variants (§3.3).

    Args:
        make_a / make_b: the two systems as the executor takes them: factories (see the module doc) for
            the default :class:`LocalExecutor`; :class:`specpilot.pilot.workers.WorkerSystem` specs for a
            :class:`specpilot.pilot.workers.WorkerExecutor`. Each is built once per physical placement.
        requests: the request set (at least one); gain is averaged per ``req.benchmark``.
        vocab_size: salt ids are drawn from ``[0, vocab_size)``; avoid_ids: ids never used as salt (EOS,
            special tokens).
        repeats: A B B A blocks per request (each block runs two fresh variants).
        recheck: variants each system re-runs untimed to check determinism.
        rng: source of salts, order and recheck picks; default ``random.SystemRandom()`` (OS entropy).
            Pass a seeded ``random.Random`` only for reproducible tests.
        progress: called (outside the timed region) after every timed run.
        executor: where systems are built and timed: None = :class:`LocalExecutor` (this process); a
            ``WorkerExecutor`` runs A and B in separate worker processes (one device: A B B A; two
            devices: A on 0 and B on 1 concurrently on one variant, swapped on the other).
    Returns:
        :class:`PairedRun`.
    Raises:
        ValueError: no requests, ``repeats < 1``, fewer than two usable salt ids, or a run that produced
            no tokens; whatever the systems raise propagates (``WorkerError`` from worker executors).
    """
    m = _run_systems({"a": make_a, "b": make_b}, requests, vocab_size, avoid_ids, repeats, rng, recheck, progress,
                     executor)
    bench_gain, gain, low, method = gain_and_bound([r.benchmark for r in requests], m.tps["a"], m.tps["b"])
    return PairedRun(
        requests=tuple(requests), prompts=m.prompts, outputs_a=m.tokens["a"], outputs_b=m.tokens["b"],
        tps_a=m.tps["a"], tps_b=m.tps["b"], outputs_differ=m.tokens["a"] != m.tokens["b"],
        nondeterministic_a=m.nondeterministic["a"], nondeterministic_b=m.nondeterministic["b"],
        outside_a=m.outside["a"], outside_b=m.outside["b"],
        benchmark_gain=bench_gain, gain=gain, lower_bound=low, ci_method=method,
    )


@dataclass(frozen=True)
class InterleavedRun:
    """Result of :func:`interleaved_run`: per system, per-request throughput (tokens/s), outputs per
    variant, threads left running and the determinism flag.

    ``tokens_per_s(name)`` is the geometric mean over benchmarks of the geometric mean over the benchmark's
    requests, so ``tokens_per_s(b) / tokens_per_s(a)`` equals ``gain(a, b)`` exactly.
    """

    requests: tuple[Req, ...]
    prompts: tuple[tuple[tuple[int, ...], ...], ...]
    tps: dict[str, tuple[float, ...]]
    outputs: dict[str, tuple[tuple[tuple[int, ...], ...], ...]]
    outside: dict[str, tuple[str, ...]]
    nondeterministic: dict[str, bool]

    def tokens_per_s(self, name: str) -> float:
        """Headline throughput of ``name`` (tokens/s), consistent with :meth:`gain`."""
        groups: dict[str, list[float]] = {}
        for req, t in zip(self.requests, self.tps[name]):
            groups.setdefault(req.benchmark, []).append(math.log(t))
        return math.exp(sum(sum(v) / len(v) for v in groups.values()) / len(groups))

    def gain(self, a: str, b: str) -> tuple[float, float]:
        """(gain of ``b`` over ``a``, its one-sided 95% lower bound) by the paired bootstrap of §3.3."""
        _, g, low, _ = gain_and_bound([r.benchmark for r in self.requests], self.tps[a], self.tps[b])
        return g, low

    def samples(self, name: str) -> list[tuple[tuple[int, ...], tuple[int, ...], str]]:
        """``(prompt_ids, output_ids, benchmark)`` of every variant run by ``name``."""
        return _samples(self.requests, self.prompts, self.outputs[name])


def interleaved_run(makers: dict[str, Factory], requests: Sequence[Req], vocab_size: int, *, avoid_ids=(),
                    recheck: int = 1, rng=None, progress: Callable[[], None] | None = None,
                    executor=None) -> InterleavedRun:
    """Run several systems on the same requests, in a palindrome per request (A B C on one fresh variant,
    C B A on another), so drift cancels for every pair; same guarantees as :func:`paired_run`.

    Used for the seal's headline (AR, stock and sealed measured in one run, §5.1). ``executor`` as in
    :func:`paired_run` (a worker executor runs more than two systems on its first device only).

    Raises:
        ValueError: no systems or requests, or a run that produced no tokens.
    """
    m = _run_systems(dict(makers), requests, vocab_size, avoid_ids, 1, rng, recheck, progress, executor)
    return InterleavedRun(tuple(requests), m.prompts, m.tps, m.tokens, m.outside, m.nondeterministic)
