"""Triton in tests: compiled on CUDA, the interpreter on the CPU (TRITON_INTERPRET=1, set by conftest.py)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _fix_interpreter_index():
    """Triton 3.6's interpreter does ``int(array_of_shape_1)`` for a runtime loop bound (a loaded scalar),
    which numpy >= 2.4 rejects (triton-lang/triton#9171, fixed upstream by #9172). Patch it for tests."""
    from triton.runtime import interpreter as it

    orig = it._patch_lang_tensor
    if getattr(orig, "_specpilot_shim", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._specpilot_shim = True
    it._patch_lang_tensor = patched


if not CUDA:
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(triton.language.standard.zeros, InterpretedFunction):
        raise RuntimeError("TRITON_INTERPRET=1 must be set before triton is first imported (tests/conftest.py "
                           "sets it when there is no CUDA); run this file with TRITON_INTERPRET=1")
    _fix_interpreter_index()
