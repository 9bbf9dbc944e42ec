"""Gain over benchmarks and its one-sided 95% lower bound by a stratified paired bootstrap (paper §3.3).

Pure functions of throughput figures; used by the controller (:mod:`specpilot.pilot.controller`).
"""

from __future__ import annotations

import math
import warnings
from typing import Sequence

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
BOOTSTRAP_SEED = 20240917
N_RESAMPLES = 4999


def gain_and_bound(
    benchmarks: Sequence[str], tps_a: Sequence[float], tps_b: Sequence[float]
) -> tuple[dict[str, float], float, float, str]:
    """Per-benchmark gains, overall gain and its one-sided 95% lower bound (§3.3).

    The statistic works on log ratios: log gain = mean over benchmarks of the mean log(tps_b / tps_a) of
    the benchmark's requests (a geometric mean over benchmarks of geometric means over requests). Each
    request's A and B stay together (its ratio is resampled as one unit: the pairing), and requests are
    resampled only within their benchmark (stratified): each benchmark is passed to
    ``scipy.stats.bootstrap`` as its own sample. A benchmark with a single request enters as a constant.

    Args:
        benchmarks: benchmark name of each request.
        tps_a / tps_b: throughput of A / B per request (tokens/s, > 0).
    Returns:
        ``(benchmark_gain, gain, lower_bound, method)``; ``method`` is ``BCa``, ``percentile``,
        ``degenerate`` (all ratios equal: bound = gain) or ``none`` (no benchmark with two requests, or
        no finite bound: ``lower_bound`` is NaN). The resampling seed is fixed: same input, same bound.
    Raises:
        ValueError: a throughput <= 0, or lengths that differ.
    """
    if not len(benchmarks) == len(tps_a) == len(tps_b):
        raise ValueError("benchmarks, tps_a and tps_b need one entry per request")
    groups: dict[str, list[float]] = {}
    for i, (bench, a, b) in enumerate(zip(benchmarks, tps_a, tps_b)):
        if not (a > 0 and b > 0):
            raise ValueError(f"request {i} ({bench}): zero throughput (empty output?)")
        groups.setdefault(bench, []).append(math.log(b / a))
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
