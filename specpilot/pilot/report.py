"""Report writer: ``report.json``, ``report.md`` and PNG plots of a pilot run (paper §3, §4).

Expected keys of the report dict (every one optional; missing parts are shown as "—" or skipped):

- ``device`` (str or dict), ``deployment`` (dict: target, drafter, dtype, batch, ...).
- ``ar_tokens_per_s``, ``stock_tokens_per_s``, ``sealed_tokens_per_s``: throughput (tokens/s).
- ``speedup_vs_ar``, ``speedup_vs_stock``: ratios; ``speedup_ci_low``: 95% lower bound of speedup_vs_ar;
  ``speedup_vs_stock_ci_low``: 95% lower bound of speedup_vs_stock (paired bootstrap, §3.3).
- ``benchmarks``: ``{name: {requests, ar_tokens_per_s, stock_tokens_per_s, sealed_tokens_per_s, vs_ar,
  vs_ar_low, vs_stock, vs_stock_low}}`` from the seal's interleaved run (lower bounds None for a
  benchmark of one request); drawn as ``speedup.png``.
- ``tau``: tokens per exact pass of the sealed system; ``c``: its c(N) = T_step(N) / T_AR; ``ar_step_ms``,
  ``step_ms``, ``stock_c``, ``steps_method``: where they come from (one interleaved run).
- ``sealed_label``, ``sealed_seal``: the sealed system's label and SHA-256 seal.
- ``ceiling``: ``{tree, kernel, outside}`` factors of the sealed system (§3.2).
- ``token_forcing``: ``{mismatch_rate, events, event_rate, delta, tokens, stock_mismatch_rate,
  stock_event_rate, passed}`` (§3.4; rates are fractions).
- ``sigma``: stock noise σ (fraction).
- ``entries``: memory entries, each an id string or a dict with ``id``, ``title``, ``gain``, ``requires``.
- ``candidates``: list of dicts ``{round, name, gain, lower_bound, bar, outputs_differ, forcing_passed,
  mismatch_rate, predicted: {tau, c, c_screened}, approved, reason, entry, superseded_by, reused_from}``.
- ``rounds``: list of dicts ``{round, ceiling: {tree, kernel, outside}, attacked, incumbent, tau, c,
  tokens_per_s}`` (round 0 when AR was judged against stock).
- ``reused`` / ``memory_source``: per entry of an earlier memory (``--memory``): ``{id, status, reason,
  config, gain, lower_bound, entry}``.
- ``tau_curve``: ``{builder: {N: tau}}``; ``c_curve``: ``{N: c}`` (N may be int or str); ``c_curve_method``;
  ``c_measured``: ``[{label, N, c, source}]`` measured points drawn on the c plot.
- ``execution``: ``{mode: local | workers, slots: [[device, ...]], paired_devices, agent}`` (where the
  controller's runs ran: one slot judges one candidate; a two-device slot runs A and B on one device each,
  swapped half way).
- ``adversarial``: list of dicts ``{name, cheat, defence, gain, lower_bound, bar, outputs_differ,
  forcing_passed, approved, reason, defence_fired}`` (``pilot --adversarial``).

``plots`` may override the plot data: ``{"speedup": benchmarks, "tau_vs_n": {builder: {N: tau}}, "c_vs_n": {N: c},
"ceiling": [{round, tree, kernel, outside}]}``; otherwise it is taken from the report.
"""

from __future__ import annotations

import json
from pathlib import Path

from specpilot.pilot.report_md import render_markdown
from specpilot.pilot.report_plots import draw_plots


def _jsonable(o):
    """JSON fallback: numpy scalars/arrays, pydantic models, paths, the rest as str."""
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "model_dump"):
        return o.model_dump(mode="json")
    return str(o)


def write_report(out_dir: str | Path, report: dict, plots: dict | None = None) -> dict[str, Path]:
    """Write ``report.json``, ``report.md`` and the PNG plots into ``out_dir`` (created if needed).

    Args:
        out_dir: report directory.
        report: the report dict (keys in the module docstring; all optional).
        plots: optional plot data overriding the report's ``tau_curve`` / ``c_curve`` / ``rounds``.
    Returns:
        ``{name: path}`` of every file written (``report.json``, ``report.md`` and each plot drawn; a plot
        without data is skipped).
    Raises:
        OSError: when ``out_dir`` cannot be written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = draw_plots(out, report, plots or {})
    (out / "report.json").write_text(json.dumps(report, indent=2, default=_jsonable) + "\n")
    written["report.json"] = out / "report.json"
    (out / "report.md").write_text(render_markdown(report, [n for n in written if n.endswith(".png")]))
    written["report.md"] = out / "report.md"
    return written
