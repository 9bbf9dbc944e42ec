"""Triton in tests: compiled on CUDA, the interpreter on the CPU (TRITON_INTERPRET=1, set by conftest.py)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


if not CUDA:
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(triton.language.standard.zeros, InterpretedFunction):
        raise RuntimeError("TRITON_INTERPRET=1 must be set before triton is first imported (tests/conftest.py "
                           "sets it when there is no CUDA); run this file with TRITON_INTERPRET=1")
    from .conftest import fix_interpreter_index

    assert fix_interpreter_index()  # applied by conftest.py when the interpreter is on (numpy >= 2.4, triton#9171)
