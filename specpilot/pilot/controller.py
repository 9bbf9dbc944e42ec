"""The controller: paired runs, gain with a bootstrap lower bound, and the approval rule (paper §3.3).

The controller is the only judge of speed. Candidates reach it as two plain callables ``run(req) ->
Generation``; it times every call itself with a clock bound at import (a candidate that replaces
``time.perf_counter`` afterwards, or reports a false ``Generation.time_s``, changes nothing), interleaves
A B B A per request on one device so slow drift cancels, and compares outputs token for token. A
request's time for a system is the fastest of its runs: interference from other processes only ever adds
time, so the minimum is the estimator least disturbed by it (hyperfine and criterion report it too).
Everything here is a pure function of its arguments: no global mutable state.

Isolation inside one Python process is best effort (nothing can stop code that rewrites this module's
function objects); the planner therefore only gets :func:`paired_run` and :func:`approve` to call.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
BOOTSTRAP_SEED = 20240917
N_RESAMPLES = 4999
BASE_BAR = 0.01  # approve iff lower_bound - 1 > 1% + 2 sigma (§3.3)
CHANGED_OUTPUT_BAR = 0.03  # bar when B's output differs from A's (§3.3)


@dataclass(frozen=True)
class Req:
    """One request of a paired run.

    Attributes:
        benchmark: name of the benchmark the prompt comes from (gain is averaged per benchmark).
        index: index of the request within its benchmark.
        prompt_ids: prompt token ids.
        max_new_tokens: generation budget (tokens).
    """

    benchmark: str
    index: int
    prompt_ids: tuple[int, ...]
    max_new_tokens: int


@dataclass(frozen=True)
class PairedRun:
    """Result of :func:`paired_run` (§3.3). Throughputs in output tokens/s of controller-measured wall time.

    Attributes:
        requests: the requests, in order.
        tps_a / tps_b: per-request throughput of A / B (tokens/s).
        outputs_a / outputs_b: per-request output tokens of A / B (from their first run).
        outputs_differ: B's tokens != A's on at least one request.
        nondeterministic_a / nondeterministic_b: a system's repeated runs of one request disagreed.
        benchmark_gain: per benchmark, the geometric mean over its requests of tps_b / tps_a.
        gain: geometric mean over benchmarks of ``benchmark_gain``.
        lower_bound: 95% one-sided lower confidence bound of ``gain`` (stratified paired bootstrap);
            NaN when no benchmark has two requests (no bound can be computed).
        ci_method: ``BCa``, ``percentile``, ``degenerate`` (all ratios equal) or ``none``.
    """

    requests: tuple[Req, ...]
    tps_a: tuple[float, ...]
    tps_b: tuple[float, ...]
    outputs_a: tuple[tuple[int, ...], ...]
    outputs_b: tuple[tuple[int, ...], ...]
    outputs_differ: bool
    nondeterministic_a: bool
    nondeterministic_b: bool
    benchmark_gain: dict[str, float]
    gain: float
    lower_bound: float
    ci_method: str


@dataclass(frozen=True)
class Verdict:
    """Decision of :func:`approve`: ``approved``, a one-line ``reason``, the run's ``gain`` and
    ``lower_bound`` (ratios, 1.0 = equal speed) and the ``bar`` that ``lower_bound - 1`` had to exceed."""

    approved: bool
    reason: str
    gain: float
    lower_bound: float
    bar: float


def _timed(run: Callable, req: Req, _clock=time.perf_counter) -> tuple[tuple[int, ...], float]:
    """Call ``run(req)`` between two reads of the import-time clock; return (tokens, seconds)."""
    t0 = _clock()
    gen = run(req)
    dt = _clock() - t0
    return tuple(int(t) for t in gen.tokens), dt


def paired_run(
    run_a: Callable[[Req], object], run_b: Callable[[Req], object], requests: Sequence[Req], repeats: int = 1
) -> PairedRun:
    """Paired run of systems A and B on one device, interleaved A B B A per request (§3.3).

    Args:
        run_a / run_b: ``run(req) -> Generation`` (only ``.tokens`` is read; time is measured here).
        requests: the request set (at least one); gain is averaged per ``req.benchmark``.
        repeats: ABBA blocks per request, so each system runs ``2 * repeats`` times per request.
    Returns:
        :class:`PairedRun`; per-request throughput = len(tokens) / fastest wall time of that system's runs
        (tokens/s).
    Raises:
        ValueError: no requests, ``repeats < 1``, a run taking no measurable time, or a request on
            which a system produced no tokens (its throughput ratio is undefined); whatever
            ``run_a`` / ``run_b`` raise propagates.
    """
    if not requests or repeats < 1:
        raise ValueError("paired_run needs at least one request and repeats >= 1")
    tps_a, tps_b, out_a, out_b = [], [], [], []
    nd_a = nd_b = False
    for req in requests:
        toks = {"a": [], "b": []}
        secs = {"a": [], "b": []}
        for _ in range(repeats):
            for key, run in (("a", run_a), ("b", run_b), ("b", run_b), ("a", run_a)):
                t, s = _timed(run, req)
                toks[key].append(t)
                secs[key].append(s)
        nd_a |= any(t != toks["a"][0] for t in toks["a"])
        nd_b |= any(t != toks["b"][0] for t in toks["b"])
        for key, tps, out in (("a", tps_a, out_a), ("b", tps_b, out_b)):
            best_s = min(secs[key])
            if best_s <= 0:
                raise ValueError(f"request {req.benchmark}#{req.index}: run took no measurable time")
            tps.append(len(toks[key][0]) / best_s)
            out.append(toks[key][0])
    bench_gain, gain, low, method = _gain_and_bound(requests, tps_a, tps_b)
    return PairedRun(
        requests=tuple(requests), tps_a=tuple(tps_a), tps_b=tuple(tps_b),
        outputs_a=tuple(out_a), outputs_b=tuple(out_b),
        outputs_differ=any(a != b for a, b in zip(out_a, out_b)),
        nondeterministic_a=nd_a, nondeterministic_b=nd_b,
        benchmark_gain=bench_gain, gain=gain, lower_bound=low, ci_method=method,
    )


@dataclass(frozen=True)
class InterleavedRun:
    """Result of :func:`interleaved_run`: per system, per-request throughput (tokens/s) and outputs.

    ``tokens_per_s(name)`` is the geometric mean over benchmarks of the geometric mean over the benchmark's
    requests, so ``tokens_per_s(b) / tokens_per_s(a)`` equals ``gain(a, b)`` exactly.
    """

    requests: tuple[Req, ...]
    tps: dict[str, tuple[float, ...]]
    outputs: dict[str, tuple[tuple[int, ...], ...]]

    def tokens_per_s(self, name: str) -> float:
        """Headline throughput of ``name`` (tokens/s), consistent with :meth:`gain`."""
        groups: dict[str, list[float]] = {}
        for req, t in zip(self.requests, self.tps[name]):
            groups.setdefault(req.benchmark, []).append(math.log(t))
        return math.exp(sum(sum(v) / len(v) for v in groups.values()) / len(groups))

    def gain(self, a: str, b: str) -> tuple[float, float]:
        """(gain of ``b`` over ``a``, its one-sided 95% lower bound) by the paired bootstrap of §3.3."""
        _, g, low, _ = _gain_and_bound(self.requests, self.tps[a], self.tps[b])
        return g, low


def interleaved_run(runs: dict[str, Callable[[Req], object]], requests: Sequence[Req]) -> InterleavedRun:
    """Run several systems on the same requests, interleaved per request in a palindrome (A B C C B A),
    so drift cancels for every pair; a request's time per system is the fastest of its two runs.

    Used for the seal's headline (AR, stock and sealed measured in one run, §5.1).

    Raises:
        ValueError: no systems or requests, or a run that produced no tokens / took no time.
    """
    if not runs or not requests:
        raise ValueError("interleaved_run needs systems and requests")
    names = list(runs)
    tps = {n: [] for n in names}
    outs = {n: [] for n in names}
    for req in requests:
        secs = {n: [] for n in names}
        toks = {}
        for n in names + names[::-1]:
            t, dt = _timed(runs[n], req)
            secs[n].append(dt)
            toks.setdefault(n, t)
        for n in names:
            if not toks[n] or min(secs[n]) <= 0:
                raise ValueError(f"request {req.benchmark}#{req.index}: {n} produced no tokens or took no time")
            tps[n].append(len(toks[n]) / min(secs[n]))
            outs[n].append(toks[n])
    return InterleavedRun(tuple(requests), {n: tuple(v) for n, v in tps.items()},
                          {n: tuple(v) for n, v in outs.items()})


def _gain_and_bound(requests, tps_a, tps_b) -> tuple[dict[str, float], float, float, str]:
    """Per-benchmark gains, overall gain and its one-sided 95% lower bound.

    The statistic works on log ratios: log gain = mean over benchmarks of the mean log(tps_b / tps_a) of
    the benchmark's requests. Each request's A and B stay together (its ratio is resampled as one unit:
    the pairing), and requests are resampled only within their benchmark (stratified): each benchmark
    is passed to ``scipy.stats.bootstrap`` as its own sample, which scipy resamples independently. A
    benchmark with a single request cannot be resampled; it enters the statistic as a constant.
    """
    groups: dict[str, list[float]] = {}
    for req, a, b in zip(requests, tps_a, tps_b):
        if a <= 0 or b <= 0:
            raise ValueError(f"request {req.benchmark}#{req.index}: zero throughput (empty output?)")
        groups.setdefault(req.benchmark, []).append(math.log(b / a))
    bench_gain = {k: math.exp(sum(v) / len(v)) for k, v in groups.items()}
    n_bench = len(groups)
    gain = math.exp(sum(math.log(g) for g in bench_gain.values()) / n_bench)
    samples = [np.asarray(v) for v in groups.values() if len(v) >= 2]
    const = sum(v[0] for v in groups.values() if len(v) == 1)
    if not samples:
        return bench_gain, gain, float("nan"), "none"
    if all(np.ptp(s) == 0 for s in samples):
        return bench_gain, gain, gain, "degenerate"

    def statistic(*xs, axis=-1):
        return (sum(np.mean(x, axis=axis) for x in xs) + const) / n_bench

    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", stats.DegenerateDataWarning)
            warnings.simplefilter("error", RuntimeWarning)
            try:
                res = stats.bootstrap(
                    tuple(samples), statistic, n_resamples=N_RESAMPLES, vectorized=True, paired=False,
                    confidence_level=CONFIDENCE, alternative="greater", method=method,
                    rng=np.random.default_rng(BOOTSTRAP_SEED),
                )
            except (Warning, ValueError, FloatingPointError):
                continue
        low = float(res.confidence_interval.low)
        if math.isfinite(low):
            return bench_gain, gain, math.exp(low), method
    return bench_gain, gain, float("nan"), "none"


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


def approve(run: PairedRun, sigma: float, forcing_passed: bool | None) -> Verdict:
    """The approval rule of §3.3 for candidate B against incumbent A.

    Approve iff ``lower_bound - 1 > 0.01 + 2σ``. When B's output differs from A's on any request, the
    bar is ``max(0.03, 0.01 + 2σ)`` and token forcing (§3.4) must have passed (``forcing_passed is
    True``; ``None`` = not run = reject). A nondeterministic system, or a run without a bound, is rejected.

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

    if run.nondeterministic_a or run.nondeterministic_b:
        which = " and ".join(s for s, f in (("A", run.nondeterministic_a), ("B", run.nondeterministic_b)) if f)
        return verdict(False, f"rejected: {which} gave different tokens on repeated runs (nondeterministic)")
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
