"""Memory reuse on a new deployment (paper §3.5: "a new deployment starts from stock plus the verified
entries in memory"; reused entries are re-tuned and re-measured, not counted as new discoveries).

``specpilot pilot --memory DIR``: after Phase 0 (before round 0 and the rounds), every entry of ``DIR``
is visited in ``requires`` order (requirements first):

- a **config** entry is rebuilt as this deployment's stock + the entry's chain of deltas, re-tuned over a
  small neighbourhood of its options (nodes / depth / top_k, ranked by the cost model, screened live
  against AR) and judged by the controller against the current incumbent (paired run + token forcing).
  Approved, it becomes the incumbent and an entry of this run's memory with ``reused_from`` set and its
  new evidence; otherwise it did not carry over, with the controller's reason;
- a **patch** entry (a code delta) is not applied by the pilot: it is skipped with the reason, unless
  this code base already is its approved code (same git tree), in which case it is in every system built
  here and is listed as such.

Entries that cannot be read, whose delta does not apply, or whose drafter this deployment lacks are
listed with the reason. The normal rounds continue from the resulting incumbent.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from specpilot.config import SystemConfig
from specpilot.errors import SpecPilotError
from specpilot.pilot.memory import Entry, Memory, MemoryEntryError, default_repo
from specpilot.pilot.patches import head_state

#: How many re-tuned variants of an entry are screened live (the entry's own options always included).
SCREENED = 3


def open_source(directory: str | Path) -> Memory:
    """The memory directory given with ``--memory``.

    Raises:
        SpecPilotError: ``directory`` does not exist, holds no entry, or none of its entries can be used
            (all corrupted, missing requirements, or in a cycle): said before Phase 0, not after it.
    """
    d = Path(directory)
    if not d.is_dir():
        raise SpecPilotError(f"--memory {d}: " + ("is a file, not a memory directory" if d.exists() else "no such directory"))
    mem = Memory(d)
    if not mem.ids():
        hint = f"; a pilot's report directory? its entries are in {d / 'memory'}" if (d / "memory").is_dir() else ""
        raise SpecPilotError(f"--memory {d}: no memory entries (sub-directories with entry.json) in it{hint}")
    usable, broken = ordered(mem)
    if not usable:
        first = next(iter(broken.items()))
        raise SpecPilotError(f"--memory {d}: none of its {len(broken)} entries can be used (e.g. {first[0]}: {first[1]}); "
                             "check them with `specpilot memory check`")
    return mem


def ordered(src: Memory) -> tuple[list[Entry], dict[str, str]]:
    """Entries of ``src`` in ``requires`` order (requirements first), and ``{id: reason}`` of those that
    cannot be used (corrupted, a missing requirement, a requirement cycle)."""
    broken: dict[str, str] = {}
    for i in src.ids():
        try:
            src.order([i])
        except MemoryEntryError as e:
            broken[i] = str(e)
    return src.order([i for i in src.ids() if i not in broken]), broken


def code_tree(repo: Path | None = None) -> str | None:
    """Git tree id of this code base (``HEAD^{tree}``), or None when it is not a clean git checkout."""
    try:
        _, tree, dirty = head_state(repo or default_repo())
    except ValueError:
        return None
    return None if dirty else tree


def patch_status(entry: Entry, tree: str | None) -> tuple[str, str]:
    """``(status, reason)`` of a patch entry on this code base: ``in code base`` when the code base is
    the entry's approved code (same git tree), else ``not carried over``."""
    want = entry.system.get("tree", "?")
    if tree is not None and tree == want:
        return "in code base", f"this code base is its approved code (git tree {want[:12]}): in every system here"
    here = "not a clean git checkout" if tree is None else f"git tree {tree[:12]}"
    return "not carried over", (f"patch entry skipped: code deltas are not applied by the pilot, and this code base "
                                f"({here}) is not its approved code (tree {want[:12]}, stock {entry.base.get('commit', '?')[:12]})")


def neighbourhood(cfg: SystemConfig, depth_max: int) -> list[SystemConfig]:
    """``cfg`` and its neighbours over nodes (×2/3, ×3/2), depth (±2, at most ``depth_max`` unless
    ``cfg``'s is larger) and top_k (÷2, ×2, at most 16); chains keep nodes = depth, top_k = 1; AR
    (drafter ``none``) has no options. ``cfg`` comes first.
    """
    if cfg.drafter == "none":
        return [cfg]
    cap = max(depth_max, cfg.depth)
    depths = sorted({d for d in (cfg.depth - 2, cfg.depth, cfg.depth + 2) if 1 <= d <= cap})
    out = [cfg]
    if cfg.tree == "chain":
        out += [cfg.model_copy(update={"depth": d, "nodes": d}) for d in depths]
    else:
        nodes = sorted({n for n in (round(cfg.nodes * 2 / 3), cfg.nodes, round(cfg.nodes * 3 / 2)) if 1 <= n <= 256})
        ks = sorted({k for k in (cfg.top_k // 2, cfg.top_k, cfg.top_k * 2) if 1 <= k <= max(16, cfg.top_k)})
        out += [cfg.model_copy(update={"nodes": n, "depth": d, "top_k": k}) for n in nodes for d in depths for k in ks]
    valid = []
    for c in out:
        try:
            valid.append(SystemConfig(**c.model_dump()))
        except ValidationError:
            continue
    return list(dict.fromkeys(valid))


def retune(pilot, cfg: SystemConfig, inc_m: dict) -> tuple[SystemConfig, dict]:
    """Re-tune ``cfg`` on this deployment: rank its :func:`neighbourhood` by the planner's predicted
    speedup (exact replay τ / modelled c), screen the best few plus ``cfg`` itself live (step times
    interleaved with AR, :meth:`Pilot.measure`), and return the best by screened speedup with its
    figures ``{tau, c, speedup, c_screened, speedup_screened, variants}`` (τ: replay when available,
    else live; c: T_step / T_AR from one interleaved measurement)."""
    preds = []
    for c in neighbourhood(cfg, pilot.plan["depth_max"]):
        p = pilot.planner.predict(c)
        preds.append((c, p))
    ranked = [cfg] + [c for c, p in sorted((cp for cp in preds if cp[1] is not None), key=lambda cp: -cp[1].speedup)
                      if c != cfg][: SCREENED - 1]
    best = None
    for c in ranked:
        m = pilot.measure(c, n=3)
        p = dict(preds)[c]
        tau = p.tau if p is not None else m["tau"]
        fig = {"tau": tau, "c": p.c if p is not None else None, "speedup": p.speedup if p is not None else None,
               "c_screened": m["c"], "speedup_screened": tau / m["c"], "tau_live": m["tau"]}
        if best is None or fig["speedup_screened"] > best[1]["speedup_screened"]:
            best = (c, fig)
    best[1]["variants"] = len(ranked)
    best[1]["incumbent_speedup_screened"] = inc_m["tau"] / inc_m["c"]
    return best


def reuse_memory(pilot, source: Memory, incumbent: SystemConfig, memory: Memory, entries: list, candidates: list,
                 tried: set) -> tuple[SystemConfig, list[dict]]:
    """Re-tune and re-measure every entry of ``source`` on this deployment (module doc); returns the new
    incumbent and one row per source entry ``{id, kind, status, reason, ...}`` for the report. Approved
    entries are added to ``memory`` and ``entries`` with ``reused_from`` set; their paired runs are
    appended to ``candidates`` (round ``"memory"``).
    """
    chain, broken = ordered(source)
    rows = [{"id": i, "kind": "?", "status": "not carried over", "reason": why} for i, why in broken.items()]
    tree = code_tree() if any(e.kind == "patch" for e in chain) else None
    for e in chain:
        row = {"id": e.id, "kind": e.kind, "title": e.title, "origin": str(source.root / e.id),
               "origin_gain": e.evidence.gain, "origin_deployment": e.evidence.deployment}
        rows.append(row)
        if e.kind == "patch":
            row["status"], row["reason"] = patch_status(e, tree)
            pilot.say("memory", f"{e.id}: {row['status']}: {row['reason']}")
            continue
        try:
            cfg = source.apply(pilot.stock, [e.id])
            pilot.dep.system(cfg)  # its drafter exists on this deployment
        except (MemoryEntryError, SpecPilotError, OSError, ValueError) as err:
            row["status"], row["reason"] = "not carried over", f"cannot be built here: {str(err).splitlines()[0]}"
            pilot.say("memory", f"{e.id}: {row['reason']}")
            continue
        row["recorded"] = cfg.label()
        if cfg.seal() == incumbent.seal():
            row["status"], row["reason"] = "not carried over", "stock + its chain is already the incumbent: nothing to measure"
            continue
        inc_m = pilot.measure(incumbent, n=3)
        cand, fig = retune(pilot, cfg, inc_m)
        row["config"], row["predicted"] = cand.label(), fig
        if cand.seal() in tried:
            row["status"], row["reason"] = "not carried over", f"re-tuned to {cand.label()}, already judged in this run"
            continue
        tried.add(cand.seal())
        pilot.say("memory", f"{e.id}: re-tuned {cfg.label()} -> {cand.label()} (screened {fig['speedup_screened']:.2f}x AR, "
                  f"incumbent {fig['incumbent_speedup_screened']:.2f}x); judged against {incumbent.label()}")
        j = pilot.judge(incumbent, cand, cand.label())
        v = j.verdict
        pilot.say("memory", ("[green]" if v.approved else "[red]") + v.reason + "[/]")
        cand_row = {"round": "memory", "name": cand.label(), "config": cand.model_dump(), "predicted": fig,
                    "gain": j.run.gain, "lower_bound": j.run.lower_bound, "bar": v.bar,
                    "outputs_differ": j.run.outputs_differ, "forcing_passed": j.forcing_passed,
                    "forcing_reasons": list(j.forcing_reasons), "mismatch_rate": j.forcing.mismatch_rate,
                    "approved": v.approved, "reason": v.reason, "reused_from": row["origin"]}
        candidates.append(cand_row)
        row.update(gain=j.run.gain, lower_bound=j.run.lower_bound, bar=v.bar)
        if not v.approved:
            row["status"], row["reason"] = "not carried over", f"re-measured here and {v.reason}"
            continue
        entry = pilot.entry("reuse", incumbent, cand, j.run, j.forcing, [x.id for x in entries],
                            reused_from=row["origin"])
        memory.add(entry, overwrite=True)
        entries.append(entry)
        cand_row["entry"] = row["entry"] = entry.id
        row["status"], row["reason"] = "reused", v.reason
        pilot.say("memory", f"reused {e.id} as {entry.id}: {incumbent.label()} -> {cand.label()}")
        incumbent = cand
    return incumbent, rows
