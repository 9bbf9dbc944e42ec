"""The ceiling of a system on this deployment (paper §3.2): tree × kernel × outside-profile factors.

:func:`ceiling` measures the system's decode steps interleaved with AR, profiles the same requests by kernel
class, counts each class's FLOPs and bytes for the byte floor, and takes τ_best from exact replay
(:func:`tree_tau_best`). Each round attacks the largest factor; the seal reports the sealed system's.
"""

from __future__ import annotations

from specpilot.config import SystemConfig
from specpilot.pilot.costmodel import Ceiling, build_ceiling, pass_launches, step_counts
from specpilot.pilot.profiler import StepProfiler, measure_peaks
from specpilot.pilot.replay import replay
from specpilot.pilot.state import Pilot


def ceiling(pilot: Pilot, cfg: SystemConfig) -> tuple[Ceiling, dict]:
    """Profile ``cfg``'s decode steps by kernel class and assemble its ceiling (§3.2); T_step and T_AR
    come from one interleaved measurement. Re-measures the device peaks first and keeps the higher (warning
    when they rose: the setup's were taken on a busy machine). Sets ``pilot.tau_best_source``.

    Returns:
        (:class:`Ceiling`, :meth:`Pilot.measure` dict of the same requests).
    """
    again = measure_peaks(pilot.o.device, pilot.dep.target.dtype, seconds_budget=1.0)
    pilot.peaks, warning = pilot.peaks.rechecked(again)  # a busy machine at setup must not shrink the floor
    if warning:
        pilot.say("ceiling", f"[yellow]warning: {warning}[/]")
    m = pilot.measure(cfg, n=4)
    eng, prof = pilot.engine(cfg), StepProfiler(pilot.o.device)
    target = pilot.dep.target
    steps, prefix = 0, []
    for req in pilot.spread(4):  # the same requests as the unprofiled step time above
        g = eng.generate(list(req.prompt_ids), req.max_new_tokens, prof=prof)
        steps += g.steps
        prefix.append(len(req.prompt_ids) + len(g.tokens) // 2)
    totals = prof.calibrated_totals_ms()  # less the profiler's own per-region cost
    if "exact_pass" in totals:  # one graph replay per step: split by the pass's kernel classes
        exact = totals.pop("exact_pass")
        if target.device.type == "cuda":  # profiled in a child process: the profiler would slow this one
            from specpilot.pilot.kernel_profile import pass_class_fractions_isolated

            rows = min(max(1, round(m["rows"])), 256)
            dep, at = pilot.dep, int(sum(prefix) / len(prefix))
            try:
                fractions = pass_class_fractions_isolated(str(dep.target_dir), dep.dtype, dep.device, rows, at)
            except RuntimeError as e:  # keep the run going; later live figures may then read slow
                from specpilot.pilot.kernel_profile import pass_class_fractions

                pilot.say("ceiling", f"[yellow]warning: {e}; profiling in this process instead (the profiler then "
                                     "slows this process's later kernel launches)[/]")
                fractions = pass_class_fractions(target, rows, at)
        else:
            fractions = {"other": 1.0}
        for k, f in fractions.items():
            totals[k] = totals.get(k, 0.0) + exact * f
    d_args = pilot.dep.draft_model.args if cfg.drafter == "draft_model" else None
    counts = step_counts(target.args, max(1, round(m["rows"])), int(sum(prefix) / len(prefix)),
                         target.dtype.itemsize, drafter_args=d_args, drafter_passes=cfg.depth)
    launches = pass_launches(target.args, target.fused_on(target.model.embed_tokens.weight))
    if d_args is not None:  # the draft model's passes, op by op, under "drafter"
        launches["drafter"] = cfg.depth * sum(pass_launches(d_args, False).values())
    tau_best, pilot.tau_best_source = tree_tau_best(pilot.planner, cfg, m["tau"], pilot.stock.nodes)
    ceil = build_ceiling(totals, counts, pilot.peaks, m["step_ms"], m["tau"], tau_best, steps=max(steps, 1),
                         ar_ms=m["ar_step_ms"], rows=round(m["rows"]), launches=launches)
    return ceil, m


def tree_tau_best(planner, cfg: SystemConfig, tau: float, ar_nodes: int) -> tuple[float, str]:
    """τ_best of the ceiling's tree factor (§3.2, "τ that any tree could accept"): the best top-K oracle τ (exact
    replay, §2.4) over every recorded drafter at ``cfg``'s budget N, and its source.

    The oracle of ``cfg``'s own drafter alone would hide a better drafter: an n-gram incumbent's own oracle (1.3 on
    SmolLM2) sat below a recorded EAGLE-3 head's *replayed* τ (2.6), so the pilot attacked kernels instead of the
    drafter. So every recording counts, each at its own depth and K. AR (drafter ``none``, N = 1) is probed at
    ``ar_nodes`` nodes (the stock budget), so a round after "speculation off" still sees the speculation headroom.

    Args:
        planner: :class:`Planner` holding the recordings (keys ``(kind, K)``; checkpoints ``"<kind>:<dir>"``).
        cfg: the incumbent. tau: its measured τ (τ_best is at least it). ar_nodes: N to probe AR at.
    Returns:
        ``(tau_best, source)``: source names the drafter, K and N of the best oracle.
    """
    nodes = ar_nodes if cfg.drafter == "none" else cfg.nodes
    best, src = tau, ("AR: no drafter recorded" if cfg.drafter == "none" else f"measured τ of {cfg.drafter}")
    for (kind, k), rec in planner.recordings.items():
        probe = cfg.model_copy(update={"nodes": nodes, "depth": rec.depth, "top_k": k})
        t = replay(rec, probe, policy="oracle")[0]
        if t > best:
            own = kind == cfg.drafter or (kind.startswith(cfg.drafter + ":") and rec.drafter_path == cfg.drafter_path)
            who = "own drafter" if own else "best recorded drafter"
            best, src = t, f"{who}'s oracle ({kind}, top-{k}, N={nodes})"
    return best, src
