"""GPU kernel time by kernel class, from the PyTorch profiler (paper §3.2: the kernel factor needs
time per kernel class, which a replayed CUDA graph hides from Python timers).

Inside a replayed CUDA graph there are no Python regions to time, so on the GPU the step is profiled
by kernel: every CUDA kernel the profiler records is put in a class by its name
(:func:`kernel_class`), and the step's wall time is compared with the sum of its kernels' times
(``wall_over_kernels``: 1.0 means no launch gaps or host stalls; above about 1.05 the step loses
time outside its kernels, which the outside-profile factor should show).

The LM head is a GEMM like the projections; it is told apart by position: the GEMMs between the final
norm and the argmax of a pass.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

CLASSES = ("projections", "attention", "lm_head", "norms_elementwise", "drafter", "other")
_GEMM = ("gemm", "nvjet", "cutlass", "splitk", "split_k", "sm90_xmma", "cublas", "_skinny")
_ATTN = ("tree_attn", "_combine", "flash", "fmha", "attention", "sdpa")
_NORM = ("rmsnorm", "norm_kernel")
_ELEMENTWISE = ("rope", "silu", "elementwise", "copy", "index", "cat", "reduce", "mul", "add", "pow", "rsqrt",
                "where", "fill")


def kernel_class(name: str) -> str:
    """Class of a CUDA kernel by its (mangled or Triton) name: ``projections`` (any GEMM; see the module
    docstring for the LM head), ``attention``, ``norms_elementwise`` or ``other``."""
    n = name.lower()
    if any(k in n for k in _ATTN):
        return "attention"
    if any(k in n for k in _GEMM):
        return "projections"
    if any(k in n for k in _NORM + _ELEMENTWISE):
        return "norms_elementwise"
    return "other"


@dataclass
class KernelProfile:
    """Kernel time of ``calls`` calls of one function (all times ms per call).

    wall_ms: host wall time per call measured without the profiler; kernel_ms: summed kernel time per
    call; by_class_ms: kernel time per class; kernels: kernel launches per call; top: the largest
    kernels ``[{name, class, calls, us}]`` per call.
    """

    wall_ms: float
    kernel_ms: float
    kernels: float
    by_class_ms: dict[str, float] = field(default_factory=dict)
    top: list[dict] = field(default_factory=list)

    @property
    def wall_over_kernels(self) -> float:
        """Wall time over kernel time (1.0 = the device never idles during the call)."""
        return self.wall_ms / self.kernel_ms if self.kernel_ms > 0 else float("inf")

    def to_dict(self) -> dict:
        return asdict(self) | {"wall_over_kernels": self.wall_over_kernels}


def _kernel_events(prof) -> list[tuple[float, str, float]]:
    """``(start_us, name, duration_us)`` of every CUDA kernel / memcpy the profiler saw, in time order."""
    out = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            dur = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
            out.append((ev.time_range.start, ev.name, dur))
    return sorted(out)


def _classify_passes(events) -> list[tuple[str, str, float]]:
    """``(name, class, us)`` per kernel, the LM head relabelled: the GEMMs between an ``ArgMax`` kernel
    (the verify step's greedy read) and the last norm kernel (``rmsnorm`` / ``rsqrt``) before it."""
    labelled = [(name, kernel_class(name), dur) for _, name, dur in events]
    last_norm = None
    for i, (name, cls, dur) in enumerate(labelled):
        n = name.lower()
        if "rmsnorm" in n or "rsqrt" in n:
            last_norm = i
        elif "argmax" in n and last_norm is not None:
            for j in range(last_norm + 1, i):
                if labelled[j][1] == "projections":
                    labelled[j] = (labelled[j][0], "lm_head", labelled[j][2])
            last_norm = None
    return labelled


def profile_kernels(fn, calls: int = 20, warmup: int = 3) -> KernelProfile:
    """Profile ``fn()`` (which must synchronise or read back its result) on CUDA.

    Args:
        fn: the step, e.g. one graph replay plus its host read.
        calls: calls timed (wall) and then profiled (kernels).
    Returns: :class:`KernelProfile`, ms per call.
    Raises: RuntimeError without CUDA.
    """
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        raise RuntimeError("profile_kernels needs CUDA")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / calls
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    labelled = _classify_passes(_kernel_events(prof))
    by_class = {c: 0.0 for c in CLASSES}
    by_name: dict[str, list] = {}
    for name, cls, dur in labelled:
        by_class[cls] += dur / 1e3 / calls
        d = by_name.setdefault(name[:100], [cls, 0, 0.0])
        d[1] += 1
        d[2] += dur
    top = sorted(by_name.items(), key=lambda kv: -kv[1][2])[:20]
    return KernelProfile(
        wall_ms=wall, kernel_ms=sum(by_class.values()), kernels=len(labelled) / calls, by_class_ms=by_class,
        top=[{"name": n, "class": c, "calls": k / calls, "us": us / calls} for n, (c, k, us) in top])


@torch.inference_mode()
def profile_passes(model, rows, prefix_len: int, calls: int = 20) -> dict[int, KernelProfile]:
    """Kernel profiles of the bare exact pass (one graph replay + host read, rows padded to the engine's
    bucket) after ``prefix_len`` committed slots, for each row count in ``rows``. Raises RuntimeError
    without CUDA."""
    from specpilot.engine.runner import BUCKETS, BucketRunner

    dev = model.device
    cache = model.new_cache(prefix_len + BUCKETS[-1] + 1)
    model.forward(torch.zeros(prefix_len, dtype=torch.long, device=dev), torch.arange(prefix_len, device=dev), cache, 0)
    runner = BucketRunner(model, cache, BUCKETS, graphs=True)
    out = {}
    for r in rows:
        toks, pos = list(range(r)), list(range(prefix_len, prefix_len + r))
        out[r] = profile_kernels(lambda: runner.run(toks, pos, prefix_len, None).tolist(), calls=calls)
    return out


def pass_class_fractions_isolated(target_dir: str, dtype: str, device: str, rows: int,
                                  prefix_len: int) -> dict[str, float]:
    """:func:`pass_class_fractions` of the checkpoint in ``target_dir``, run in a fresh (spawned) process.

    Why a process of its own: the PyTorch profiler leaves CUPTI attached after its session ends (Kineto does not
    finalize it; pytorch/pytorch#144455), and from then on every kernel launch of the process costs more. On a
    launch-bound target that slowed the pilot's later live measurements unevenly (a speculative step's eager
    launches more than AR's one graph replay), after the model had been calibrated on measurements taken before
    the first profile. The child's CUPTI ends with it.

    Raises:
        RuntimeError: the child failed (its error in the message) or there is no CUDA.
    """
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as ex:
        try:
            return ex.submit(_fractions_of_dir, str(target_dir), dtype, device, rows, prefix_len).result()
        except Exception as e:  # the child's exception, or a broken pool
            raise RuntimeError(f"kernel profile in a child process failed: {type(e).__name__}: {e}") from None


def _fractions_of_dir(target_dir: str, dtype: str, device: str, rows: int, prefix_len: int) -> dict[str, float]:
    from specpilot.model.checkpoint import load_model

    with torch.inference_mode():
        return pass_class_fractions(load_model(target_dir, dtype, device), rows, prefix_len)


def pass_class_fractions(model, rows: int, prefix_len: int) -> dict[str, float]:
    """Fraction of a graph-replayed exact pass's kernel time per class (:func:`profile_passes`). The pilot
    splits the engine's ``exact_pass`` region (one graph replay, timed with CUDA events inside real steps)
    by these fractions: inside a graph there are no regions to time. Raises RuntimeError without CUDA."""
    prof = profile_passes(model, (rows,), prefix_len, calls=10)[rows]
    return {k: v / prof.kernel_ms for k, v in prof.by_class_ms.items() if v > 0}
