"""Triton's CPU interpreter (``TRITON_INTERPRET=1``) as shipped with Triton 3.6, made usable with numpy ≥ 2.4.

Triton 3.6's interpreter turns a runtime loop bound (a loaded scalar, a one-element array) into a Python int with
``int(array)``, which numpy ≥ 2.4 refuses for arrays of shape ``(1,)`` ("only 0-dimensional arrays can be
converted to Python scalars"; triton-lang/triton#9171, fixed upstream by #9172). Every W12 kernel has such a
loop, so without this the CPU reference runs of the kernels fail for any user with a current numpy.
:func:`fix_interpreter_index` patches the interpreter's tensor ``__index__`` to read the one element instead; it
is applied on import of the kernel modules when the interpreter is active, and does nothing otherwise.
"""

from __future__ import annotations

import os


def fix_interpreter_index() -> bool:
    """Patch Triton's interpreter (idempotent). Returns True when the patch is in place, False when Triton or its
    interpreter module is absent or does not have the patched hook (another Triton version: left alone)."""
    try:
        from triton.runtime import interpreter as it
    except ImportError:
        return False
    orig = getattr(it, "_patch_lang_tensor", None)
    if orig is None:
        return False
    if getattr(orig, "_specpilot_shim", False):
        return True

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._specpilot_shim = True
    it._patch_lang_tensor = patched
    return True


def apply_if_interpreting() -> bool:
    """:func:`fix_interpreter_index` when ``TRITON_INTERPRET`` is set to a true value; else nothing (False)."""
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on"):
        return fix_interpreter_index()
    return False


__all__ = ["apply_if_interpreting", "fix_interpreter_index"]
