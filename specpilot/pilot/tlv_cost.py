"""The cost model's price of a TLV cycle (§3.2, §4.3), so the planner can propose TLV and the controller judge it.

TLV breaks the ceiling's assumption of one draft per exact pass: a cycle is draft ① + Q pass + (draft ② when the
chain leaves room under the budget) + the exact pass. Its τ (tokens per exact pass) comes from exact replay of the
cycles (:func:`~specpilot.pilot.replay_tlv.replay_tlv_steps` over the Q passes recorded along the AR outputs), and
its time per exact pass is

    T_spec + mean T_pass(exact rows) + mean T_Q(Q rows) + mean (number of drafts) · (T_draft + T_tree)

with ``T_Q`` the Q view's pass measured by rows like the exact pass, and ``T_spec``, ``T_pass``, ``T_draft``,
``T_tree`` the planner's (:class:`~specpilot.pilot.planner.Planner`). Not priced: moves of accepted paths (C's rows
are in place; only a subtree path that is not moves) and the Q pass's feature hand-over to a feature-reading drafter.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specpilot.config import SystemConfig
from specpilot.pilot.replay_tlv import QRecording, replay_tlv_steps


@dataclass
class TlvInputs:
    """What the planner needs to price TLV: the Q passes along the recorded AR outputs (``qrec``, of the Q view
    ``weights``), the Q pass's measured time by rows (``q_ms``, ``{rows: ms}``) and its agreement with the exact
    pass (``agreement``, :meth:`QRecording.agreement`).

    A calibrated deployment whose calibration measured the real pair's Q agreement adds ``simulated``: the Q chains
    a :class:`~specpilot.spec.calibrated_q.SimulatedQPass` answers along the same AR outputs, used for configs of
    the ``calibrated`` drafter of that calibration file (``simulated_path``); ``simulated_agreement`` is their
    agreement, labelled SIMULATED in the report. Every other config is priced with the real Q view's ``qrec``."""

    qrec: QRecording
    q_ms: dict[int, float]
    weights: str = "view8"
    agreement: dict | None = None
    simulated: QRecording | None = None
    simulated_path: str | None = None
    simulated_agreement: dict | None = None

    def qrec_for(self, cfg: SystemConfig) -> QRecording:
        """The Q chains ``cfg`` is replayed over: the simulated ones for the calibrated drafter of
        :attr:`simulated_path`, else the real Q view's."""
        if self.simulated is not None and cfg.drafter == "calibrated" and cfg.drafter_path == self.simulated_path:
            return self.simulated
        return self.qrec

    def q_time(self, rows: float) -> float:
        """Q-pass time for ``rows`` rows, ms (the measured times made monotone, interpolated); 0 for no rows."""
        from specpilot.pilot.planner import monotone

        if rows <= 0:
            return 0.0
        xs = np.array(sorted(self.q_ms), dtype=float)
        return float(np.interp(rows, xs, monotone([self.q_ms[r] for r in sorted(self.q_ms)])))

    def subset(self, requests: list[int] | None, cfg: SystemConfig | None = None) -> QRecording:
        """The Q recording of ``requests`` (None: all), the one :meth:`qrec_for` ``cfg`` picks (None: the real)."""
        q = self.qrec if cfg is None else self.qrec_for(cfg)
        return q if requests is None else QRecording([q.chains[i] for i in requests], q.depth, q.weights)


def predict_tlv(planner, cfg: SystemConfig, tlv: TlvInputs, requests: list[int] | None = None):
    """The planner's :class:`~specpilot.pilot.planner.Prediction` of ``cfg`` with ``tlv`` on (module docstring), or
    None when it cannot be replayed (no recording of its drafter, deeper than recorded, other Q weights).

    Args:
        planner: the :class:`~specpilot.pilot.planner.Planner` (its recordings and measured times).
        cfg: a config with ``tlv`` set. tlv: the :class:`TlvInputs`.
        requests: indices of the recorded requests to predict over (None: all).
    """
    from specpilot.pilot.planner import Prediction

    rec = planner.recording(cfg)
    if rec is None or cfg.q_weights != tlv.weights or cfg.depth > tlv.qrec.depth:
        return None
    steps = replay_tlv_steps(rec if requests is None else rec.subset(requests), tlv.subset(requests, cfg), cfg)
    if not steps:
        return None
    n = len(steps)
    tau = sum(s[0] for s in steps) / n
    single = [(k, r) for k, r, _, _ in steps]
    exact = float(np.mean([planner.verify_time(r, rec.target_layers, cfg.w12) for _, r, _, _ in steps]))
    q_pass = float(np.mean([tlv.q_time(q) for _, _, q, _ in steps]))
    drafts = float(np.mean([1 + (q > 0 and c < cfg.nodes) for _, _, q, c in steps]))
    per_draft = planner.draft_time(cfg, single, requests) + planner.tree_time(cfg, single)
    c = (planner.overhead(cfg) + exact + q_pass + drafts * per_draft) / planner.ar_ms
    return Prediction(tau, c, tau / c)


__all__ = ["TlvInputs", "predict_tlv"]
