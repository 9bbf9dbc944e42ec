"""PNG plots of a pilot run: speedup per benchmark, τ vs N, c vs N and the ceiling factors per round (§3.2)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

FACTORS = ("tree", "kernel", "outside")


def _curve(d) -> tuple[list[float], list[float]]:
    """Sorted (N, value) pairs of a ``{N: value}`` dict with int/str keys."""
    pts = sorted((float(k), float(v)) for k, v in (d or {}).items() if v is not None)
    return [p[0] for p in pts], [p[1] for p in pts]


def _plot_tau(path: Path, data: dict) -> bool:
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    drew = False
    for builder, curve in (data or {}).items():
        x, y = _curve(curve)
        if x:
            ax.plot(x, y, marker="o", label=str(builder))
            drew = True
    if not drew:
        return False
    ax.set(xlabel="tree budget N (nodes)", ylabel="τ (tokens / exact pass)", title="τ vs N per drafter / tree builder")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return True


def _plot_c(path: Path, data: dict, measured: list | None = None) -> bool:
    x, y = _curve(data)
    pts = [(float(p["N"]), float(p["c"])) for p in (measured or []) if isinstance(p, dict)
           and isinstance(p.get("N"), (int, float)) and isinstance(p.get("c"), (int, float))]
    if not x and not pts:
        return False
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    if x:
        ax.plot(x, y, marker="o", label="cost model, drafting excluded")
    labels = [p.get("label", "") for p in measured or [] if isinstance(p, dict)
              and isinstance(p.get("N"), (int, float)) and isinstance(p.get("c"), (int, float))]
    for i, ((n, c), lab) in enumerate(zip(pts, labels)):
        ax.scatter([n], [c], marker="x", s=50, zorder=3, color=f"C{(i + 1) % 10}", label=f"measured: {lab}"[:60])
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set(xlabel="tree nodes N (rows verified − 1)", ylabel="c(N) = T_step(N) / T_AR",
           title="c(N): model curve; crosses: step time over AR's, interleaved")
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return True


def _plot_speedup(path: Path, benchmarks: dict) -> bool:
    """Bar chart of the sealed system's gain per benchmark vs AR and vs stock; the whisker runs down to the
    one-sided 95% lower bound (none for a benchmark of one request)."""
    names = list(benchmarks or {})
    if not names:
        return False
    fig = Figure(figsize=(max(6, 1.4 * len(names)), 4))
    ax = fig.add_subplot()
    w = 0.38
    for j, base in enumerate(("ar", "stock")):
        g = [float(benchmarks[n].get(f"vs_{base}") or 0.0) for n in names]
        low = [benchmarks[n].get(f"vs_{base}_low") for n in names]
        err = [[max(gi - lo, 0.0) if isinstance(lo, (int, float)) else 0.0 for gi, lo in zip(g, low)], [0.0] * len(g)]
        ax.bar([i + j * w for i in range(len(names))], g, w, yerr=err, capsize=4, label=f"sealed vs {base.upper() if base == 'ar' else base}")
    ax.set_xticks([i + w / 2 for i in range(len(names))], names)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(ylabel="speedup (×), whisker: 95% lower bound", title="speedup per benchmark (seal's interleaved run)")
    ax.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return True


def ceiling_rows(rounds: list) -> list[tuple[str, dict]]:
    """``(label, {tree, kernel, outside})`` of every round with ceiling factors, round 0 included, in order;
    a row with ``round == "sealed"`` is labelled ``sealed``."""
    rows = [(f"round {rd.get('round', i)}" if rd.get("round") != "sealed" else "sealed", rd.get("ceiling", rd))
            for i, rd in enumerate(rounds or [])]
    return [(n, c) for n, c in rows if isinstance(c, dict) and any(c.get(f) is not None for f in FACTORS)]


def _plot_ceiling(path: Path, rounds: list) -> bool:
    rows = ceiling_rows(rounds)
    if not rows:
        return False
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    w = 0.8 / len(FACTORS)
    for j, f in enumerate(FACTORS):
        ax.bar([i + j * w for i in range(len(rows))], [float(c.get(f) or 0.0) for _, c in rows], w, label=f)
    ax.set_xticks([i + w for i in range(len(rows))], [n for n, _ in rows])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(ylabel="ceiling factor (×)", title="ceiling factors per round")
    ax.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return True


def draw_plots(out: Path, report: dict, plots: dict) -> dict[str, Path]:
    """Draw ``speedup.png``, ``tau_vs_n.png``, ``c_vs_n.png`` and ``ceiling.png`` into ``out`` from the report
    dict (``plots`` overrides their data, see :func:`specpilot.pilot.report.write_report`); a plot without data
    is skipped. Returns ``{file name: path}`` of the plots drawn.

    Raises:
        OSError: when ``out`` cannot be written.
    """
    written: dict[str, Path] = {}
    ceiling_data = plots.get("ceiling")
    if ceiling_data is None:  # every round (round 0 included) and the sealed system
        ceiling_data = list(report.get("rounds") or [])
        if isinstance(report.get("ceiling"), dict):
            ceiling_data.append({"round": "sealed", "ceiling": report["ceiling"]})
    for name, fn, data in (
        ("speedup.png", _plot_speedup, plots.get("speedup", report.get("benchmarks"))),
        ("tau_vs_n.png", _plot_tau, plots.get("tau_vs_n", report.get("tau_curve"))),
        ("c_vs_n.png", lambda p, d: _plot_c(p, d, report.get("c_measured")), plots.get("c_vs_n", report.get("c_curve"))),
        ("ceiling.png", _plot_ceiling, ceiling_data),
    ):
        if fn(out / name, data):
            written[name] = out / name
    return written
