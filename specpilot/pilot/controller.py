"""The controller: the only judge of speed (paper §3.3), with token forcing (§3.4) on the same path.

**Interface.** A system reaches the controller as a *factory* ``make() -> system`` whose
``system.generate(prompt_ids: list[int], max_new_tokens: int)`` returns an object with ``.tokens`` (the
engine's :class:`~specpilot.engine.types.Generation`; nothing else of it is read). The controller builds
each system itself, once per paired run (untimed, with no request in sight), warms it with one untimed
request, then times, compares and audits it. Callers get :func:`phase0` (stock noise σ, near-tie δ,
stock's forcing figures) and :meth:`Controller.judge` (paired run + token forcing + approval rule), the
path the pilot uses for every candidate; :func:`paired_run`, :func:`interleaved_run` and :func:`approve`
are its parts. With a worker executor a system is a :class:`specpilot.pilot.workers.WorkerSystem` (a
config and a source tree) instead of a factory.

**What a candidate cannot do to earn an approval** (each has an adversarial test in
``tests/test_adversarial.py``):

1. *Replay outputs cached from an earlier run, or precomputed at construction.* Every timed run gets a
   fresh variant of its request: the prompt prefixed with ``SALT_TOKENS`` token ids drawn, at that moment,
   from the OS entropy source (``random.SystemRandom``); each system runs each variant exactly once, and
   the request order is shuffled from the same source. No timed prompt was seen before or can be
   predicted, so a prompt -> output cache never hits. A and B run the same variants (A B on the first,
   B A on the second: A B B A), so the pairing stays exact.
2. *Work outside the timed region.* The timed region is the whole ``generate`` call, reading every output
   token into a host ``tuple[int]`` (lazy outputs are computed here) and a device synchronisation (queued
   GPU work is charged to the system that queued it). A system that leaves a Python thread running after
   its construction or after a call returns (work, or interference with the other system, that no timer
   covers) is rejected.
3. *Tamper with the timer.* The clock, the device synchronisation and the thread listing are bound when
   this module is imported (in-process) or at the top of the stock worker script before the candidate's
   code is importable (worker executor); ``Generation.time_s`` is never read.
4. *Change the output slightly* (a logit bias, low-precision verification, skipped verification). B's
   tokens are compared with A's on every variant; if any differ, the bar is 3% and token forcing of all B
   outputs against the FP32-head scorer must pass. Equal tokens need no forcing: A is stock (audited in
   Phase 0) or an incumbent that passed this same check, and in float32 on the CPU both equal AR exactly.
   Neither A's outputs nor the scorer's are handed to B.
5. *Be nondeterministic.* Each system re-runs ``recheck`` random variants untimed; different tokens reject.

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
workers on one CPU measured a 1.19x "gain" in CI); a code candidate's tree always gets its own worker. The recheck and the thread listing run in
the worker on the system that ran the variant and are reported back.

**Process isolation (worker executor): what it guarantees.** A candidate's code never runs in the
controller's process: it cannot rewrite this module, the salts (drawn here, from OS entropy, sent only
as the prompt of each run), the bootstrap, token forcing, the scorer or its weights, and it never sees A's
outputs or A's process (a patched tree's worker shares no memory with any other; each loads its own copy
of the weights). A candidate
that crashes, hangs (per-reply timeout, then killed) or prints to stdout (fd 1 is redirected to stderr;
replies go over a private descriptor) cannot forge a reply; its error comes back as one line and the
pilot rejects it. **What it does not guarantee:** inside its own worker the candidate runs in the same
interpreter as the timer, so code that deliberately reaches ``sys.modules["__main__"]`` (the worker
script) can still rebind the clock used for its own runs; the worker's tree is trusted to be the one the
patch produced, not sandboxed (it can read the file system, open sockets, or leave native threads and
subprocesses running, which the Python thread listing does not see); two workers on one device share
its memory bandwidth and caches (on one device they run one at a time; on two devices concurrently, but
each on its own device).

**Limits.** With the in-process executor all of this holds inside one Python process only: a candidate
that rewrites this module's objects, walks the garbage collector to reach A's outputs, or mutates the
target weights it shares with the scorer is beyond it. Threads are Python threads: work in native threads
or subprocesses is not seen. The salt is no secret scheme: a cheat that strips it and replays an output
cached for the unsalted prompt is fast and correct wherever the salt did not change the output (about
40% of variants on the bundled models) and is caught by token forcing only through the variants where it
did. Timings on a shared CPU include other processes' interference (raising σ and so the bar).
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
from specpilot.pilot.forcing import ForcingStats, Scorer, audit, delta_from_phase0, forcing_verdict

BASE_BAR = 0.01  # approve iff lower_bound - 1 > 1% + 2 sigma (§3.3)
CHANGED_OUTPUT_BAR = 0.03  # bar when B's output differs from A's (§3.3)
SALT_TOKENS = 4  # random token ids prefixed to every timed prompt
_SCORER_LOCK = threading.Lock()  # token forcing of concurrent judgements shares one scorer

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


def _build(make: Factory, _enum=threading.enumerate) -> tuple[object, set[str]]:
    """``make()`` untimed; returns (system, names of threads it started that are still running)."""
    before = set(_enum())
    system = make()
    return system, {t.name for t in _enum() if t not in before}


def _timed(system, prompt: tuple[int, ...], max_new: int, _clock=time.perf_counter, _sync=_device_sync,
           _enum=threading.enumerate) -> tuple[tuple[int, ...], float, set[str]]:
    """Time ``system.generate`` with the import-time clock, tokens read to the host and the device synced
    inside the timed region; returns (tokens, seconds, names of threads it left running)."""
    before = set(_enum())
    t0 = _clock()
    gen = system.generate(list(prompt), max_new)
    tokens = tuple(int(t) for t in gen.tokens)
    _sync()
    dt = _clock() - t0
    return tokens, dt, {t.name for t in _enum() if t not in before}


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


def noise_from_aa(aa: PairedRun) -> float:
    """Stock noise σ from an A/A paired run (stock against itself; Phase 0, §3.3).

    σ = max(|gain − 1|, gain − lower_bound): the larger of the observed spurious gain and the one-sided
    half-width of its 95% bound, so a system must beat both the bias and the spread of stock vs itself.

    Returns:
        σ as a fraction of throughput (0.002 = 0.2%).
    Raises:
        ValueError: when the A/A run has no lower bound (every benchmark has a single request).
    """
    if not math.isfinite(aa.lower_bound):
        raise ValueError("A/A run has no confidence bound: give at least one benchmark two requests")
    return max(abs(aa.gain - 1.0), aa.gain - aa.lower_bound)


@dataclass(frozen=True)
class Verdict:
    """Decision of :func:`approve`: ``approved``, a one-line ``reason``, the run's ``gain`` and
    ``lower_bound`` (ratios, 1.0 = equal speed) and the ``bar`` that ``lower_bound - 1`` had to exceed."""

    approved: bool
    reason: str
    gain: float
    lower_bound: float
    bar: float


def approve(run: PairedRun, sigma: float, forcing_passed: bool | None) -> Verdict:
    """The approval rule of §3.3 for candidate B against incumbent A.

    Approve iff ``lower_bound - 1 > 0.01 + 2σ``. When B's output differs from A's on any variant, the
    bar is ``max(0.03, 0.01 + 2σ)`` and token forcing (§3.4) must have passed (``forcing_passed is
    True``; ``None`` = not run = reject); output equal to A's on every variant needs no forcing (A was
    audited when it was approved; stock in Phase 0). Rejected in any case: a system that left threads
    running (work outside the timed region), a nondeterministic system, a run without a bound.

    Args:
        run: the paired run (A = incumbent, B = candidate).
        sigma: stock noise σ from :func:`noise_from_aa` (fraction, >= 0).
        forcing_passed: token forcing verdict for B, or None when it was not run.
    Returns:
        :class:`Verdict`.
    Raises:
        ValueError: negative or non-finite ``sigma``.
    """
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"sigma must be a finite fraction >= 0, got {sigma}")
    bar = BASE_BAR + 2 * sigma
    if run.outputs_differ:
        bar = max(CHANGED_OUTPUT_BAR, bar)

    def verdict(ok: bool, reason: str) -> Verdict:
        return Verdict(ok, reason, run.gain, run.lower_bound, bar)

    for who, left in (("A", run.outside_a), ("B", run.outside_b)):
        if left:
            return verdict(False, f"rejected: {who} left threads running after its call returned "
                                  f"({', '.join(left)}): work outside the timed region")
    if run.nondeterministic_a or run.nondeterministic_b:
        which = " and ".join(s for s, f in (("A", run.nondeterministic_a), ("B", run.nondeterministic_b)) if f)
        return verdict(False, f"rejected: {which} gave different tokens on a re-run (nondeterministic)")
    if not math.isfinite(run.lower_bound):
        return verdict(False, "rejected: no confidence bound (need two requests in a benchmark)")
    if run.outputs_differ and forcing_passed is not True:
        state = "was not run" if forcing_passed is None else "failed"
        return verdict(False, f"rejected: output differs from A and token forcing {state}")
    margin = run.lower_bound - 1.0
    figures = f"gain {run.gain:.4f}, 95% lower bound {run.lower_bound:.4f}, bar +{bar:.2%}"
    if margin > bar:
        return verdict(True, f"approved: {figures}")
    return verdict(False, f"rejected: lower bound below the bar ({figures})")


@dataclass(frozen=True)
class Judgement:
    """What :meth:`Controller.judge` decided: the paired ``run``, B's token-forcing figures ``forcing``
    (:class:`ForcingStats`), ``forcing_passed`` with the failed rules in ``forcing_reasons``, and the
    :class:`Verdict`."""

    run: PairedRun
    forcing: ForcingStats
    forcing_passed: bool
    forcing_reasons: tuple[str, ...]
    verdict: Verdict


@dataclass(frozen=True)
class Controller:
    """The judging path with the facts Phase 0 fixed (§3.3, §3.4); build it with :func:`phase0`.

    Attributes:
        sigma: stock A/A noise σ (fraction). delta: near-tie threshold δ (nats).
        scorer: the FP32-head :class:`Scorer` (stock target). stock_forcing: stock's forcing figures.
        vocab_size / avoid_ids: salt token range and the ids never used as salt.
    """

    sigma: float
    delta: float
    scorer: Scorer
    stock_forcing: ForcingStats
    vocab_size: int
    avoid_ids: frozenset[int] = frozenset()

    def judge(self, make_a: Factory, make_b: Factory, requests: Sequence[Req], *, repeats: int = 1, rng=None,
              progress: Callable[[], None] | None = None, executor=None) -> Judgement:
        """Candidate B against incumbent A: paired run, token forcing of every B output, approval rule.

        Safe to call from several threads at once (the pilot judges a round's candidates concurrently on
        several devices): token forcing is serialised on the one scorer.

        Raises:
            ValueError: as :func:`paired_run`; WorkerError: a worker died or could not build its system.
        """
        run = paired_run(make_a, make_b, requests, self.vocab_size, avoid_ids=self.avoid_ids, repeats=repeats,
                         rng=rng, progress=progress, executor=executor)
        with _SCORER_LOCK:
            forcing = audit(self.scorer, run.samples("b"), self.delta)
        passed, reasons = forcing_verdict(forcing, self.stock_forcing)
        return Judgement(run, forcing, passed, tuple(reasons), approve(run, self.sigma, passed))


@dataclass(frozen=True)
class Phase0:
    """Phase 0 (§3.3, §3.4): ``ar_stock`` (A = AR, B = stock), ``aa`` (stock A/A) and the ``controller``."""

    ar_stock: PairedRun
    aa: PairedRun
    controller: Controller


def phase0(make_ar: Factory, make_stock: Factory, requests: Sequence[Req], scorer: Scorer, vocab_size: int, *,
           avoid_ids=(), rng=None, progress: Callable[[], None] | None = None, executor=None) -> Phase0:
    """Measure AR vs stock and stock vs itself; fix σ (:func:`noise_from_aa`), δ (the largest scorer margin
    where stock first diverges from AR, rounded up to 1/8) and stock's token-forcing figures.

    ``executor`` as in :func:`paired_run`: σ should be measured on the executor the candidates are judged on.

    Raises:
        ValueError: as :func:`paired_run`, or no benchmark with two requests (σ has no bound).
    """
    kw = {"avoid_ids": avoid_ids, "rng": rng, "progress": progress, "executor": executor}
    ar_stock = paired_run(make_ar, make_stock, requests, vocab_size, **kw)
    aa = paired_run(make_stock, make_stock, requests, vocab_size, **kw)
    sigma = noise_from_aa(aa)
    ar, stock = ar_stock.samples("a"), ar_stock.samples("b")
    delta = delta_from_phase0(scorer, [p for p, _, _ in ar], [o for _, o, _ in ar], [o for _, o, _ in stock])
    stock_forcing = audit(scorer, stock, delta)
    ctl = Controller(sigma, delta, scorer, stock_forcing, vocab_size, frozenset(int(t) for t in avoid_ids))
    return Phase0(ar_stock, aa, ctl)
