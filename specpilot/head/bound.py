"""The certified INT8 head's rounding arithmetic (§4.1), shared by the reference (:mod:`specpilot.head.certified`) and
the Triton path (:mod:`specpilot.head.kernel`), and the scope in which the exact head's GEMM must run.

A dot product computed with inputs rounded with unit ``u_in``, any summation order with unit ``u_acc`` and a final
rounding ``u_out`` is off by at most ``eps * sum_k |x_k y_k|`` with ``eps = (1 + u_out)(1 + u_in)^2 (1 + gamma_K)
- 1``, ``gamma_K = K u_acc / (1 - K u_acc)`` (Higham, Accuracy and Stability of Numerical Algorithms, §3.1; any
order, FMA or not). :func:`gamma` and :func:`eps` compute these; :data:`U_OUT` is ``u_out`` of each head dtype;
:func:`matmul_units` gives ``(u_in, u_acc)`` of the device's matmuls.

:func:`fp32_reduction`: the bound of the exact head (the engine's ``F.linear(h, W)`` over all rows, whose argmax the
certified head must reproduce) takes ``u_acc`` of a float32 accumulator. cuBLAS may reduce bf16 / fp16 GEMMs in
reduced precision (split-K partial sums in the 16-bit type) unless
``torch.backends.cuda.matmul.allow_{bf16,fp16}_reduced_precision_reduction`` is False, and then the bound does not
hold. Every exact-head GEMM of the certified head runs inside this context manager, which turns both flags off for
the call only and restores them (also inside CUDA-graph capture: cuBLAS reads the flags when the GEMM is issued, so
the captured kernel is the float32-reducing one). No process-wide switch: other GEMMs keep the process's setting.
"""

from __future__ import annotations

import contextlib

import torch

from specpilot.errors import SpecPilotError

#: unit roundoff of the exact head's output dtype (its float32 accumulator rounded to W's dtype)
U_OUT = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}

_FLAGS = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")


def gamma(n: int, u: float) -> float:
    """``gamma_n = n u / (1 - n u)`` (Higham's constant for a sum of ``n`` terms with unit ``u``).
    Raises SpecPilotError when ``n u >= 1/2`` (no useful bound)."""
    if n * u >= 0.5:
        raise SpecPilotError(f"hidden size {n} too large for a certified bound with unit {u:g}")
    return n * u / (1 - n * u)


def eps(k: int, u_in: float, u_acc: float, u_out: float) -> float:
    """Relative error factor of a ``k``-term dot product: ``(1 + u_out)(1 + u_in)^2 (1 + gamma_k(u_acc)) - 1`` (module
    docstring), to be multiplied by ``sum_k |x_k y_k|``. Raises SpecPilotError as :func:`gamma`."""
    return (1 + u_out) * (1 + u_in) ** 2 * (1 + gamma(k, u_acc)) - 1


def matmul_units(weight: torch.Tensor) -> tuple[float, float]:
    """``(u_in, u_acc)`` of the exact head's GEMM on ``weight``'s device (its dtype's accumulation in float32, as
    :func:`fp32_reduction` guarantees): ``u_acc = 2^-24`` on the CPU, ``2^-23`` on CUDA (tensor-core accumulators
    may truncate); ``u_in = 0`` for float32 matmuls at ``torch.get_float32_matmul_precision() == "highest"`` without
    TF32, else ``2^-8`` (covers TF32 and bf16 passes). Read at call time (the TF32 / precision settings are the
    process's own)."""
    cuda = weight.device.type == "cuda"
    tf32 = cuda and bool(torch.backends.cuda.matmul.allow_tf32)
    u_in = 2.0**-8 if (tf32 or torch.get_float32_matmul_precision() != "highest") else 0.0
    return u_in, (2.0**-23 if cuda else 2.0**-24)


def _get_flag(name: str):
    """The flag's full setting: ``(allow, allow_split_k)`` where torch has the pair (2.9+), else the bool."""
    getter = getattr(torch._C, f"_get_cublas_{name}", None)
    return getter() if getter is not None else getattr(torch.backends.cuda.matmul, name)


@contextlib.contextmanager
def fp32_reduction(device: torch.device):
    """Inside: bf16 / fp16 cuBLAS GEMMs reduce in float32 (both ``allow_*_reduced_precision_reduction`` flags
    False), as the certified bound assumes of the exact head (module docstring); on exit both flags are restored to
    exactly what they were (the split-K half too). Nothing happens off CUDA (the flags are cuBLAS's). The flags are
    process-wide while inside, so a GEMM another thread issues meanwhile also reduces in float32 (more precise,
    never less). Raises nothing of its own."""
    if torch.device(device).type != "cuda":
        yield
        return
    m = torch.backends.cuda.matmul
    saved = {name: _get_flag(name) for name in _FLAGS}
    try:
        for name in _FLAGS:
            setattr(m, name, False)
        yield
    finally:
        for name, value in saved.items():
            setattr(m, name, value)


__all__ = ["U_OUT", "eps", "fp32_reduction", "gamma", "matmul_units"]
