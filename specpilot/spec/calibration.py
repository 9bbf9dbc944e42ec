"""Calibration of a real drafter's acceptance, for the simulated ``calibrated`` drafter (§2.4 replay, §4.2 trees).

A :class:`Calibration` is measured from a :class:`~specpilot.pilot.replay.Recording`: a real drafter's lattices
along the target's AR outputs (at committed length ``m`` the target's greedy tokens are ``ar[m:]``). Along the
*right path* (the target's tokens ``t_1 … t_D``) each lattice position ``d`` is queried with
``children(t_1 … t_{d-1})`` and gives the rank of ``t_d`` among its top-K (or a miss), the top-1's log-prob and the
row of scores. What it keeps (counts, not probabilities, so nothing is lost in the file):

- **regimes** ``regime_counts [S]``, ``regime_first [S]`` and ``regime_transitions`` (sparse ``[from, to, count]``
  triples): per position ``m`` a regime: the drafter proposed nothing (index 0), or its top-1 chain matched
  exactly ``a`` leading positions and the right path stayed in the top-K for ``o`` positions (``0 ≤ a ≤ o ≤ D``;
  the index of each pair is :func:`regime_states`; S = 1 + (D + 1)(D + 2) / 2). The transitions count
  regime(m) → regime(m + 1) along each output: a first-order chain that carries how acceptance comes in runs (an
  i.i.d. model of the same marginals over-stated the bundled n-gram drafter's chain τ by 1.9x and the block
  drafter's top-K-oracle τ by 1.3x, because easy and hard stretches alternate). ``regime_first`` counts each
  output's first drafted position (a request's start differs from its middle). Positions whose walk ran out of
  target tokens before it broke (the output's end) are left out.
- **chain_reached / chain_hits** ``[D]``: positions whose top-1 chain matched every position before d and whose
  target token at d is known, and of those the ones whose top-1 matched at d (the output's end censors nothing
  here); **p_top1** ``[D]`` (derived, written for readers and checked on load) = hits / reached: P(top-1 = the
  target's token at d | every earlier top-1 matched).
- **first_miss** ``[D][K]``: at the first position whose top-1 misses, where the right token was: index ``r - 1`` for
  rank ``r`` in 1 … K-1, index ``K - 1`` for "not in the top-K" (so best-first trees have something to find).
- **detour** ``[D][K + 1]``: the rank (index K: miss) at positions reached through a non-top-1 right token.
- **top1_logp** quantiles ``[D][QUANTILES]`` of the top-1 log-prob (nats) when it matches / misses, with counts;
  positions with fewer than :data:`MIN_COUNT` samples hold the quantiles pooled over positions.
- **rows**: recorded score rows by where the right token was (``"0"`` … ``"K-1"``, ``"miss"``): each its position
  and its log-probs best first (its length is the width: the candidates offered, 0 = the lattice ended); at most
  :data:`ROW_CAP` per class (evenly spaced). A simulated position takes a whole recorded row of its class, so its
  width, top-1 score and the gaps a tree builder compares stay together (the top-1 quantiles above summarise
  the same scores for readers and tests).
- **cost**: how to build a network of the real drafter's shape for timing (see :mod:`specpilot.spec.calibrated`).
- **q_agreement** (optional; absent in files written before it, and then TLV's Q pass is not simulated): how often
  the real pair's Q view (TLV, §4.3; ``weights``, e.g. ``view8``) agreed with the exact pass along the AR outputs, per
  chain row ``j`` (0 = the root row): ``reached [D + 1]`` rows whose earlier chain rows all agreed, ``hits [D + 1]``
  those that agreed too (:mod:`specpilot.spec.calibrated_q`).

File: JSON with ``"schema": "specpilot-calibration"`` and ``"version": 1``; :func:`load_calibration` checks every
field and raises :class:`CalibrationError` (one line) on a malformed file. Floats are rounded to 4 decimals when
measured, so save → load gives the same numbers.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specpilot.errors import DrafterError

SCHEMA, VERSION = "specpilot-calibration", 1
COST_KINDS = ("ngram", "block", "draft_model")  # what :func:`specpilot.spec.cost_drafter.cost_drafter` builds
Q_WEIGHTS = ("view8", "int8", "int6")  # the Q views (:func:`specpilot.model.qview.q_view`) an agreement names
QUANTILES = 17  # quantile points 0, 1/16, …, 1
MIN_COUNT = 20  # samples below which a per-position statistic falls back to the pooled one
ROW_CAP = 256  # recorded score rows kept per class


class CalibrationError(DrafterError):
    """A calibration file or recording that cannot be used (one-line message)."""


@dataclass
class Calibration:
    """A real drafter's acceptance statistics along the target's greedy outputs (fields: module docstring).

    Attributes:
        depth / top_k: D positions and K candidates a position that were recorded.
        source: what it was measured on (drafter kind, requests, lattices, free notes).
        cost: the cost network's spec (:func:`specpilot.spec.calibrated.cost_drafter`), or None (no cost).
        q_agreement: the real pair's Q-view agreement per chain row (module docstring), or None (not measured).
    """

    depth: int
    top_k: int
    regime_counts: list[int]
    regime_first: list[int]
    regime_transitions: list[list[int]]  # sparse [from, to, count], count >= 1
    chain_reached: list[int]
    chain_hits: list[int]
    first_miss: list[list[int]]
    detour: list[list[int]]
    top1_logp: dict[str, list[list[float] | None]]
    top1_count: dict[str, list[int]]
    rows: dict[str, dict[str, list]]
    source: dict = field(default_factory=dict)
    cost: dict | None = None
    q_agreement: dict | None = None  # {"weights", "reached" [D + 1], "hits" [D + 1]}; None: not measured

    @property
    def p_top1(self) -> list[float]:
        """``[D]``: P(the top-1 at position d is the target's token | every earlier top-1 matched) = chain hits /
        chain reached (proposals that were None excluded); 0.0 where no proposal reached d."""
        return [round(h / n, 6) if n else 0.0 for h, n in zip(self.chain_hits, self.chain_reached)]

    @property
    def p_none(self) -> float:
        """Fraction of (uncensored) positions where the drafter proposed nothing."""
        return self.regime_counts[0] / max(sum(self.regime_counts), 1)

    def to_dict(self) -> dict:
        """The JSON object of the file (``p_top1`` included for readers; it is checked on load; ``q_agreement`` only
        when measured, so a file without it reads as before)."""
        d = {"schema": SCHEMA, "version": VERSION, **asdict(self), "p_top1": self.p_top1}
        if d["q_agreement"] is None:
            del d["q_agreement"]
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "calibration") -> "Calibration":
        """Check and build. Raises :class:`CalibrationError` naming ``where`` and the first bad field."""
        return _checked(d, where)


def calibrate(rec, cost: dict | None = None, source: dict | None = None) -> Calibration:
    """Measure a :class:`Calibration` from a recording (:func:`specpilot.pilot.replay.record`).

    Args:
        rec: a ``Recording`` (prompts, AR outputs, per request ``{m: Lattice | None}``, depth D, top-K).
        cost: the cost network's spec to store (e.g. :func:`specpilot.spec.calibrated.cost_spec_of` of the drafter).
        source: notes stored under ``source`` (the drafter kind, the target, ...).
    Raises:
        CalibrationError: an empty recording (no lattice position with a known target token).
    """
    D, K = rec.depth, rec.top_k
    index = {st: i for i, st in enumerate(regime_states(D))}
    regimes, first, trans = [0] * len(index), [0] * len(index), {}
    first_miss, detour = [[0] * K for _ in range(D)], [[0] * (K + 1) for _ in range(D)]
    reached, hits = [0] * D, [0] * D
    top1 = {"match": [[] for _ in range(D)], "miss": [[] for _ in range(D)]}
    rows: dict[str, list[tuple[int, list[float]]]] = {c: [] for c in _classes(K)}
    n_lat = 0
    for ar, lats in zip(rec.ar, rec.lattices):
        prev = None
        for m in range(1, len(ar)):
            lat, known = lats.get(m), min(D, len(ar) - m)
            regime = None
            if lat is None:
                regime = 0 if m in lats else None
            else:
                n_lat += 1
                a, o, censored = _walk(lat, ar[m : m + known], K, first_miss, detour, top1, rows)
                for d in range(min(a + 1, known)):
                    reached[d] += 1
                    hits[d] += d < a
                regime = None if censored and known < D else index[(a, o)]
            if regime is not None:
                regimes[regime] += 1
                first[regime] += m == 1
                if prev is not None:
                    trans[(prev, regime)] = trans.get((prev, regime), 0) + 1
            prev = regime
    if sum(regimes) == 0:
        raise CalibrationError("the recording has no lattice position with a known target token: record longer "
                               "AR outputs (at least depth + 1 tokens)")
    trans = [[i, j, n] for (i, j), n in sorted(trans.items())]
    return Calibration(D, K, regimes, first, trans, reached, hits, first_miss, detour, *_quantiles(top1, D), _bank(rows),
                       {"requests": len(rec.ar), "lattices": n_lat, "tokens": sum(len(a) for a in rec.ar),
                        **(source or {})}, cost)


def regime_states(depth: int) -> list:
    """Regime index -> ``"none"`` (index 0) or ``(a, o)``: top-1 chain matches ``a`` and top-K path length ``o``."""
    return ["none"] + [(a, o) for a in range(depth + 1) for o in range(a, depth + 1) if a < depth or o == depth]


def _classes(k: int) -> list[str]:
    return [str(r) for r in range(k)] + ["miss"]


def _walk(lat, target, k, first_miss, detour, top1, rows) -> tuple[int, int, bool]:
    """Walk the right path down one lattice; returns (leading top-1 matches, leading top-K hits, whether the walk
    ran out of targets before a miss)."""
    path, clean, a = (), True, 0
    for d, tok in enumerate(target):
        kids = lat.children(path)[:k] if d < lat.depth else []
        toks = [t for t, _ in kids]
        r = toks.index(tok) if tok in toks else k
        if kids:
            top1["match" if r == 0 else "miss"][d].append(kids[0][1])
        rows["miss" if r == k else str(r)].append((d + 1, [round(lp, 4) for _, lp in kids]))
        if clean and r == 0:
            a += 1
        elif clean:
            first_miss[d][r - 1] += 1
            clean = False
        else:
            detour[d][r] += 1
        if r == k:
            return a, d, False
        path += (tok,)
    return a, len(target), True


def _quantiles(samples: dict[str, list[list[float]]], depth: int):
    """Per class and position: quantiles (pooled below MIN_COUNT samples; None when the class never occurred)."""
    out, counts = {}, {}
    for cls, per_d in samples.items():
        pooled = sorted(x for xs in per_d for x in xs)
        out[cls] = [_q(sorted(xs)) if len(xs) >= MIN_COUNT else (_q(pooled) if pooled else None) for xs in per_d]
        counts[cls] = [len(xs) for xs in per_d]
    return out, counts


def _q(xs: list[float]) -> list[float]:
    """QUANTILES evenly spaced quantiles of sorted ``xs`` (linear interpolation), rounded to 4 decimals."""
    out = []
    for i in range(QUANTILES):
        p = i * (len(xs) - 1) / (QUANTILES - 1)
        lo = int(p)
        hi = min(lo + 1, len(xs) - 1)
        out.append(round(xs[lo] + (xs[hi] - xs[lo]) * (p - lo), 4))
    return out


def _bank(rows: dict[str, list[tuple[int, list[float]]]]) -> dict[str, dict[str, list]]:
    """At most ROW_CAP rows per class, evenly spaced over the rows sorted by position (proportions kept)."""
    out = {}
    for cls, rs in rows.items():
        rs = sorted(rs, key=lambda r: r[0])
        if len(rs) > ROW_CAP:
            rs = [rs[int(i * len(rs) / ROW_CAP)] for i in range(ROW_CAP)]
        out[cls] = {"position": [r[0] for r in rs], "scores": [r[1] for r in rs]}
    return out


# -- file ---------------------------------------------------------------------------------------------------------
def save_calibration(cal: Calibration, path) -> Path:
    """Write ``cal`` as JSON to ``path`` (parents created); returns the path. Raises OSError when unwritable."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    d = cal.to_dict()  # one line a field: readable, and the score rows stay compact
    p.write_text("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in d.items()) + "\n}\n")
    return p


def load_calibration(path) -> Calibration:
    """Read and check a calibration file.

    Raises:
        CalibrationError: missing or unreadable file, not JSON, another schema or version, or a field of the wrong
            type, shape or range (the message names the file and the field).
    """
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except OSError as e:
        raise CalibrationError(f"calibration file {p}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:
        raise CalibrationError(f"calibration file {p}: not JSON ({e})") from None
    return _checked(raw, f"calibration file {p}")


def _checked(d, where: str) -> Calibration:
    def bad(msg):
        raise CalibrationError(f"{where}: {msg}")

    if not isinstance(d, dict) or d.get("schema") != SCHEMA:
        bad(f"not a calibration (needs \"schema\": \"{SCHEMA}\")")
    if d.get("version") != VERSION:
        bad(f"schema version {d.get('version')!r}, this SpecPilot reads version {VERSION}")
    D, K = d.get("depth"), d.get("top_k")
    if not (_int(D) and _int(K) and D >= 1 and K >= 1):
        bad("depth and top_k must be integers >= 1")

    def counts(name, shape):
        v = d.get(name)
        if not _grid(v, shape, lambda x: _int(x) and x >= 0):
            bad(f"{name} must be a {' x '.join(map(str, shape))} grid of counts >= 0")
        return v

    S = len(regime_states(D))
    regimes, first = counts("regime_counts", (S,)), counts("regime_first", (S,))
    if sum(regimes) == 0:
        bad("regime_counts are all 0 (nothing was measured)")
    trans = d.get("regime_transitions")
    if not isinstance(trans, list) or not all(_grid(t, (3,), _int) and 0 <= t[0] < S and 0 <= t[1] < S and t[2] >= 1
                                              for t in trans) or len({(t[0], t[1]) for t in trans}) != len(trans):
        bad(f"regime_transitions must be distinct [from, to, count] triples, regimes in 0..{S - 1}, counts >= 1")
    first_miss = counts("first_miss", (D, K))
    reached, hits = counts("chain_reached", (D,)), counts("chain_hits", (D,))
    if any(h > n for h, n in zip(hits, reached)):
        bad("chain_hits must not exceed chain_reached")
    detour = counts("detour", (D, K + 1))
    t1, tc = d.get("top1_logp"), d.get("top1_count")
    for cls in ("match", "miss"):
        if not isinstance(t1, dict) or not isinstance(t1.get(cls), list) or len(t1[cls]) != D or not all(
                q is None or (_grid(q, (QUANTILES,), _finite) and q == sorted(q)) for q in t1[cls]):
            bad(f"top1_logp.{cls} must hold {D} lists of {QUANTILES} non-decreasing numbers (or null)")
        if not isinstance(tc, dict) or not _grid(tc.get(cls), (D,), lambda x: _int(x) and x >= 0):
            bad(f"top1_count.{cls} must hold {D} counts")
    rows = d.get("rows")
    if not isinstance(rows, dict) or set(rows) != set(_classes(K)):
        bad(f"rows must have the classes {_classes(K)}")
    for cls, b in rows.items():
        if not isinstance(b, dict) or set(b) != {"position", "scores"}:
            bad(f"rows.{cls} must have position and scores")
        n = len(b["position"]) if isinstance(b["position"], list) else -1
        if n < 0 or not _grid(b["position"], (n,), lambda x: _int(x) and 1 <= x <= D) or not isinstance(
                b["scores"], list) or len(b["scores"]) != n:
            bad(f"rows.{cls}: positions in 1..{D} and one scores list each")
        for sc in b["scores"]:
            if not _grid(sc, (len(sc) if isinstance(sc, list) else -1,), _finite) or len(sc) > K or any(
                    x > 1e-3 for x in sc) or sc != sorted(sc, reverse=True):
                bad(f"rows.{cls}: scores must be at most {K} log-probs (<= 0), best first")
            if cls != "miss" and len(sc) <= int(cls):
                bad(f"rows.{cls}: a row of width {len(sc)} cannot hold the right token at rank {cls}")
    if "p_top1" in d and not (isinstance(d["p_top1"], list) and len(d["p_top1"]) == D):
        bad(f"p_top1 must list {D} numbers")
    source, cost = d.get("source", {}), d.get("cost")
    cost_ok = cost is None or isinstance(cost, dict) and cost.get("kind") in COST_KINDS
    if not isinstance(source, dict) or not cost_ok:
        bad(f"source must be an object and cost null or an object whose \"kind\" is one of {', '.join(COST_KINDS)}")
    qa = d.get("q_agreement")
    if qa is not None and not (isinstance(qa, dict) and qa.get("weights") in Q_WEIGHTS and _grid(
            qa.get("reached"), (D + 1,), lambda x: _int(x) and x >= 0) and _grid(qa.get("hits"), (D + 1,), _int)
            and all(0 <= h <= n for h, n in zip(qa["hits"], qa["reached"])) and qa["reached"][0] > 0):
        bad(f"q_agreement must be null or {{\"weights\": one of {', '.join(Q_WEIGHTS)}, \"reached\", \"hits\": "
            f"{D + 1} counts each, 0 <= hits <= reached, reached[0] > 0}}")
    cal = Calibration(D, K, regimes, first, trans, reached, hits, first_miss, detour, t1, tc, rows, source, cost,
                      None if qa is None else {"weights": qa["weights"], "reached": qa["reached"], "hits": qa["hits"]})
    if "p_top1" in d and any(abs(a - b) > 1e-6 for a, b in zip(d["p_top1"], cal.p_top1)):
        bad("p_top1 disagrees with chain_hits / chain_reached (it is derived from them: edit the counts)")
    return cal


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _grid(v, shape: tuple[int, ...], ok) -> bool:
    """``v`` is nested lists of ``shape`` whose leaves satisfy ``ok``."""
    if not isinstance(v, list) or len(v) != shape[0]:
        return False
    return all(_grid(x, shape[1:], ok) if len(shape) > 1 else ok(x) for x in v)


def simulation_note(config) -> str | None:
    """One line that every writer of figures (bench JSON, reports) must print with a system's numbers: None for a
    real system; for ``drafter == "calibrated"`` a note that its acceptance is simulated."""
    if config.drafter != "calibrated":
        return None
    return ("SIMULATED acceptance: calibrated drafter (drafts drawn from a real pair's calibration, "
            f"{config.drafter_path}); the target still verifies every token, timings are real")
