"""Step profiler by kernel class and one-off device peak measurement (seed paper §2.1, §3.2).

:class:`StepProfiler` is the ``prof`` object the engine and model pass around: ``prof.region(name)``
times the work inside it under kernel class ``name`` (``projections``, ``attention``,
``norms_elementwise``, ``lm_head``, ``recurrent``, ``drafter``, ``other``). Nested regions never double
count: entering a region pauses the enclosing one, so each instant counts to the innermost region only.

:func:`measure_peaks` measures the device's peak dense matmul throughput (FLOP/s) and memory bandwidth
(bytes/s) once; the cost model turns them into byte floors (§3.2's 60% / 90% rule).
"""

from __future__ import annotations

import contextlib
import platform
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch

_clock = time.perf_counter  # CPU clock in s (a module global so tests can substitute a fake clock)


class StepProfiler:
    """Accumulates wall time (ms) and entry counts per kernel class over one or more steps (§3.2).

    On CPU times come from ``time.perf_counter``. On CUDA each boundary records a ``torch.cuda.Event``
    on the current stream; the events are synchronised and turned into ms only in :meth:`finish`
    (called by :meth:`totals_ms`), so profiling adds no host-device sync inside the step.

    Args:
        device: the device the profiled work runs on (``"cpu"``, ``"cuda"``, ``torch.device``).
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        """Drop all accumulated times and counts. Raises RuntimeError inside an open region."""
        if getattr(self, "_stack", None):
            raise RuntimeError("reset() inside an open profiling region")
        self._ms: dict[str, float] = defaultdict(float)
        self._calls: dict[str, int] = defaultdict(int)
        self._stack: list[list] = []  # [name, start mark] of each open region, innermost last
        self._pending: list[tuple[str, object, object]] = []  # CUDA (name, start event, end event)

    def _mark(self):
        if self._cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return _clock()

    def _add(self, name: str, start, end) -> None:
        if self._cuda:
            self._pending.append((name, start, end))
        else:
            self._ms[name] += (end - start) * 1e3

    @contextlib.contextmanager
    def region(self, name: str):
        """Context manager: time the enclosed work under kernel class ``name`` (ms).

        An enclosing region is paused for the duration, so time counts only to the innermost region.
        Exceptions propagate; the region is still closed.
        """
        now = self._mark()
        if self._stack:
            outer = self._stack[-1]
            self._add(outer[0], outer[1], now)
        self._stack.append([name, now])
        self._calls[name] += 1
        try:
            yield self
        finally:
            end = self._mark()
            _, start = self._stack.pop()
            self._add(name, start, end)
            if self._stack:
                self._stack[-1][1] = end  # resume the enclosing region

    def finish(self) -> None:
        """Synchronise pending CUDA events and fold them into the totals (a no-op on CPU)."""
        if self._cuda and self._pending:
            torch.cuda.synchronize(self.device)
            for name, a, b in self._pending:
                self._ms[name] += a.elapsed_time(b)
            self._pending = []

    def totals_ms(self) -> dict[str, float]:
        """Accumulated time per kernel class, ms (over every step since :meth:`reset`)."""
        self.finish()
        return dict(self._ms)

    def total_ms(self) -> float:
        """Sum of :meth:`totals_ms` over all classes: the profiled time, ms."""
        return sum(self.totals_ms().values())

    def calls(self) -> dict[str, int]:
        """Number of times each region was entered since :meth:`reset`."""
        return dict(self._calls)

    def overhead_ms(self, n: int = 2000) -> float:
        """Time one empty region attributes to itself, ms per call (the profiler's own cost, measured on a
        scratch profiler of the same device). On CUDA events time the GPU, so this is ~0 there."""
        probe = StepProfiler(self.device)
        for _ in range(n):
            with probe.region("probe"):
                pass
        return probe.totals_ms().get("probe", 0.0) / n

    def calibrated_totals_ms(self) -> dict[str, float]:
        """:meth:`totals_ms` less each class's calls × :meth:`overhead_ms` (floored at 0), ms."""
        per_call = self.overhead_ms()
        calls = self.calls()
        return {k: max(0.0, v - calls.get(k, 0) * per_call) for k, v in self.totals_ms().items()}


@dataclass
class DevicePeaks:
    """Measured peaks of one device (§3.2).

    Attributes:
        flops_per_s: best square-matmul throughput in the deployment dtype, FLOP/s.
        bytes_per_s: best large-copy bandwidth, bytes/s (bytes read + bytes written).
        device_name: human-readable device name.
        method: how the figures were measured (sizes, dtype, repeats).
        launch_s: seconds per back-to-back launch of a tiny kernel (the per-launch latency floor of a
            launch-bound pass; 0 when not measured).
    """

    flops_per_s: float
    bytes_per_s: float
    device_name: str
    method: str
    launch_s: float = 0.0

    def to_dict(self) -> dict:
        """Plain dict of the fields (for reports / JSON)."""
        return asdict(self)

    def rechecked(self, again: "DevicePeaks", slack: float = 0.2) -> tuple["DevicePeaks", str | None]:
        """These peaks against a later measurement ``again`` of the same device: the higher of each peak and the
        lower launch latency (a busy machine only ever makes them worse), and a warning when either rose by more than ``slack`` (a fraction),
        i.e. the first measurement was taken while something else ran. Returns ``(peaks, warning or None)``."""
        launch = min((x for x in (self.launch_s, again.launch_s) if x > 0), default=0.0)
        best = DevicePeaks(max(self.flops_per_s, again.flops_per_s), max(self.bytes_per_s, again.bytes_per_s),
                           self.device_name, f"{self.method.split('; re-checked: ')[0]}; re-checked: {again.method}; "
                           "the better of each kept",
                           launch)
        rose = [f"{name} {new / old - 1:+.0%}" for name, old, new in
                (("matmul", self.flops_per_s, again.flops_per_s), ("bandwidth", self.bytes_per_s, again.bytes_per_s))
                if new > (1 + slack) * old]
        if not rose:
            return best, None
        return best, ("peaks re-measured higher than before (" + ", ".join(rose) + "): the machine was busy when "
                      "they were first taken; the byte floor now uses the higher")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    proc = platform.processor() or platform.machine()
    return f"{device.type} {proc} ({torch.get_num_threads()} threads)".strip()


def _best_ms(fn, device: torch.device, budget_s: float, min_reps: int = 2, max_reps: int = 20) -> float:
    """Best time of ``fn()`` in ms, after one warm-up, repeated until ``budget_s`` seconds or max_reps."""
    cuda = device.type == "cuda"
    fn()  # warm-up (page faults, kernel selection)
    if cuda:
        torch.cuda.synchronize(device)
    best = float("inf")
    t_end = time.perf_counter() + budget_s
    reps = 0
    while reps < min_reps or (reps < max_reps and time.perf_counter() < t_end):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        best = min(best, ms)
        reps += 1
    return max(best, 1e-6)


def measure_peaks(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seconds_budget: float = 2.0,
    matmul_n: int | None = None,
    copy_bytes: int | None = None,
) -> DevicePeaks:
    """Measure peak matmul FLOP/s and memory bandwidth of ``device`` once (§3.2 byte floor inputs).

    Matmul: ``[n, n] @ [n, n]`` in ``dtype`` (2·n³ FLOPs), best of a few. Bandwidth: ``dst.copy_(src)``
    of a ``copy_bytes`` uint8 tensor, counting bytes read + written (2·copy_bytes), best of a few.
    The copy is several times the last-level cache so it measures DRAM/HBM, not cache.

    Args:
        device: device to measure.
        dtype: deployment dtype of the target's matmuls (e.g. ``torch.bfloat16`` on GPU).
        seconds_budget: rough wall-time budget in s, split between the two measurements (plus warm-ups).
        matmul_n: matmul side; default 1024 on CPU, 8192 on GPU.
        copy_bytes: copy size in bytes; default 256 MiB on CPU, 2 GiB on GPU.
    Returns:
        :class:`DevicePeaks` with FLOP/s and bytes/s.
    Raises:
        RuntimeError: from torch when the device is unavailable or memory cannot be allocated.
    """
    device = torch.device(device)
    gpu = device.type != "cpu"
    n = matmul_n or (8192 if gpu else 1024)
    nbytes = copy_bytes or ((2 << 30) if gpu else (256 << 20))

    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    mm_ms = _best_ms(lambda: torch.mm(a, b), device, seconds_budget / 2)
    del a, b

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    cp_ms = _best_ms(lambda: dst.copy_(src), device, seconds_budget / 2)
    del src, dst
    launch_s, how = launch_latency_s(device)

    return DevicePeaks(
        flops_per_s=2.0 * n**3 / (mm_ms * 1e-3),
        bytes_per_s=2.0 * nbytes / (cp_ms * 1e-3),
        device_name=_device_name(device),
        method=(
            f"matmul {n}x{n}x{n} {str(dtype).removeprefix('torch.')} best {mm_ms:.3f} ms; "
            f"copy_ {nbytes / 2**20:.0f} MiB (read+write) best {cp_ms:.3f} ms; {how}"
        ),
        launch_s=launch_s,
    )


def launch_latency_s(device: torch.device | str, launches: int = 200) -> tuple[float, str]:
    """Seconds per back-to-back launch of a one-element kernel, and how it was measured: on CUDA a graph of
    ``launches`` adds replayed (the engine replays its steps as graphs), on the CPU ``10 · launches`` eager adds
    (the per-op dispatch an eager step pays); best of 5. The floor of a pass whose kernels are too small to be
    bound by FLOPs or bytes (§3.2)."""
    device = torch.device(device)
    x = torch.zeros(1, device=device)
    if device.type == "cuda":
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            x.add_(1)
        torch.cuda.current_stream(device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(launches):
                x.add_(1)
        ms = _best_ms(g.replay, device, 0.2, min_reps=5)
        return ms * 1e-3 / launches, f"{launches} one-element adds in a CUDA graph best {ms:.3f} ms"
    n = 10 * launches
    ms = _best_ms(lambda: [x.add_(1) for _ in range(n)], device, 0.2, min_reps=5)
    return ms * 1e-3 / n, f"{n} eager one-element adds best {ms:.3f} ms"
