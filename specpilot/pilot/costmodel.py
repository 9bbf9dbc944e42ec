"""The cost model and its ceiling (seed paper §2.1, §3.2).

Speedup over AR decomposes as ``speedup = τ(N) / c(N)`` with ``c(N) = T_step(N) / T_AR``. The ceiling is
the headroom left, as a product of three factors, each attacked in turn by a round:

- tree = τ_best(N) / τ_current: what a better tree of N nodes could accept (τ_best from an oracle);
- kernel = profiled step time / byte floor, where the byte floor of each kernel class is
  ``max(FLOPs / (0.6 · peak FLOP/s), bytes / (0.9 · peak bytes/s), launches · launch latency)``;
- outside = measured step time / profiled time (time no region accounts for).

FLOP and byte counts are analytic, for one target pass of R rows at cache prefix length L of a dense
llama / qwen decoder (:class:`specpilot.model.transformer.ModelArgs`), plus the drafter's passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specpilot.model.args import ModelArgs
from specpilot.pilot.profiler import DevicePeaks

#: Kernel classes of a step, in report order (§3.2; ``recurrent`` stays empty for dense targets).
KERNEL_CLASSES = ("projections", "attention", "norms_elementwise", "lm_head", "recurrent", "drafter", "other")

#: Fractions of peak the byte floor assumes (§3.2: 60% of dense FLOP/s, 90% of bandwidth).
FLOPS_EFFICIENCY = 0.6
BANDWIDTH_EFFICIENCY = 0.9


def _linear(r: int, n_in: int, n_out: int, b: int, bias: bool) -> tuple[int, int]:
    """(FLOPs, bytes) of ``[r, n_in] @ W[n_in, n_out]``: weights (+bias) read, activations in and out."""
    flops = 2 * r * n_in * n_out
    nbytes = (n_in * n_out + (n_out if bias else 0) + r * (n_in + n_out)) * b
    return flops, nbytes


def pass_counts(args: ModelArgs, rows: int, prefix_len: int, dtype_bytes: int, lm_head: bool = True) -> dict:
    """Analytic (FLOPs, bytes) per kernel class of one pass of ``rows`` rows over ``prefix_len`` slots.

    Per layer (R = rows, L = prefix_len, h = hidden, I = intermediate, H/KV = heads, d = head_dim,
    b = dtype_bytes):

    - projections: q, k, v, o, gate, up, down; each FLOPs 2·R·in·out, bytes (in·out [+ bias] + R·(in+out))·b;
    - attention: FLOPs 4·R·(L+R)·H·d; bytes (2·(L+R)·KV·d [K/V read] + 2·R·KV·d [K/V write]
      + 2·R·H·d [q read, out write])·b;
    - norms_elementwise: 2 RMSNorms (4·R·h elements + 2·h weights), 2 residual adds (6·R·h),
      q/k norm if ``qk_norm`` (2·R·(H+KV)·d + 2·d), RoPE on q and k (2·R·(H+KV)·d), SwiGLU (3·R·I),
      all times b; approximate FLOPs 4/element for a norm, 1 for an add, 3 for RoPE, 5 for SwiGLU;
      plus the final norm (2·R·h + h elements, 4·R·h FLOPs).
    - lm_head (if ``lm_head``): FLOPs 2·R·h·V; bytes (h·V + R·(h+V))·b;
    - other: the embedding lookup, bytes 2·R·h·b, FLOPs 0.

    Args:
        args: architecture of the model making the pass.
        rows: R >= 1, rows in the pass.
        prefix_len: L >= 0, committed cache slots the rows attend to.
        dtype_bytes: bytes per weight/activation element (2 for bf16, 4 for fp32).
        lm_head: whether the pass includes the LM head.
    Returns:
        ``{class: (flops, bytes)}`` with int FLOPs and bytes.
    Raises:
        ValueError: for rows < 1, prefix_len < 0 or dtype_bytes <= 0.
    """
    if rows < 1 or prefix_len < 0 or dtype_bytes <= 0:
        raise ValueError(f"need rows >= 1, prefix_len >= 0, dtype_bytes > 0; got {rows}, {prefix_len}, {dtype_bytes}")
    r, length, b = rows, prefix_len, dtype_bytes
    h, i, d = args.hidden_size, args.intermediate_size, args.head_dim
    nh, nkv, nl = args.n_heads, args.n_kv_heads, args.num_layers
    qb, mb = args.attention_bias, args.mlp_bias

    shapes = [  # (in, out, bias) of each projection of one layer
        (h, nh * d, qb), (h, nkv * d, qb), (h, nkv * d, qb), (nh * d, h, False),
        (h, i, mb), (h, i, mb), (i, h, mb),
    ]
    pf = pb = 0
    for n_in, n_out, bias in shapes:
        f, nb = _linear(r, n_in, n_out, b, bias)
        pf, pb = pf + f, pb + nb

    s = length + r
    af = 4 * r * s * nh * d
    abytes = (2 * s * nkv * d + 2 * r * nkv * d + 2 * r * nh * d) * b

    qk = r * (nh + nkv) * d
    elems = 4 * r * h + 2 * h + 6 * r * h + 2 * qk + 3 * r * i
    ef = 2 * 4 * r * h + 2 * r * h + 3 * qk + 5 * r * i
    if args.qk_norm:
        elems += 2 * qk + 2 * d
        ef += 4 * qk

    out = {
        "projections": (nl * pf, nl * pb),
        "attention": (nl * af, nl * abytes),
        "norms_elementwise": (nl * ef + 4 * r * h, (nl * elems + 2 * r * h + h) * b),
        "other": (0, 2 * r * h * b),
    }
    if lm_head:
        out["lm_head"] = _linear(r, h, args.vocab_size, b, False)
    return out


def step_counts(
    args: ModelArgs,
    rows: int,
    prefix_len: int,
    dtype_bytes: int,
    drafter_args: ModelArgs | None = None,
    drafter_rows: int = 1,
    drafter_passes: int = 1,
    drafter_prefix_len: int | None = None,
    drafter_lm_head: bool = True,
) -> dict[str, tuple[int, int]]:
    """(FLOPs, bytes) per kernel class of one speculative step (§3.2).

    The target's verification pass of ``rows`` rows (N) is split by class as in :func:`pass_counts`;
    the drafter's ``drafter_passes`` passes of ``drafter_rows`` rows each (all of their classes summed,
    at ``drafter_prefix_len``, default ``prefix_len``) are counted under ``drafter``.

    Args:
        args: target architecture.
        rows: N, rows verified by the exact pass.
        prefix_len: L, committed cache slots of the request.
        dtype_bytes: bytes per element of the deployment dtype (target and drafter).
        drafter_args: the drafter's architecture, or None for no model drafter (n-gram / AR).
        drafter_rows: rows per drafter pass (1 for a chain drafter, the block size for a block drafter).
        drafter_passes: drafter passes per step.
        drafter_prefix_len: cache prefix of the drafter's passes; default ``prefix_len``.
        drafter_lm_head: whether the drafter's passes include its own LM head.
    Returns:
        ``{class: (flops, bytes)}`` over :data:`KERNEL_CLASSES` present in the step (int values).
    Raises:
        ValueError: for invalid sizes (see :func:`pass_counts`) or drafter_passes < 0.
    """
    counts = pass_counts(args, rows, prefix_len, dtype_bytes)
    if drafter_args is not None and drafter_passes:
        if drafter_passes < 0:
            raise ValueError(f"drafter_passes must be >= 0, got {drafter_passes}")
        dl = prefix_len if drafter_prefix_len is None else drafter_prefix_len
        dc = pass_counts(drafter_args, drafter_rows, dl, dtype_bytes, lm_head=drafter_lm_head)
        counts["drafter"] = (
            drafter_passes * sum(f for f, _ in dc.values()),
            drafter_passes * sum(nb for _, nb in dc.values()),
        )
    return {k: counts[k] for k in KERNEL_CLASSES if k in counts}


def pass_launches(args: ModelArgs, fused: bool, lm_head: bool = True) -> dict[str, int]:
    """Kernel launches per class of one pass, a lower bound (the launch floor, §3.2). Per layer ``fused``: 4 GEMMs,
    attention, 2 add+RMSNorms, q/k norm+RoPE+store, SwiGLU; op by op: 4 GEMMs, SDPA + 2 K/V writes, 8 ops per
    RMSNorm (2, 4 with q/k norm), RoPE 6, SwiGLU 2, adds 2. Plus final norm, embedding, head GEMM + argmax."""
    nl, norm = args.num_layers, 1 if fused else 8
    per_norms = 4 if fused else norm * (4 if args.qk_norm else 2) + 6 + 2 + 2
    out = {"projections": 4 * nl, "attention": nl * (1 if fused else 3), "norms_elementwise": nl * per_norms + norm,
           "other": 1}
    if lm_head:
        out["lm_head"] = 2
    return out


def byte_floor_ms(flops: float, nbytes: float, peaks: DevicePeaks, launches: int = 0) -> float:
    """Byte floor of one kernel class in ms:
    ``max(FLOPs / (0.6·peak FLOP/s), bytes / (0.9·peak bytes/s), launches · launch latency)``.

    §3.2's floor: the work at 60% of peak FLOP/s or 90% of peak bandwidth, whichever is larger, or the
    launches of a class of tiny kernels (a small target is launch-bound: bytes alone put the H200's kernel factor
    at 70–96). Raises ValueError when a peak is not positive or a count is negative.
    """
    if peaks.flops_per_s <= 0 or peaks.bytes_per_s <= 0:
        raise ValueError(f"peaks must be positive, got {peaks.flops_per_s} FLOP/s, {peaks.bytes_per_s} B/s")
    if flops < 0 or nbytes < 0 or launches < 0:
        raise ValueError(f"counts must be >= 0, got {flops} FLOPs, {nbytes} bytes, {launches} launches")
    t_compute = flops / (FLOPS_EFFICIENCY * peaks.flops_per_s)
    t_memory = nbytes / (BANDWIDTH_EFFICIENCY * peaks.bytes_per_s)
    return max(t_compute, t_memory, launches * peaks.launch_s) * 1e3


def floors_ms(counts: dict[str, tuple[float, float]], peaks: DevicePeaks, launches: dict | None = None) -> dict:
    """Byte floor in ms of each class of ``counts`` (:func:`step_counts`; ``launches``: :func:`pass_launches`)."""
    return {k: byte_floor_ms(f, nb, peaks, (launches or {}).get(k, 0)) for k, (f, nb) in counts.items()}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


@dataclass
class CostModel:
    """``speedup = τ(N) / c(N)`` with ``c(N) = T_step(N) / T_AR`` (§3.2).

    Attributes:
        tau: τ(N), tokens accepted per exact pass (> 0).
        step_ms: T_step(N), ms per speculative step including drafting (> 0).
        ar_ms: T_AR, ms per AR step in the same engine (> 0).
        rows: N, rows verified per exact pass.
    Raises:
        ValueError: on construction, when tau, step_ms or ar_ms is not positive / finite.
    """

    tau: float
    step_ms: float
    ar_ms: float
    rows: int = 0

    def __post_init__(self):
        for name in ("tau", "step_ms", "ar_ms"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be positive and finite, got {v}")

    @property
    def c(self) -> float:
        """Relative step cost c(N) = T_step(N) / T_AR (dimensionless)."""
        return self.step_ms / self.ar_ms

    @property
    def speedup(self) -> float:
        """Speedup over AR = τ(N) / c(N)."""
        return self.tau / self.c

    def to_dict(self) -> dict:
        """All figures: tau, step_ms, ar_ms, rows, c, speedup."""
        return {"tau": self.tau, "step_ms": self.step_ms, "ar_ms": self.ar_ms, "rows": self.rows,
                "c": self.c, "speedup": self.speedup}


@dataclass
class ClassCost:
    """One kernel class of a step: measured ms, floor ms, FLOPs, bytes; ``ratio`` = measured / floor."""

    measured_ms: float
    floor_ms: float
    flops: float
    bytes: float

    @property
    def ratio(self) -> float | None:
        """measured_ms / floor_ms, or None when the class has no floor (no counted work)."""
        return _ratio(self.measured_ms, self.floor_ms)


@dataclass
class Ceiling:
    """Remaining headroom of a system as ``tree · kernel · outside`` (§3.2).

    Attributes:
        tau_current: τ of the current system (tokens per exact pass, > 0).
        tau_best: τ the best tree of the same N could reach (oracle, from the caller, > 0).
        step_ms: measured step time, ms (> 0).
        classes: per kernel class, per step: measured ms, floor ms, FLOPs, bytes.
        cost: the current system's :class:`CostModel`, when T_AR is known (for :attr:`ceiling_speedup`).
        peaks: the device peaks the floors came from (reported only).
    Raises:
        ValueError: on construction when a τ or the step time is not positive, or the profiled time
            or the summed floor is zero (nothing was profiled / counted).
    """

    tau_current: float
    tau_best: float
    step_ms: float
    classes: dict[str, ClassCost]
    cost: CostModel | None = None
    peaks: DevicePeaks | None = None

    def __post_init__(self):
        for name in ("tau_current", "tau_best", "step_ms"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be positive and finite, got {v}")
        if any(c.measured_ms < 0 for c in self.classes.values()):
            raise ValueError("measured class times must be >= 0")
        if self.profiled_ms <= 0:
            raise ValueError("profiled time is zero: run the step under a StepProfiler")
        if self.floor_ms <= 0:
            raise ValueError("byte floor is zero: no FLOP/byte counts for the profiled classes")

    @property
    def profiled_ms(self) -> float:
        """Sum of measured class times per step, ms."""
        return sum(c.measured_ms for c in self.classes.values())

    @property
    def floor_ms(self) -> float:
        """Sum of class byte floors per step, ms."""
        return sum(c.floor_ms for c in self.classes.values())

    @property
    def tree(self) -> float:
        """Tree factor τ_best / τ_current."""
        return self.tau_best / self.tau_current

    @property
    def kernel(self) -> float:
        """Kernel factor: profiled ms / byte floor ms (below 1 means the peaks understate the device)."""
        return self.profiled_ms / self.floor_ms

    @property
    def outside(self) -> float:
        """Outside-profile factor: measured step ms / profiled ms."""
        return self.step_ms / self.profiled_ms

    @property
    def ceiling(self) -> float:
        """Headroom ``tree · kernel · outside`` (multiplies the current speedup)."""
        return self.tree * self.kernel * self.outside

    @property
    def ceiling_speedup(self) -> float | None:
        """Speedup over AR at the ceiling, ``speedup · ceiling`` = τ_best·T_AR / floor; None without cost."""
        return None if self.cost is None else self.cost.speedup * self.ceiling

    def factors(self) -> dict[str, float]:
        """``{"tree", "kernel", "outside"}`` factor values."""
        return {"tree": self.tree, "kernel": self.kernel, "outside": self.outside}

    def explanations(self) -> dict[str, str]:
        """Why a factor is below 1 (headroom cannot be negative), per factor name; empty when none is."""
        out = {}
        if self.kernel < 1:
            out["kernel"] = (f"kernel {self.kernel:.2f} < 1: the profiled kernels ran faster than the byte floor at "
                             "the measured peaks allows, so the peaks understate this device for these kernels "
                             "(weights small enough to stay in cache, or peaks taken while the machine was busy); "
                             "read it as no kernel headroom")
        if self.outside < 1:
            out["outside"] = (f"outside {self.outside:.2f} < 1: the profiled run's region times sum to more than the "
                              "timed run's step (the profiler synchronises at every region, costliest on a "
                              "launch-bound target); read it as no time outside the profiled regions")
        return out

    def largest_factor(self) -> str:
        """Name of the largest factor (``tree``, ``kernel`` or ``outside``): what the next round attacks."""
        f = self.factors()
        return max(f, key=f.get)

    def to_dict(self) -> dict:
        """Every figure, JSON-ready: τs, times (ms), factors, ceiling, and per class
        ``{measured_ms, floor_ms, flops, bytes, ratio}``, plus the cost model and peaks when known."""
        return {
            "tau_current": self.tau_current,
            "tau_best": self.tau_best,
            "step_ms": self.step_ms,
            "profiled_ms": self.profiled_ms,
            "floor_ms": self.floor_ms,
            "factors": self.factors(),
            "ceiling": self.ceiling,
            "largest_factor": self.largest_factor(),
            "explanations": self.explanations(),
            "ceiling_speedup": self.ceiling_speedup,
            "cost": None if self.cost is None else self.cost.to_dict(),
            "peaks": None if self.peaks is None else self.peaks.to_dict(),
            "classes": {
                k: {"measured_ms": c.measured_ms, "floor_ms": c.floor_ms, "flops": c.flops,
                    "bytes": c.bytes, "ratio": c.ratio}
                for k, c in self.classes.items()
            },
        }


def build_ceiling(
    totals_ms: dict[str, float],
    counts: dict[str, tuple[float, float]],
    peaks: DevicePeaks,
    step_ms: float,
    tau_current: float,
    tau_best: float,
    steps: int = 1,
    ar_ms: float | None = None,
    rows: int = 0,
    launches: dict[str, int] | None = None,
) -> Ceiling:
    """Assemble the §3.2 ceiling from a profile, per-step counts and device peaks.

    Args:
        totals_ms: :meth:`StepProfiler.totals_ms` accumulated over ``steps`` steps, ms.
        counts: per-step ``{class: (flops, bytes)}`` from :func:`step_counts`.
        peaks: :func:`specpilot.pilot.profiler.measure_peaks` result.
        step_ms: measured wall time per step, ms (T_step(N)).
        tau_current: τ of the current system; tau_best: the oracle's τ at the same N.
        steps: number of steps ``totals_ms`` covers (> 0); times are divided by it.
        ar_ms: T_AR in ms, when known (adds the :class:`CostModel`).
        rows: N, for the report.
        launches: per-step kernel launches per class (:func:`pass_launches`): the launch floor of each class.
    Returns:
        :class:`Ceiling` over the union of profiled and counted classes, in :data:`KERNEL_CLASSES` order
        (unknown profiled names follow).
    Raises:
        ValueError: for steps < 1 and the conditions of :class:`Ceiling` / :class:`CostModel`.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    names = [k for k in KERNEL_CLASSES if k in totals_ms or k in counts]
    names += [k for k in totals_ms if k not in names]
    classes = {}
    for k in names:
        f, nb = counts.get(k, (0, 0))
        classes[k] = ClassCost(totals_ms.get(k, 0.0) / steps, byte_floor_ms(f, nb, peaks, (launches or {}).get(k, 0)),
                               f, nb)
    cost = None if ar_ms is None else CostModel(tau_current, step_ms, ar_ms, rows)
    return Ceiling(tau_current, tau_best, step_ms, classes, cost, peaks)

