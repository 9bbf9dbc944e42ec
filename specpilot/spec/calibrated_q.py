"""Simulated Q-pass agreement for TLV (§4.3) on a random-weight target: a real pair's measured agreement, replayed.

TLV's value is how often the Q pass's argmax (the target's 8-bit view) agrees with the exact pass: 97.9% of root
rows on the bundled pair, about 42% on random weights (measured at the Qwen3-8B shape), where no real pair's
agreement can be seen. As the calibrated drafter does for acceptance (:mod:`specpilot.spec.calibrated`), this module
carries a real pair's agreement over to a random target whose greedy continuation of each request is known
(:class:`~specpilot.spec.calibrated.Continuations`):

- :func:`measure_q_agreement`: along the real pair's AR outputs, per chain row ``j`` (0 = the root row), how many
  rows were reached with every earlier row agreeing (``reached``) and how many of those agreed (``hits``); stored in
  the calibration file (``q_agreement``);
- :class:`QSimulation`: at committed length ``m`` of a prompt, whether row ``j`` of the known path "agrees": a draw
  with probability ``hits[j] / reached[j]`` from a generator seeded by (seed, the prompt's hash, ``m``), so the live
  engine (:class:`SimulatedQPass`) and the pilot's replay (:func:`simulated_chains`) see the same draws;
- :class:`SimulatedQPass`: wraps the engine's real :class:`~specpilot.engine.tlv.QPass`, which still runs (its time
  is real), and replaces the argmax of each row on the known path: the known next token if its draw agrees, else a
  deterministic wrong token (``(right + 1) mod V``). Rows off the known path keep the real Q argmax.

Lossless whatever the draws: only the exact pass commits (§4.3). What it does not simulate: agreement that depends on
the text (draws are independent given the chain row), and the Q pass's features a feature-reading drafter is handed
(they are the real Q view's, of a random target).
"""

from __future__ import annotations

import random
from typing import Sequence

from specpilot.spec.calibrated import CalibratedDrafter, _seed, prompt_key


def measure_q_agreement(ar: Sequence[Sequence[int]], chains: Sequence[dict[int, list[int]]], depth: int,
                        weights: str) -> dict:
    """The Q view's agreement per chain row, for a calibration file's ``q_agreement``.

    Args:
        ar: per request its AR output (token ids).
        chains: per request ``{m: [q_0, …, q_L]}``, the Q argmax along the AR chain from the root at committed
            length ``m`` (``q_j`` guesses ``ar[m + j]``; :attr:`specpilot.pilot.replay_tlv.QRecording.chains`).
        depth: D: rows ``0 … D`` are counted. weights: the Q view's weights (``view8`` …).
    Returns:
        ``{"weights", "reached": [D + 1], "hits": [D + 1]}``: row j reached (known target token, every row before
        it agreed) and agreed, summed over requests and committed lengths.
    """
    reached, hits = [0] * (depth + 1), [0] * (depth + 1)
    for out, per_m in zip(ar, chains):
        for m, q in per_m.items():
            for j, tok in enumerate(q[: depth + 1]):
                if m + j >= len(out):
                    break
                reached[j] += 1
                if tok != out[m + j]:
                    break
                hits[j] += 1
    return {"weights": weights, "reached": reached, "hits": hits}


def is_simulated(cal, weights: str) -> bool:
    """Whether TLV's Q pass of Q view ``weights`` is simulated with the calibration ``cal`` (it carries an agreement
    measured with those weights)."""
    return cal.q_agreement is not None and cal.q_agreement["weights"] == weights


def q_simulation_note(cal) -> str:
    """The line a report prints beside TLV figures of a calibrated system whose Q agreement is simulated."""
    qa = cal.q_agreement
    return (f"SIMULATED Q-pass agreement (TLV): the Q pass runs for real on this target (its time is real) but its "
            f"argmax along the known greedy path follows the real pair's measured {qa['weights']} agreement "
            f"({qa['hits'][0]}/{qa['reached'][0]} root rows), drawn per prompt and position")


class QSimulation:
    """Seeded agreement draws of a calibration's ``q_agreement`` (module docstring).

    Args:
        q_agreement: ``{"weights", "reached", "hits"}`` (:func:`measure_q_agreement`; a checked calibration's).
        vocab_size: V, the target's vocabulary (wrong tokens stay in ``[0, V)``).
        seed: the draws' seed (the calibrated drafter's, so paired runs and replay see the same draws).

    Attributes:
        probs: ``[D + 1]`` P(row j agrees | every earlier row agreed); 0.0 where no row j was reached.
        weights: the Q view it was measured with.
    """

    def __init__(self, q_agreement: dict, vocab_size: int, seed: int = 0):
        self.probs = [h / n if n else 0.0 for h, n in zip(q_agreement["hits"], q_agreement["reached"])]
        self.weights, self.vocab_size, self.seed = q_agreement["weights"], vocab_size, seed

    def agrees(self, key: str, m: int, rows: int) -> list[bool]:
        """Whether chain rows ``0 … rows - 1`` agree at committed length ``m`` (≥ 1) of the prompt with
        :func:`~specpilot.spec.calibrated.prompt_key` ``key``; rows past D use row D's probability. Deterministic
        in (seed, key, m); a shorter list is a prefix of a longer one."""
        rng = random.Random(_seed(self.seed, key, "q", m))
        return [rng.random() < self.probs[min(j, len(self.probs) - 1)] for j in range(rows)]

    def answer(self, right: int, agrees: bool) -> int:
        """The simulated argmax of a row whose exact argmax is ``right``: it, or ``(right + 1) mod V``."""
        return right if agrees else (right + 1) % self.vocab_size


def simulated_chains(prompts: Sequence[Sequence[int]], ar: Sequence[Sequence[int]], sim: QSimulation,
                     depth: int) -> list[dict[int, list[int]]]:
    """The Q chains a live :class:`SimulatedQPass` answers along the AR outputs, in the form of
    :attr:`specpilot.pilot.replay_tlv.QRecording.chains`: per request ``{m: [q_0, …]}`` for m in ``1 … len - 1``,
    rows ``j`` with ``m + j < len(ar)`` and ``j ≤ depth``."""
    out = []
    for prompt, seq in zip(prompts, ar):
        key, chains = prompt_key(list(prompt)), {}
        for m in range(1, len(seq)):
            n = min(depth + 1, len(seq) - m)
            chains[m] = [sim.answer(seq[m + j], ok) for j, ok in enumerate(sim.agrees(key, m, n))]
        out.append(chains)
    return out


class SimulatedQPass:
    """TLV's Q pass with a calibrated agreement (module docstring): the real pass runs, its answer on the known path
    is replaced. Same interface as :class:`~specpilot.engine.tlv.QPass` (``run``, ``features``).

    Args:
        real: the engine's :class:`~specpilot.engine.tlv.QPass` (run for every call: its cost and features).
        sim: the :class:`QSimulation` of the calibration.
        continuations: the known greedy continuations (the calibrated drafter's
            :class:`~specpilot.spec.calibrated.Continuations`).

    Attributes:
        counts: ``rows`` replaced (on the known path), ``agreed`` of those, ``passes`` run.
    """

    simulated = True

    def __init__(self, real, sim: QSimulation, continuations):
        self.real, self.sim, self.continuations = real, sim, continuations
        self.counts = {"passes": 0, "rows": 0, "agreed": 0}

    @property
    def features(self):
        """The real Q pass's features of its last pass ``[R, F]`` (or None)."""
        return self.real.features

    def run(self, tok_list: list[int], pos_list: list[int], start: int, tree, prof=None,
            committed: list[int] | None = None) -> list[int]:
        """The real Q pass over the rows (:meth:`QPass.run`), then each row on the known path of ``committed``
        (the committed tokens, ``committed[-1]`` the root) answered by the simulation. Without ``committed``, or
        when no known continuation extends it, the real argmax is returned."""
        out = self.real.run(tok_list, pos_list, start, tree, prof, committed=committed)
        self.counts["passes"] += 1
        found = self.continuations.find(committed) if committed else None
        if found is None or len(committed) <= found[0]:
            return out
        p, seq = found
        n, key = len(committed), prompt_key(seq[:p])
        on = [True]  # per row (root = 0): its path from the root is the known continuation
        for tok, parent, d in zip(tree.tokens, tree.parents, tree.depths):
            on.append(on[parent + 1] and n + d - 1 < len(seq) and seq[n + d - 1] == tok)
        depths = [0] + list(tree.depths)
        rows = [r for r in range(len(out)) if on[r] and n + depths[r] < len(seq)]
        if not rows:
            return out
        agrees = self.sim.agrees(key, n - p, 1 + max(depths[r] for r in rows))
        for r in rows:
            j = depths[r]
            out[r] = self.sim.answer(seq[n + j], agrees[j])
            self.counts["rows"] += 1
            self.counts["agreed"] += agrees[j]
        return out


def simulated_q(real, drafter, weights: str):
    """The Q pass an engine uses: a :class:`SimulatedQPass` around ``real`` when ``drafter`` is a
    :class:`~specpilot.spec.calibrated.CalibratedDrafter` whose calibration carries ``q_agreement`` measured with the
    Q view ``weights`` (the config's ``q_weights``), else ``real`` itself."""
    if not isinstance(drafter, CalibratedDrafter) or not is_simulated(drafter.cal, weights):
        return real
    return SimulatedQPass(real, QSimulation(drafter.cal.q_agreement, drafter.vocab_size, drafter.seed),
                          drafter.continuations)


__all__ = ["measure_q_agreement", "is_simulated", "q_simulation_note", "QSimulation", "simulated_chains",
           "SimulatedQPass", "simulated_q"]
