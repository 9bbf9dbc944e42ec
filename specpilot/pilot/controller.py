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
   :mod:`specpilot.pilot.paired` is imported (in-process) or at the top of the stock worker script before the candidate's
   code is importable (worker executor); ``Generation.time_s`` is never read.
4. *Change the output slightly* (a logit bias, low-precision verification, skipped verification). B's
   tokens are compared with A's on every variant; if any differ, the bar is 3% and token forcing of all B
   outputs against the FP32-head scorer must pass. Equal tokens need no forcing: A is stock (audited in
   Phase 0) or an incumbent that passed this same check, and in float32 on the CPU both equal AR exactly.
   Neither A's outputs nor the scorer's are handed to B.
5. *Be nondeterministic.* Each system re-runs ``recheck`` random variants untimed; different tokens reject.

A request's throughput, the executors that build and time systems (in this process or in worker
processes) and the paired / interleaved runs are in :mod:`specpilot.pilot.paired`; this module holds the
approval rule, Phase 0 and the judging path.

**Process isolation (worker executor): what it guarantees.** A candidate's code never runs in the
controller's process: it cannot rewrite this module or :mod:`.paired`, the salts (drawn here, from OS entropy, sent only
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
that rewrites this module's (or :mod:`.paired`'s) objects, walks the garbage collector to reach A's outputs, or mutates the
target weights it shares with the scorer is beyond it. Threads are Python threads: work in native threads
or subprocesses is not seen. The salt is no secret scheme: a cheat that strips it and replays an output
cached for the unsalted prompt is fast and correct wherever the salt did not change the output (about
40% of variants on the bundled models) and is caught by token forcing only through the variants where it
did. Timings on a shared CPU include other processes' interference (raising σ and so the bar).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

from specpilot.pilot.forcing import ForcingStats, Scorer, audit, delta_from_phase0, forcing_verdict
from specpilot.pilot.paired import (  # noqa: F401  (the controller's interface, re-exported)
    SALT_TOKENS, Factory, InterleavedRun, LocalExecutor, PairedRun, Req, interleaved_run, paired_run)

BASE_BAR = 0.01  # approve iff lower_bound - 1 > 1% + 2 sigma (§3.3)
CHANGED_OUTPUT_BAR = 0.03  # bar when B's output differs from A's (§3.3)
_SCORER_LOCK = threading.Lock()  # token forcing of concurrent judgements shares one scorer


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


def approve(run: PairedRun, sigma: float, forcing_passed: bool | None, *, b_is_ar: bool = False) -> Verdict:
    """The approval rule of §3.3 for candidate B against incumbent A.

    Approve iff ``lower_bound - 1 > 0.01 + 2σ``. When B's output differs from A's on any variant, the
    bar is ``max(0.03, 0.01 + 2σ)`` and token forcing (§3.4) must have passed (``forcing_passed is
    True``; ``None`` = not run = reject); output equal to A's on every variant needs no forcing (A was
    audited when it was approved; stock in Phase 0). B = AR (``b_is_ar``) needs no forcing either: AR's
    output is the target's greedy decoding, the reference forcing audits against, so a difference is A's
    drift (bf16 rounding of its verify rows), not B's; a difference still sets the higher bar. Rejected in
    any case: a system that left threads running (work outside the timed region), a nondeterministic system,
    a run without a bound.

    Args:
        run: the paired run (A = incumbent, B = candidate).
        sigma: stock noise σ from :func:`noise_from_aa` (fraction, >= 0).
        forcing_passed: token forcing verdict for B, or None when it was not run.
        b_is_ar: B is AR (no drafter): forcing is not required of it.
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
    if run.outputs_differ and forcing_passed is not True and not b_is_ar:
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
              progress: Callable[[], None] | None = None, executor=None, b_is_ar: bool = False) -> Judgement:
        """Candidate B against incumbent A: paired run, token forcing of every B output, approval rule
        (:func:`approve`; ``b_is_ar``: B is AR, which forcing audits but does not bind).

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
        return Judgement(run, forcing, passed, tuple(reasons), approve(run, self.sigma, passed, b_is_ar=b_is_ar))


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
