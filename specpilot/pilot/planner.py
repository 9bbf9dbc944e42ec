"""The built-in planner (§3.1, §3.2): candidates aimed at the largest ceiling factor, ranked by the cost model.

Each round the master step reads the ceiling's three factors and picks a direction; candidates are the mechanism
options that move that factor (tree: drafter, builder, budget N, top-K, depth; outside: cheaper steps: fewer rows,
fewer draft positions, a cheaper drafter; kernel: ``w12`` and ``lm_head_int8`` (§4.1) toggled on the incumbent, on
CUDA with a bf16 target, on the CPU ``lm_head_int8`` with a float32 one; elsewhere none, and the round says why,
:meth:`Planner.kernel_why_not`). Each candidate's τ comes from exact replay (no target pass) and its c(N) from
measured pass times, so the planner ranks by predicted speedup τ / c and sends only the best few to the controller.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from specpilot.config import SystemConfig
from specpilot.pilot.replay import Recording, TruncatedLattice, replay, replay_steps, replay_trace
from specpilot.pilot.space import (BLOCK_DEPTH, BLOCK_TREES, DEPTH, EAGLE3_TOP_K, KERNEL_MECHANISMS, NODES,  # noqa: F401
                                   TOP_K, _canonical, _distinct, candidate_space)
from specpilot.spec.trees import build_tree

TREE_SAMPLES = 200  # recorded lattices a config's tree-building time is measured on

#: Row counts whose exact-pass time the cost model measures: one row (AR), two, and every ``[root] + tree`` size a
#: candidate verifies, so no prediction interpolates across a step in the pass's cost (a 135M target's CPU pass
#: jumps from 59 to 89 ms between 3 and 4 rows, where the kernel library changes method).
VERIFY_ROWS = tuple(sorted({1, 2, 48, 64} | {n + 1 for n in NODES + DEPTH + BLOCK_DEPTH}))


@dataclass
class Prediction:
    """Cost-model prediction for one config: ``tau`` (replay), ``c`` and ``speedup`` = τ / c over AR.

    ``c_screened`` / ``speedup_screened`` are filled by the pilot's live screening (measured step time).
    """

    tau: float
    c: float
    speedup: float
    c_screened: float | None = None
    speedup_screened: float | None = None

    def to_dict(self) -> dict:
        return {"tau": self.tau, "c": self.c, "speedup": self.speedup, "c_screened": self.c_screened,
                "speedup_screened": self.speedup_screened}


def monotone(values) -> np.ndarray:
    """The non-decreasing sequence nearest to ``values`` in least squares (pool adjacent violators): a pass
    over more rows never costs less, so a measured dip (noise, a faster kernel bucket) is averaged with its
    neighbours instead of making c(N) fall as N grows. ``values [n]`` -> ``[n] float64``."""
    blocks: list[list[float]] = []  # [mean, weight]
    for v in map(float, values):
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, w1), (m2, w2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    return np.array([m for m, w in blocks for _ in range(int(w))], dtype=float)


class Planner:
    """Predicts τ, c and speedup of configs and proposes candidates for a direction.

    A speculative step's time is predicted as ``T_spec + mean T_pass(rows) + T_draft + T_tree + T_move`` (§3.2): the
    exact pass priced at each replayed step's own rows (measured by rows, made monotone; a step whose drafter found
    nothing verifies one row, and a pass's cost is not linear in rows), the drafter's measured propose and observe
    times (:meth:`draft_time`), the host's time to build the config's tree (:meth:`tree_time`: the engine's own
    builder timed on the recorded lattices; a 32-node best-first tree costs the host several times a 6-token
    chain, which matters where a step is a fraction of a millisecond), the measured moves of accepted paths that
    are not in place (:meth:`move_time`; a chain never moves), and ``T_spec`` the step's remaining work
    (acceptance, commits, the host read AR's pipelined loop hides), calibrated on one speculative step measured
    live (``spec_step``). c = that time / T_AR.

    Args:
        recordings: ``{(drafter, top_k_recorded): Recording}`` from :func:`specpilot.pilot.replay.record`.
            For ``draft_model`` one recording at the largest K serves every K; for ``ngram`` one per K; a
            block drafter is keyed ``("block:<dir>", 16)`` with ``rec.drafter_path`` set to its directory, an EAGLE-3
            drafter ``("eagle3:<dir>", K)`` once per K of :data:`EAGLE3_TOP_K` (replayed at that K only).
        verify_ms: ``{rows: ms}`` measured time of one exact pass (forward + LM head + argmax) by rows.
        ar_ms: measured AR step time, ms (the unit of c).
        device: the deployment's torch device (``cpu``, ``cuda``, ``cuda:1``): kernel mechanisms are
            proposed on CUDA only.
        spec_step: ``(config, step_ms)`` of a speculative system measured live beside ``ar_ms`` (stock, in the
            pilot): ``T_spec = step_ms − mean T_pass − T_draft(config)`` over its replayed steps, at least 0.
            None (or a config with no recording): ``T_spec = T_AR − T_pass(1)``, AR's own work outside its pass.
        kind_steps: more ``(config, step_ms)`` measured live the same way (the pilot adds an n-gram chain when stock
            drafts otherwise): each calibrates ``T_spec`` for its drafter kind (:meth:`overhead`).
        tlv: :class:`~specpilot.pilot.tlv_cost.TlvInputs` (Q passes recorded along the AR outputs, the Q pass's time
            by rows): TLV configs are then priced (:func:`~specpilot.pilot.tlv_cost.predict_tlv`) and the ``tree``
            direction proposes each of its candidates with ``tlv`` too; None: TLV is neither priced nor proposed.
        calib_requests: indices of the recorded requests those live steps ran on (their recorded prompts), so their
            residuals subtract the replay of the same requests; None: every recorded request.
        feature_verify_ms: ``{target_layers: {rows: ms}}``, the exact pass timed as a system whose drafter reads
            those target layers runs it (their outputs gathered for the drafter, a block drafter's context); a
            config whose recording has ``target_layers`` is priced on its curve (on ``verify_ms`` without one).
        move_ms: ``{target_layers: {path rows: ms}}`` (:func:`~specpilot.pilot.setup.measure_move_ms`): a step whose
            accepted path is not in place moves it (the target cache's compaction, and the features' gather for a
            drafter reading ``target_layers``; ``()``: none); priced per replayed step that moves
            (:func:`~specpilot.pilot.replay.replay_trace`). None or a missing key: not priced.
        w12_verify_ms: ``{rows: ms}`` of the W12 target's exact pass (§4.1): a ``w12`` config's pass at R rows is
            priced at the bf16 pass's time × T_w12(R) / T_bf16(R) (W12 wins at one row and may lose at tree sizes,
            so the price follows each candidate's rows), AR + w12 at c = T_w12(1) / T_bf16(1). None: ``w12`` is
            priced as bf16 and only the live screen sees what it changes.
    """

    def __init__(self, recordings: dict[tuple[str, int], Recording], verify_ms: dict[int, float], ar_ms: float,
                 device: str = "cpu", spec_step: tuple[SystemConfig, float] | None = None,
                 feature_verify_ms: dict[tuple[int, ...], dict[int, float]] | None = None,
                 move_ms: dict[tuple[int, ...], dict[int, float]] | None = None,
                 kind_steps: list[tuple[SystemConfig, float]] = (), calib_requests: list[int] | None = None,
                 tlv=None, w12_verify_ms: dict[int, float] | None = None, cpu_head: bool = False):
        self.recordings, self.ar_ms, self.device, self.cpu_head = recordings, ar_ms, str(device), cpu_head
        self._w12 = (np.array(sorted(w12_verify_ms), dtype=float),
                     monotone([w12_verify_ms[r] for r in sorted(w12_verify_ms)])) if w12_verify_ms else None
        self._tree_ms: dict[tuple, float] = {}
        self.rows = np.array(sorted(verify_ms), dtype=float)
        self.ms = monotone([verify_ms[r] for r in sorted(verify_ms)])
        self._curves = {tuple(k): (np.array(sorted(v), dtype=float), monotone([v[r] for r in sorted(v)]))
                        for k, v in (feature_verify_ms or {}).items()}
        self._moves = {tuple(k): (np.array(sorted(v), dtype=float), monotone([v[r] for r in sorted(v)]))
                       for k, v in (move_ms or {}).items()}
        self.overhead_ms = max(ar_ms - float(self.ms[0]), 0.0)  # per-step work outside the pass
        self.spec_overhead_source = "AR's step less its one-row pass"
        self.tlv = tlv
        self.kind_overhead: dict[str, float] = {}  # T_spec by drafter kind, from live steps of that kind
        for i, (cfg, step_ms) in enumerate(([spec_step] if spec_step is not None else []) + list(kind_steps)):
            rec = self.recording(cfg) if cfg.drafter != "none" else None
            if rec is None:
                continue
            trace = replay_trace(rec if calib_requests is None else rec.subset(calib_requests), cfg)
            steps = [(k, r) for k, r, _ in trace]
            pass_ms = self.pass_time(steps, rec.target_layers)
            parts = (self.draft_time(cfg, steps, calib_requests), self.tree_time(cfg, steps),
                     self.move_time([mv for *_, mv in trace], rec.target_layers))  # drafting, tree, KV moves
            raw = step_ms - pass_ms - sum(parts)
            self.kind_overhead.setdefault(cfg.drafter, max(raw, 0.0))
            if i == 0:
                self.overhead_ms, self.spec_overhead_source = max(raw, 0.0), (
                    f"{cfg.label()}'s live step ({step_ms:.3f} ms) less its mean pass ({pass_ms:.3f} ms over its "
                    "replayed rows), drafting ({:.3f}), tree building ({:.3f}) and KV moves ({:.3f})".format(*parts)
                    + (f": {raw:.3f} ms, below 0, so 0 (the parts priced apart fill the step)" if raw < 0 else ""))

    def overhead(self, cfg: SystemConfig) -> float:
        """``T_spec`` for ``cfg``, ms: the residual of a live step of its drafter kind when one was measured (a residual
        also holds whatever of that drafter's work its recording did not time); else the n-gram's (whose drafting is
        host work, all of it timed, so its residual is the step's own work); else :attr:`overhead_ms`."""
        return self.kind_overhead.get(cfg.drafter, self.kind_overhead.get("ngram", self.overhead_ms))

    def verify_time(self, rows: float, layers: tuple[int, ...] = (), w12: bool = False) -> float:
        """Exact-pass time for ``rows`` rows, ms: the monotone fit of the measured times, interpolated; with
        ``layers``, of the pass that also gathers those target layers' outputs (``feature_verify_ms``; the plain
        pass's when that was not measured); with ``w12``, scaled by :meth:`w12_factor`."""
        xs, ys = self._curves.get(tuple(layers), (self.rows, self.ms))
        return float(np.interp(rows, xs, ys)) * (self.w12_factor(rows) if w12 else 1.0)

    def w12_factor(self, rows: float) -> float:
        """T_w12(rows) / T_bf16(rows) of the measured exact passes (1 when the W12 pass was not measured)."""
        if self._w12 is None:
            return 1.0
        return float(np.interp(rows, *self._w12)) / float(np.interp(rows, self.rows, self.ms))

    def pass_time(self, steps: list[tuple[int, int]], layers: tuple[int, ...] = (), w12: bool = False) -> float:
        """Mean exact-pass time of replayed ``steps`` (:func:`~specpilot.pilot.replay.replay_steps`), each at its own
        rows, ms (T_pass(1) when there are none); ``layers`` and ``w12`` as :meth:`verify_time`."""
        if not steps:
            return self.verify_time(1, layers, w12)
        return float(np.mean([self.verify_time(r, layers, w12) for _, r in steps]))

    def move_time(self, moved: list[int], layers: tuple[int, ...] = ()) -> float:
        """Mean time per step to move accepted paths into place, ms: ``moved`` is each replayed step's moved rows
        (0: in place; :func:`~specpilot.pilot.replay.replay_trace`), priced on the measured ``move_ms`` curve of
        ``layers`` (monotone, interpolated); 0 when that was not measured or there are no steps."""
        if tuple(layers) not in self._moves or not moved:
            return 0.0
        xs, ys = self._moves[tuple(layers)]
        return float(sum(np.interp(k, xs, ys) for k in moved if k > 0)) / len(moved)

    def draft_time(self, cfg: SystemConfig, steps: list[tuple[int, int]] | None = None,
                   requests: list[int] | None = None) -> float:
        """The drafter's time per step for ``cfg``, ms, from its recording's measured calls
        (:class:`~specpilot.pilot.replay.Recording`): ``propose`` (``draft_ms``) plus ``observe`` (``observe_ms``: a
        block drafter writes the accepted tokens' context K/V every step), plus each request's first ``propose``
        beyond a later one (``first_ms − draft_ms``: the prompt's catch-up) spread over the steps: live it falls on
        the request's first step, so it weighs (requests / steps), not (requests / positions). A draft model's
        propose is affine in depth (one pass per position after a catch-up pass and a host read): interpolated
        between its two measured depths, one position (``draft1_ms``) and the recorded one (``draft_ms``), and so is an
        EAGLE-3 drafter's (one pass over the expanded nodes per depth); without
        ``draft1_ms``, scaled by ``cfg.depth / rec.depth``. 0 without a recording or a drafter.

        Args:
            steps: ``cfg``'s replayed steps over ``requests`` (:func:`~specpilot.pilot.replay.replay_steps`;
                None: replayed here).
            requests: indices of the recorded requests the steps are over (None: all).
        """
        rec = None if cfg.drafter == "none" else self.recording(cfg)
        if rec is None:
            return 0.0
        rec = rec if requests is None else rec.subset(requests)
        propose = rec.draft_ms
        if cfg.drafter in ("draft_model", "eagle3"):  # one drafter pass per depth level
            if rec.draft1_ms is not None and rec.depth > 1:
                propose = rec.draft1_ms + (rec.draft_ms - rec.draft1_ms) * (cfg.depth - 1) / (rec.depth - 1)
            else:
                propose = rec.draft_ms * cfg.depth / rec.depth
        if rec.first_ms is not None:
            steps = replay_steps(rec, cfg) if steps is None else steps
            firsts = sum(len(a) > 1 for a in rec.ar)  # requests with a decode step
            propose += (rec.first_ms - rec.draft_ms) * firsts / max(len(steps), 1)
        return propose + rec.observe_ms

    def tree_time(self, cfg: SystemConfig, steps: list[tuple[int, int]] | None = None) -> float:
        """The host's time per step to build ``cfg``'s tree and its ancestor mask, ms: the engine's own builder
        timed here over up to :data:`TREE_SAMPLES` recorded lattices (cut to ``cfg``'s depth and K; memoized per
        config), times the fraction of ``steps`` that draft at all (None: ``cfg``'s replayed steps over every
        recorded request). 0 without a recording or a drafter."""
        rec = None if cfg.drafter == "none" else self.recording(cfg)
        if rec is None:
            return 0.0
        key = (cfg.drafter, cfg.drafter_path, cfg.tree, cfg.nodes, cfg.depth, cfg.top_k)
        if key not in self._tree_ms:
            lats = [lat for lats in rec.lattices for lat in lats.values() if lat is not None][:TREE_SAMPLES]
            ms = 0.0
            if lats:
                t0 = time.perf_counter()
                for lat in lats:
                    build_tree(cfg.tree, TruncatedLattice(lat, min(cfg.depth, lat.depth), cfg.top_k),
                               cfg.nodes).chain_first().ancestor_mask()
                ms = 1e3 * (time.perf_counter() - t0) / len(lats)
            self._tree_ms[key] = ms
        steps = replay_steps(rec, cfg) if steps is None else steps
        return self._tree_ms[key] * sum(r > 1 for _, r in steps) / max(len(steps), 1)

    def step_c(self, rows: float, draft_ms: float = 0.0) -> float:
        """Predicted c of a speculative step verifying ``rows`` rows with ``draft_ms`` of drafting:
        ``(T_spec + T_pass(rows) + draft_ms) / T_AR``."""
        return (self.overhead_ms + self.verify_time(rows) + draft_ms) / self.ar_ms

    def recording(self, cfg: SystemConfig) -> Recording | None:
        """The recording that replays ``cfg`` exactly, or None."""
        if cfg.drafter == "ngram":
            rec = self.recordings.get(("ngram", cfg.top_k))
            return rec if rec is not None and rec.depth >= cfg.depth else None
        if cfg.drafter in ("block", "eagle3"):  # one recording per checkpoint ("<kind>:<dir>"), eagle3's per K
            for (kind, k), rec in self.recordings.items():
                if kind.startswith(cfg.drafter + ":") and rec.drafter_path == cfg.drafter_path and rec.depth >= cfg.depth \
                        and (k == cfg.top_k if cfg.drafter == "eagle3" else k >= cfg.top_k):
                    return rec
            return None
        for (kind, k), rec in self.recordings.items():
            if kind == cfg.drafter and k >= cfg.top_k and rec.depth >= cfg.depth:
                return rec
        return None

    def predict(self, cfg: SystemConfig, requests: list[int] | None = None) -> Prediction | None:
        """Predicted τ (exact replay), c and speedup of ``cfg``; None when it cannot be replayed. AR
        (``drafter == "none"``, e.g. a kernel toggle of an AR incumbent) is τ = 1, c = 1: its step is the AR
        step, and the live screen measures what a kernel mechanism changes.

        ``requests``: indices of the recorded requests to predict over (the steps of those requests only, to
        compare with a live measurement on the same recorded prompts, :func:`~specpilot.pilot.rounds.screen`);
        None: every recorded request. Raises ValueError for an index outside the recording."""
        if cfg.drafter == "none":
            c = self.w12_factor(1) if cfg.w12 else 1.0
            return Prediction(1.0, c, 1.0 / c)
        if cfg.tlv:
            from specpilot.pilot.tlv_cost import predict_tlv

            return predict_tlv(self, cfg, self.tlv, requests) if self.tlv is not None else None
        rec = self.recording(cfg)
        if rec is None:
            return None
        trace = replay_trace(rec if requests is None else rec.subset(requests), cfg)
        if not trace:
            return None
        steps = [(k, r) for k, r, _ in trace]
        tau = sum(k for k, _ in steps) / len(steps)
        c = (self.overhead(cfg) + self.pass_time(steps, rec.target_layers, cfg.w12) + self.draft_time(cfg, steps, requests)
             + self.tree_time(cfg, steps) + self.move_time([mv for *_, mv in trace], rec.target_layers)) / self.ar_ms
        return Prediction(tau, c, tau / c)

    def oracle_tau(self, cfg: SystemConfig) -> float:
        """τ of the top-K oracle with ``cfg``'s drafter and N, at the largest recorded depth and K (§2.4)."""
        best = 0.0
        for (kind, k), rec in self.recordings.items():  # a checkpoint's drafter: its own recordings only
            if kind == cfg.drafter or (kind.startswith(cfg.drafter + ":") and rec.drafter_path == cfg.drafter_path):
                probe = cfg.model_copy(update={"depth": rec.depth, "top_k": k})
                best = max(best, replay(rec, probe, policy="oracle")[0])
        return best

    def space(self, incumbent: SystemConfig, direction: str) -> list[SystemConfig]:
        """Configs one step from ``incumbent`` that move ``direction``.

        ``tree``: raise τ (drafter, builder, budget N, top-K, depth; with TLV inputs each also with ``tlv``).
        ``outside``: make the step cheaper (fewer rows or draft positions, a cheaper drafter). ``kernel``: one of
        :meth:`kernel_mechanisms` toggled (§4.1) when :meth:`kernel_why_not` is None: τ unchanged, so the predicted
        speedup is the incumbent's and the pilot's live screening (measured c) decides what reaches the controller.
        """
        return candidate_space(self, incumbent, direction)

    def kernel_mechanisms(self) -> tuple[str, ...]:
        """The kernel mechanisms with a fast path here: both on CUDA; on the CPU the certified head where its bf16
        first pass can pay (``cpu_head``: :func:`specpilot.head.cpu.worth` of the target's head). W12 is GPU-only."""
        if torch.device(self.device).type == "cuda":
            return KERNEL_MECHANISMS
        return ("lm_head_int8",) if self.cpu_head else ()

    def kernel_why_not(self, incumbent: SystemConfig) -> str | None:
        """Why the ``kernel`` direction has no candidates for ``incumbent`` here, or None when it has: on CUDA both
        mechanisms need bf16 weights (W12 stores bf16 values in 12 bits); the CPU's certified head, a float32 head."""
        if torch.device(self.device).type != "cuda":
            if not self.kernel_mechanisms():
                return (f"no kernel mechanism pays on {self.device} here: the certified head's CPU pass needs a float32 "
                        "head of at least 2^24 weights and a build that prepacks for oneDNN")
            return None if incumbent.dtype == "float32" else (
                f"on the CPU the certified head's fast path takes a float32 target; this one is {incumbent.dtype}")
        if incumbent.dtype != "bfloat16":
            return f"the kernel mechanisms (W12, certified INT8 head) need a bf16 target; this one is {incumbent.dtype}"
        return None

    def propose(self, incumbent: SystemConfig, direction: str, tried: set[str], k: int) -> list[tuple[SystemConfig, Prediction]]:
        """Untried candidates of ``direction``: the ``k`` with the highest predicted speedup *per drafter*
        (kind and checkpoint), best first overall.

        Taking the best of each drafter family, rather than the global top ``k``, keeps one biased cost
        estimate (the analytic c of a drafter whose step overheads it misses) from crowding out the other
        drafters; the pilot's live screening and the controller decide between them.
        """
        families: dict[tuple, list] = {}
        for cfg in self.space(incumbent, direction):
            if cfg.seal() in tried:
                continue
            p = self.predict(cfg)
            if p is not None:
                families.setdefault((cfg.drafter, cfg.drafter_path), []).append((cfg, p))
        picked = [cp for fam in families.values() for cp in sorted(fam, key=lambda cp: -cp[1].speedup)[:k]]
        picked.sort(key=lambda cp: -cp[1].speedup)
        return picked
