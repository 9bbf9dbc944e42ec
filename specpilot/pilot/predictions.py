"""The cost model's self-check (§3.2): did the planner's predictions hold against what the pilot measured?

Every candidate the pilot screens gets a predicted c (and replay τ) from the planner and a live c (and τ) from
its decode steps interleaved with AR; this module scores the predictions, which the report prints beside the
candidates, so a user sees whether the ranking that chose the candidates can be trusted on this deployment.
"""

from __future__ import annotations

import statistics
#: The bar predictions must clear (§3.2): median |c_predicted / c_live − 1| and rank correlation, over at least
#: this many screened candidates.
PREDICTION_MAX_ERROR, PREDICTION_MIN_SPEARMAN, PREDICTION_MIN_CANDIDATES = 0.10, 0.8, 5


def prediction_check(predictions: list[dict]) -> dict:
    """How well the planner's c held against the live c of every candidate it had screened (§3.2).

    Args:
        predictions: ``[{name, c_predicted, c_live, tau_replay, tau_live}]``, one per screened candidate
            (:attr:`~specpilot.pilot.state.Pilot.predictions`).
    Returns:
        ``{candidates, median_abs_error, spearman, tau_median_abs_error, holds, bar}``: the median of
        ``|c_predicted / c_live − 1|`` (a fraction), Spearman's ρ between predicted and live c (None under 3
        candidates or when either side is constant), the same median error for replay τ against live τ, and
        whether the bar (:data:`PREDICTION_MAX_ERROR`, :data:`PREDICTION_MIN_SPEARMAN`,
        :data:`PREDICTION_MIN_CANDIDATES`) holds.
    """
    from scipy.stats import spearmanr

    pairs = [(p["c_predicted"], p["c_live"]) for p in predictions if p.get("c_live")]
    err = statistics.median(abs(a / b - 1) for a, b in pairs) if pairs else None
    taus = [abs(p["tau_replay"] / p["tau_live"] - 1) for p in predictions if p.get("tau_live")]
    rho = None
    if len(pairs) >= 3 and len({a for a, _ in pairs}) > 1 and len({b for _, b in pairs}) > 1:
        rho = float(spearmanr([a for a, _ in pairs], [b for _, b in pairs]).statistic)
    holds = (len(pairs) >= PREDICTION_MIN_CANDIDATES and err is not None and err <= PREDICTION_MAX_ERROR
             and rho is not None and rho >= PREDICTION_MIN_SPEARMAN)
    return {"candidates": len(pairs), "median_abs_error": err, "spearman": rho,
            "tau_median_abs_error": statistics.median(taus) if taus else None, "holds": holds,
            "bar": f"median |c_predicted / c_live - 1| <= {PREDICTION_MAX_ERROR:.0%} and Spearman >= "
                   f"{PREDICTION_MIN_SPEARMAN} over >= {PREDICTION_MIN_CANDIDATES} screened candidates"}
