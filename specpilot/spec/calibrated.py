"""The calibrated drafter: a real pair's acceptance on a target whose weights are random (simulated; §2.4, §4.2).

On random weights every drafter's τ is 1, so timing a speculative system on a random target of a real shape says
nothing about what it would gain. This drafter knows the target's greedy continuation of each request (from a prior
AR run of the same prompt, :class:`Continuations`) and proposes lattices that agree with it the way a real drafter
agreed with its target, as measured in a :class:`~specpilot.spec.calibration.Calibration`:

- per position ``m`` of a request a *regime* (nothing proposed, or the top-1 chain matches ``a`` leading positions),
  drawn along the request's continuation from the calibration's first-order regime chain, so acceptance comes in
  runs as it does for a real drafter;
- after the chain breaks, the rank of the right token at the first miss and at later positions from the first-miss
  and detour counts; wrong tokens drawn uniformly from the vocabulary (never the right token of that position);
- each position's scores and width: a recorded row of the real drafter in which the right token sat at the same rank
  (or was missing), at the same position when at least 8 such rows were kept, else at any position.

Every draw comes from a generator seeded by (``seed``, the prompt's hash, ``m``), so a lattice depends only on those,
not on the batch, the slot or the depth asked for (a shorter lattice is a prefix of a longer one; a smaller
``top_k`` a prefix of each row): paired A/B runs see the same drafts, and :func:`~specpilot.pilot.replay.record`
of this drafter replays exactly. The engine stays lossless: the target verifies every token; a request with no
known continuation, or past its end, gets no proposal (None), never a guess.

Cost: every :meth:`CalibratedDrafter.propose` also runs a *cost drafter* of the real drafter's shape (a randomly
initialised block network, a draft model, or the n-gram index; :func:`cost_drafter`) on the same requests and
discards its lattices, inside the engine's ``drafter`` profiler region, so c(N) and the cost model see drafter time.
It is labelled: ``simulated = True``, ``kind = "calibrated"`` (so ``SystemConfig.label()`` says so) and
:func:`~specpilot.spec.calibration.simulation_note` gives the line output writers must print.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from typing import Callable, Sequence

import torch

from specpilot.errors import DrafterError
from specpilot.spec.calibration import Calibration, load_calibration, regime_states
from specpilot.spec.cost_drafter import cost_drafter
from specpilot.spec.drafter import DraftRequest
from specpilot.spec.lattice import Lattice

PRIOR = 4.0  # pseudo-counts pulling a sparse per-position rank distribution toward the pooled one
SEED = 0  # the draws' seed of a deployment's calibrated drafters (the pilot's replay of their Q agreement uses it too)


class RowsLattice(Lattice):
    """A positional lattice from rows of ``(token, log_prob)`` best first (rows may differ in width)."""

    def __init__(self, rows: list[list[tuple[int, float]]]):
        self.rows, self.depth = rows, len(rows)

    def children(self, path):
        return self.rows[len(path)] if len(path) < self.depth else []


class Continuations:
    """The target's known greedy continuations, keyed by prompt (fed from a prior AR run of the same prompts).

    Greedy decoding is deterministic, so if ``committed`` starts with a known prompt and is a prefix of
    ``prompt + continuation``, the target's greedy tokens after ``committed`` are the rest of that sequence. One
    store can serve every engine of a deployment (single-request and batched: no slots involved).
    """

    def __init__(self, oracle: Callable[[list[int], int], Sequence[int]] | None = None,
                 batch_oracle: Callable[[list[list[int]], int], Sequence[Sequence[int]]] | None = None):
        self._by_prompt: dict[tuple[int, ...], list[list[int]]] = {}
        #: ``oracle(prompt, n)``: the target's greedy continuation of ``prompt``, ``n`` tokens (an AR run of the
        #: deployment; None: only what :meth:`add` was told is known)
        self.oracle = oracle
        #: ``batch_oracle(prompts, n)``: the continuations of several prompts in one run (preferred when set: the
        #: batched engine's AR, whose bf16 bits are the ones its speculative systems reproduce)
        self.batch_oracle = batch_oracle

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_prompt.values())

    def add(self, prompt: Sequence[int], continuation: Sequence[int]) -> None:
        """Record that the target's greedy output after ``prompt`` (token ids) begins with ``continuation``.

        Raises:
            ValueError: an empty prompt, or ids that are not non-negative ints.
        """
        prompt, cont = list(prompt), list(continuation)
        if not prompt or not all(isinstance(t, int) and t >= 0 for t in prompt + cont):
            raise ValueError("a continuation needs a non-empty prompt and non-negative integer token ids")
        seqs = self._by_prompt.setdefault(tuple(prompt), [])
        if prompt + cont not in seqs:
            seqs.append(prompt + cont)

    def ensure(self, prompt: Sequence[int], n: int) -> bool:
        """Make ``n`` tokens of the target's greedy continuation of ``prompt`` known, asking the :attr:`oracle`
        when no known sequence covers them. Untimed work by contract: the pilot's timers call it (through
        :meth:`~specpilot.engine.engine.Engine.prepare`) before their clock starts. Returns whether they are known."""
        return self.ensure_all([prompt], n)[0]

    def ensure_all(self, prompts: Sequence[Sequence[int]], n: int) -> list[bool]:
        """:meth:`ensure` for several prompts, the unknown ones asked of :attr:`batch_oracle` in one call when it is
        set (else of :attr:`oracle`, one by one). Returns per prompt whether its ``n`` tokens are known."""
        prompts = [[int(t) for t in p] for p in prompts]
        missing = []
        for p in prompts:
            found = self.find(p)
            if (found is None or len(found[1]) < len(p) + n) and p not in missing:
                missing.append(p)
        if missing and self.batch_oracle is not None:
            for p, c in zip(missing, self.batch_oracle(missing, n)):
                self.add(p, [int(t) for t in c])
        elif missing and self.oracle is not None:
            for p in missing:
                self.add(p, [int(t) for t in self.oracle(p, n)])
        elif missing:
            return [p not in missing for p in prompts]
        return [True] * len(prompts)

    def find(self, committed: list[int]) -> tuple[int, list[int]] | None:
        """``(prompt length, prompt + continuation)`` of a known sequence that extends ``committed`` and whose
        prompt ``committed`` starts with (the longest prompt, then the longest sequence); None when none does."""
        n = len(committed)
        for p in sorted({len(k) for k in self._by_prompt if len(k) <= n}, reverse=True):
            seqs = [s for s in self._by_prompt.get(tuple(committed[:p]), ()) if len(s) >= n and s[:n] == committed]
            if seqs:
                return p, max(seqs, key=len)
        return None


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).digest(), "little")


def _cdf(weights: list[float]) -> list[float]:
    total, acc, out = sum(weights), 0.0, []
    for w in weights:
        acc += w / total
        out.append(acc)
    return out


def _draw(rng: random.Random, cdf: list[float]) -> int:
    return min(bisect.bisect_right(cdf, rng.random()), len(cdf) - 1)


def _smoothed(per_d: list[list[int]], fallback: list[float]) -> list[list[float]]:
    """Per position, cumulative probabilities: counts + PRIOR pseudo-counts spread as the pooled counts (or as
    ``fallback`` when nothing was pooled)."""
    pooled = [sum(c) for c in zip(*per_d)]
    prior = pooled if sum(pooled) else fallback
    return [_cdf([c + PRIOR * p / sum(prior) for c, p in zip(row, prior)]) for row in per_d]


class _Model:
    """A calibration turned into samplers (cumulative distributions, score rows by class).

    Transition rows and the start get one (start: PRIOR) pseudo-count spread as the regime marginal, so a regime
    seen only once still leads somewhere; per-position rank counts get PRIOR pseudo-counts spread as the pooled ones.
    """

    def __init__(self, cal: Calibration):
        D, K = cal.depth, cal.top_k
        self.D, self.K, self.states = D, K, regime_states(D)
        self.marg = [c / sum(cal.regime_counts) for c in cal.regime_counts]
        self.start = _cdf([c + PRIOR * m for c, m in zip(cal.regime_first, self.marg)])
        self._trans: dict[int, list[float]] = {}
        for i, j, n in cal.regime_transitions:
            self._trans.setdefault(i, [0.0] * len(self.marg))[j] = float(n)
        self._trans_cdf: dict[int, list[float]] = {}
        self.first_hit = _smoothed([row[:-1] for row in cal.first_miss], [1.0] * (K - 1))  # ranks 1 .. K-1
        self.detour_hit = _smoothed([row[:-1] for row in cal.detour], [1.0] * K)  # ranks 0 .. K-1
        self.detour = _smoothed(cal.detour, [0.0] * K + [1.0])
        self.rows: dict[tuple[str, int | None], list[list[float]]] = {}
        for cls, b in cal.rows.items():
            for d, scores in zip(b["position"], b["scores"]):
                self.rows.setdefault((cls, d), []).append(scores)
                self.rows.setdefault((cls, None), []).append(scores)

    def regimes(self, rng: random.Random, out: list[int], upto: int) -> None:
        """Extend the regime sequence ``out`` (index m - 1 for position m) to ``upto`` positions."""
        while len(out) < upto:
            if not out:
                out.append(_draw(rng, self.start))
                continue
            i = out[-1]
            if i not in self._trans_cdf:
                row = self._trans.get(i, [0.0] * len(self.marg))
                self._trans_cdf[i] = _cdf([c + m for c, m in zip(row, self.marg)])
            out.append(_draw(rng, self._trans_cdf[i]))

    def row(self, rng: random.Random, d: int, r: int) -> list[float]:
        """The log-probs (best first) of a recorded row whose right token sat at rank ``r`` (K: miss) at position
        ``d`` (at any position when fewer than 8 such rows were kept); a flat row of width r + 1 when the class never
        occurred."""
        cls = "miss" if r == self.K else str(r)
        rows = self.rows.get((cls, d)) if len(self.rows.get((cls, d), ())) >= 8 else self.rows.get((cls, None))
        if not rows:
            return [-1.0] * (r + 1)
        return rows[int(rng.random() * len(rows))]


class CalibratedDrafter:
    """A simulated drafter with a real pair's calibrated acceptance (:class:`~specpilot.spec.drafter.Drafter`).

    Args:
        calibration: a :class:`Calibration` (or a path to its JSON file).
        vocab_size: the target's vocabulary (wrong tokens are drawn from ``[0, vocab_size)``).
        continuations: the known greedy continuations (a fresh empty store when None; fill it with :meth:`expect`).
        top_k: candidates a position (≤ the calibration's K; a row keeps its first ``top_k``).
        seed: the draws' seed (same seed, same prompt, same position: the same lattice).
        cost: a real drafter of the real drafter's shape run on every propose, its output discarded
            (:func:`cost_drafter`); None: no drafting cost at all.
        max_slots: requests held at once (capped by the cost drafter's).
    Raises:
        DrafterError: ``top_k`` outside ``[1, K]``; an unreadable calibration (CalibrationError).

    Attributes:
        simulated: always True: figures of a system with this drafter are simulated acceptance.
        counts: ``proposed`` lattices, ``none`` (simulated no-proposal), ``unknown`` (no known continuation covers
            the request), ``cut`` (a lattice cut short, or none, because the request reached the end of its known
            continuation).
    """

    kind = "calibrated"
    simulated = True

    def __init__(self, calibration, vocab_size: int, continuations: Continuations | None = None,
                 top_k: int | None = None, seed: int = 0, cost=None, max_slots: int = 1024):
        self.cal = calibration if isinstance(calibration, Calibration) else load_calibration(calibration)
        self.top_k = self.cal.top_k if top_k is None else top_k
        if not 1 <= self.top_k <= self.cal.top_k:
            raise DrafterError(f"the calibration has {self.cal.top_k} candidates a position, top_k {self.top_k} "
                               "asked for")
        self.vocab_size, self.seed, self.cost = vocab_size, seed, cost
        self.continuations = continuations if continuations is not None else Continuations()
        self.target_layers = tuple(cost.target_layers) if cost is not None else ()
        self.max_context = cost.max_context if cost is not None else None
        self.max_slots = min(max_slots, cost.max_slots) if cost is not None else max_slots
        self.counts = {"proposed": 0, "none": 0, "unknown": 0, "cut": 0}
        self._model = _Model(self.cal)
        self._slots: dict[int, tuple[int, list[int], str]] = {}  # slot -> (prompt length, sequence, prompt key)
        self._regimes: dict[str, tuple[random.Random, list[int]]] = {}  # prompt key -> (its generator, regimes)

    def expect(self, prompt: Sequence[int], continuation: Sequence[int]) -> None:
        """The target's greedy output after ``prompt`` begins with ``continuation`` (:meth:`Continuations.add`)."""
        self.continuations.add(prompt, continuation)

    def prepare(self, prompt: Sequence[int], max_new_tokens: int) -> None:
        """Learn the target's greedy continuation of ``prompt`` (``max_new_tokens``) from the continuations'
        oracle before a timed request (:meth:`Continuations.ensure`); nothing when there is no oracle."""
        self.continuations.ensure(prompt, max_new_tokens)

    def prepare_all(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        """:meth:`prepare` for the prompts of a batch run, in one oracle call (:meth:`Continuations.ensure_all`)."""
        self.continuations.ensure_all(prompts, max_new_tokens)

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise DrafterError(f"the calibrated drafter holds {self.max_slots} requests, asked for slot {slot}")

    def reset(self, slot: int = 0) -> None:
        """Forget the request in ``slot`` (and reset the cost drafter's slot)."""
        self._check(slot)
        self._slots.pop(slot, None)
        if self.cost is not None:
            self.cost.reset(slot)

    def observe(self, slot: int, features: torch.Tensor, start: int) -> None:
        """Target features ``[k, layers * hidden]`` for the cost drafter (a block network reads them)."""
        self._check(slot)
        if self.cost is not None:
            self.cost.observe(slot, features, start)

    def propose(self, batch: Sequence[DraftRequest]) -> list[Lattice | None]:
        """Per request a lattice of ``min(depth, D, known tokens left)`` positions (None: simulated no-proposal, no
        known continuation, or none left); the cost drafter drafts the same batch first (output discarded).

        Raises:
            DrafterError: a slot outside ``[0, max_slots)``; errors of the cost drafter pass through.
        """
        for q in batch:
            self._check(q.slot)
        if self.cost is not None and batch:
            self.cost.propose(batch)
        return [self._lattice(q) for q in batch]

    def lattice_at(self, prompt: list[int], sequence: list[int], m: int, depth: int,
                   key: str | None = None) -> RowsLattice | None:
        """The lattice after ``sequence[:len(prompt) + m]`` (``m`` ≥ 1 generated tokens) for ``depth`` positions,
        where ``sequence`` is prompt + the target's greedy continuation; None for a simulated no-proposal or when no
        continuation token is left. Deterministic in (seed, prompt, m); ``key``: :func:`prompt_key` of ``prompt``."""
        key = key or prompt_key(prompt)
        if key not in self._regimes:
            self._regimes[key] = (random.Random(_seed(self.seed, key, "regimes")), [])
        rng, reg = self._regimes[key]
        self._model.regimes(rng, reg, m)  # drawn in order from position 1, whatever order positions are asked in
        known = len(sequence) - len(prompt) - m
        if reg[m - 1] == 0:
            self.counts["none"] += 1
            return None
        if known < min(depth, self.cal.depth):
            self.counts["cut"] += 1
        depth = min(depth, self.cal.depth, known)
        if depth < 1:
            return None
        self.counts["proposed"] += 1
        rows = self._rows(random.Random(_seed(self.seed, key, m)), self._model.states[reg[m - 1]],
                          sequence[len(prompt) + m : len(prompt) + m + depth])
        return RowsLattice(rows) if rows else None

    def _rows(self, rng: random.Random, regime: tuple[int, int], right: list[int]) -> list[list[tuple[int, float]]]:
        """Rows for the right tokens ``right`` (one per position) in regime ``(a, o)``: top-1 hits at positions
        1 … a, other top-K hits up to o, a miss at o + 1; past it (unreachable) ranks only shape the rows."""
        M, K = self._model, self.cal.top_k
        a, o = regime
        ranks, r = [], 0
        for d in range(1, M.D + 1):  # every rank first (a fixed number of draws), then the rows
            if d <= a:
                r = 0
            elif d <= o:
                r = 1 + _draw(rng, M.first_hit[d - 1]) if d == a + 1 else _draw(rng, M.detour_hit[d - 1])
            elif d == o + 1:
                r = K
            else:
                r = _draw(rng, M.detour[d - 1])
            ranks.append(r)
        rows = []
        for d, (r, tok) in enumerate(zip(ranks, right), start=1):
            scores = M.row(rng, d, r)
            width = len(scores)
            if width == 0:
                break
            wrong = [t for t in rng.sample(range(self.vocab_size), min(width + 1, self.vocab_size)) if t != tok]
            toks = wrong[:width]
            if r < width:
                toks[r:r] = [tok]
                toks = toks[:width]
            rows.append(list(zip(toks, scores))[: self.top_k])
        return rows

    def _lattice(self, q: DraftRequest) -> RowsLattice | None:
        held, n = self._slots.get(q.slot), len(q.committed)
        if held is None or len(held[1]) < n or held[1][:n] != q.committed:
            found = self.continuations.find(q.committed)
            if found is None:
                past_end = held is not None and q.committed[: len(held[1])] == held[1]
                self.counts["cut" if past_end else "unknown"] += 1
                return None
            held = (*found, prompt_key(found[1][: found[0]]))
            self._slots[q.slot] = held
        p, seq, key = held
        return self.lattice_at(seq[:p], seq, n - p, q.depth, key) if n > p else None


def prompt_key(prompt: Sequence[int]) -> str:
    """The stable hash (hex) of a prompt's ids that seeds its draws."""
    return hashlib.blake2b(str(list(prompt)).encode(), digest_size=16).hexdigest()


def build_calibrated(config, target, continuations: Continuations, slots: int = 1, seed: int = SEED,
                     static_step: bool = False) -> CalibratedDrafter:
    """The ``calibrated`` drafter of a :class:`~specpilot.config.SystemConfig` (its ``drafter_path`` names the
    calibration file) for ``target``, holding ``slots`` requests, reading ``continuations``; ``static_step``: a block
    cost drafter runs its steps from CUDA graphs (one slot's static step, or the batched one), as the real block
    drafter of a graphed engine does (else the simulated drafter costs what an eager block network does: 5 ms a
    propose against 0.5 ms graphed at the Qwen3-8B shape on an H200, for one request).

    Raises:
        DrafterError: no calibration file, an unreadable one (CalibrationError), ``depth`` / ``top_k`` beyond what
            it measured (refused, not clamped, as for a block drafter), or a cost spec that does not build.
    """
    if config.drafter_path is None:
        raise DrafterError("drafter 'calibrated' needs a calibration file (drafter_path, --drafter-path)")
    cal = load_calibration(config.drafter_path)
    if config.depth > cal.depth or config.top_k > cal.top_k:
        raise DrafterError(f"the calibration {config.drafter_path} measured {cal.depth} positions with {cal.top_k} "
                           f"candidates each: depth {config.depth}, top_k {config.top_k} asked for")
    cost = cost_drafter(cal.cost, target, config.top_k, slots, static_step=static_step)
    return CalibratedDrafter(cal, target.args.vocab_size, continuations, config.top_k, seed, cost, max(slots, 1024))
