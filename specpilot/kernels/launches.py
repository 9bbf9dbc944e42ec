"""Every Triton launch a CPU run makes, compiled for sm_90a without a GPU.

Triton's interpreter (``TRITON_INTERPRET=1``, how the CPU suite runs every kernel) executes a kernel's Python and
never type-checks it as the compiler does: a name bound in both branches of an ``if`` with two shapes runs there and
fails to compile on the GPU. This closes that gap in two processes, because the interpreter patches
``triton.language`` for the whole process (one process cannot both interpret and compile):

1. :func:`record_launches`, under the interpreter, wraps ``InterpretedFunction.run`` so that each launch is written
   down (the kernel's module and name, each argument: a tensor as its dtype and whether its address is a multiple of
   16, anything else by value; the launch options), then runs it as before.
2. :func:`compile_launches`, without it, installs a driver that answers as an sm_90a GPU would
   (:func:`install_offline_driver`), binds each recorded launch with Triton's own binder (the specialization a real
   launch gets: types, constexprs, 16-divisibility of integers and addresses, options), and compiles each distinct
   one to a cubin with the ``ptxas`` bundled with Triton.

A compile-time check: it says nothing about the compiled kernel's values or speed.
"""

from __future__ import annotations

import importlib
import inspect
import os
import time
from contextlib import contextmanager
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]


def encode_arg(v):
    """A launch argument as JSON: a tensor as ``{"tensor": dtype, "aligned": data_ptr() % 16 == 0}``, a Triton dtype
    as ``{"tl": name}``, a ``tl.constexpr`` as its value, None / bool / int / float / str as themselves. Raises
    TypeError for anything else (the compile step could not rebuild it)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if hasattr(v, "data_ptr") and hasattr(v, "dtype"):
        return {"tensor": str(v.dtype).removeprefix("torch."), "aligned": v.data_ptr() % 16 == 0}
    import triton.language as tl

    if isinstance(v, tl.constexpr):
        return encode_arg(v.value)
    if isinstance(v, tl.dtype):
        return {"tl": v.name}
    raise TypeError(f"cannot record a launch argument of type {type(v).__name__}")


class _OfflineTensor:
    """What Triton's binder reads of a tensor argument: its dtype and an address of the recorded alignment."""

    def __init__(self, dtype, aligned: bool):
        self.dtype = dtype
        self._ptr = 0 if aligned else 8

    def data_ptr(self) -> int:
        return self._ptr


def decode_arg(v):
    """The inverse of :func:`encode_arg` for the compile step (a tensor becomes a stand-in with its dtype and an
    address of its alignment)."""
    if isinstance(v, dict) and "tensor" in v:
        import torch

        return _OfflineTensor(getattr(torch, v["tensor"]), bool(v["aligned"]))
    if isinstance(v, dict) and "tl" in v:
        import triton.language as tl

        return tl.dtype(v["tl"])
    return v


@contextmanager
def record_launches(sink: list):
    """Within the block, append one dict per kernel launch to ``sink``: ``kernel`` (``module:qualname``), ``file``,
    ``line``, ``test`` (the pytest node id, under pytest), ``args`` / ``kwargs`` (:func:`encode_arg`; kwargs hold
    constexprs given by name and launch options such as ``num_warps``) or ``error`` (an argument that could not be
    recorded); the launch then runs as before (see :func:`launches_not_run`).
    Raises RuntimeError when Triton's interpreter is not on (``TRITON_INTERPRET=1`` before triton's first import)."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(triton.language.standard.zeros, InterpretedFunction):
        raise RuntimeError("recording launches needs Triton's interpreter (TRITON_INTERPRET=1 before importing triton)")
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        skip = _state["skip"]
        if not warmup:
            code = self.fn.__code__
            rec = {"kernel": f"{self.fn.__module__}:{self.fn.__qualname__}", "file": _relative(code.co_filename),
                   "line": code.co_firstlineno}
            if os.environ.get("PYTEST_CURRENT_TEST"):  # which test launched it (pytest sets this during a test)
                rec["test"] = os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]
            try:
                rec |= {"args": [encode_arg(a) for a in args], "kwargs": {k: encode_arg(v) for k, v in kwargs.items()}}
            except TypeError as e:
                rec["error"] = str(e)
            sink.append(rec | ({"ran": False} if skip else {}))
        return None if skip else original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    _state["recording"] = True
    try:
        yield sink
    finally:
        InterpretedFunction.run = original
        _state["recording"] = False


_state = {"recording": False, "skip": False}


def recording() -> bool:
    """Whether :func:`record_launches` is recording in this process."""
    return _state["recording"]


@contextmanager
def launches_not_run():
    """Within the block, launches under :func:`record_launches` are recorded (with ``"ran": False``) but not run: for
    launches the interpreter cannot run (bfloat16 tensors: numpy has no bfloat16), whose compile is still worth
    checking because the GPU runs them. Outputs are left as the caller allocated them."""
    _state["skip"] = True
    try:
        yield
    finally:
        _state["skip"] = False


def _relative(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(_ROOT))
    except ValueError:
        return path


def install_offline_driver(arch: int = 90) -> None:
    """Make Triton's active driver one that answers as a CUDA device of compute capability ``arch / 10`` (device 0,
    stream 0) without one, so ``JITFunction.warmup`` binds and compiles for ``sm_{arch}a`` on a machine with no GPU.
    Raises RuntimeError under the interpreter (its kernels are not compiled)."""
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on"):
        raise RuntimeError("offline compiles need TRITON_INTERPRET unset")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class OfflineDriver(DriverBase):
        @classmethod
        def is_active(cls):
            return False

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError("no launcher offline")

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError("nothing runs offline")

        def get_current_device(self):
            return 0

        def set_current_device(self, device):
            pass

        def get_current_stream(self, device=None):
            return 0

    triton.runtime.driver.set_active(OfflineDriver())


def _kernel(name: str):
    module, qual = name.split(":")
    obj = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def _bind(rec: dict):
    """``(jitted kernel, args, kwargs, specialization key, readable specialization, its items)`` of one recorded
    launch, by Triton's own binder (what ``JITFunction.run`` computes before it looks up or compiles a kernel)."""
    fn = _kernel(rec["kernel"])
    args = [decode_arg(a) for a in rec["args"]]
    kwargs = {k: decode_arg(v) for k, v in rec["kwargs"].items()}
    binder = fn.device_caches[0][4]
    _, spec, options = binder(*args, **kwargs)
    names = [p.name for p in fn.params]
    items = [f"{n}={v!r}" if t == "constexpr" else f"{n}:{t}{':' + v if v else ''}" for n, (t, v) in zip(names, spec)]
    opts = dict(sorted(options.items()))
    text = ", ".join(items) + (f" | {opts}" if opts else "")
    return fn, args, kwargs, repr((rec["kernel"], spec, opts)), text, items + [f"{k}={v!r}" for k, v in opts.items()]


def distinct_launches(records: list[dict]) -> list[dict]:
    """The records grouped by specialization (needs :func:`install_offline_driver`): one dict each with the first
    record's ``kernel``, ``file``, ``line``, ``args``, ``kwargs``, plus ``specialization`` (readable: each argument's
    Triton type and ``D`` where it is compiled as divisible by 16, constexpr values, launch options) and ``launches``
    (how many records share it); records whose arguments could not be recorded or bound come back with ``error``."""
    out: dict[str, dict] = {}
    for rec in records:
        if "error" in rec:
            out.setdefault(f"err {len(out)}", dict(rec, launches=1))
            continue
        try:
            *_, key, text, items = _bind(rec)
        except Exception as e:  # a record the binder refuses is a finding too, not a crash of the check
            out[f"err {len(out)}"] = dict(rec, launches=1, error=f"bind: {type(e).__name__}: {e}")
            continue
        if key in out:
            out[key]["launches"] += 1
        else:
            out[key] = dict(rec, specialization=text, items=items, launches=1)
    return list(out.values())


def covering_subset(launches: list[dict]) -> list[dict]:
    """A deterministic subset of :func:`distinct_launches`'s launches that still compiles every kernel with each
    value each of its arguments was seen with: per kernel, greedily the launch that adds the most (argument, type /
    alignment / constexpr value) and (launch option, value) pairs not yet covered, ties to the earliest recorded,
    until every pair is covered. Each value is compiled at least once, not each combination of values (a failure
    that needs two values together may be missed: compile everything for that). Records with ``error`` are kept."""
    keep, by_kernel = [], {}
    for i, r in enumerate(launches):
        if "error" in r:
            keep.append(i)
        else:
            by_kernel.setdefault(r["kernel"], []).append(i)
    for idx in by_kernel.values():
        seen: set = set()
        left = list(idx)
        while left:
            best = max(left, key=lambda i: (len(set(launches[i]["items"]) - seen), -i))
            if not set(launches[best]["items"]) - seen:
                break
            seen |= set(launches[best]["items"])
            keep.append(best)
            left.remove(best)
    return [launches[i] for i in sorted(keep)]


def _compile_one(rec: dict) -> dict:
    t = time.perf_counter()
    try:
        fn, args, kwargs, *_ = _bind(rec)
        fn.warmup(*args, grid=(1,), **kwargs)
        res = {"ok": True, "error": None}
    except Exception as e:  # every compiler failure is reported, whatever its type
        msg = f"{type(e).__name__}: {e}".strip()
        res = {"ok": False, "error": msg if len(msg) <= 4000 else msg[:1000] + "\n...\n" + msg[-2800:]}
    return dict(rec, **res, seconds=round(time.perf_counter() - t, 3))


def _worker_init(arch: int) -> None:
    install_offline_driver(arch)


def compile_launches(records: list[dict], workers: int = 1, arch: int = 90, cover: bool = False) -> list[dict]:
    """Compile each distinct launch of ``records`` (:func:`record_launches`'s dicts) for ``sm_{arch}a``, or with
    ``cover`` only :func:`covering_subset`'s launches (each argument value compiled once, not each combination).

    Runs in this process (``workers <= 1``, after :func:`install_offline_driver`) or in ``workers`` spawned processes.
    Returns one dict per distinct launch (:func:`distinct_launches`'s fields) with ``ok``, ``error`` (the compiler's
    message, None when ok) and ``seconds`` (the compile's wall time, ptxas included), in the records' order.
    Raises RuntimeError under the interpreter."""
    install_offline_driver(arch)
    launches = distinct_launches(records)
    if cover:
        launches = covering_subset(launches)
    todo = [r for r in launches if "error" not in r]
    done = {id(r): dict(r, ok=False, seconds=0.0) for r in launches if "error" in r}
    if workers <= 1:
        results = [_compile_one(r) for r in todo]
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
                                 initargs=(arch,)) as pool:
            results = list(pool.map(_compile_one, todo))
    done |= {id(r): res for r, res in zip(todo, results)}
    return [done[id(r)] for r in launches]


def failure_line(res: dict) -> str:
    """One failed launch as text: the kernel, its file and line, the specialization and the compiler's message."""
    head = f"{res['kernel']} ({res['file']}:{res['line']}) [{res.get('specialization', '?')}]:"
    return head + "\n    " + str(res["error"]).replace("\n", "\n    ")


__all__ = ["compile_launches", "covering_subset", "decode_arg", "distinct_launches", "encode_arg", "failure_line",
           "install_offline_driver", "launches_not_run", "record_launches", "recording"]
