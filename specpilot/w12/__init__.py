"""W12 lossless 12-bit weights (§4.1): the format (:mod:`.format`), checkpoint directories (:mod:`.pack` writes,
:mod:`.verify` checks and loads; ``specpilot w12``, :mod:`.cli`), the linear layer (:mod:`.linear`) and the ``w12``
mechanism (:mod:`.convert`), and the kernels: dispatch and reference (:mod:`.gemm`), launch rules (:mod:`.launch`),
the one-row GEMV (:mod:`.gemv`), the tensor-core kernels (:mod:`.mma`, :mod:`.mma_bytes`), their shared parts
(:mod:`.tiles`, :mod:`.epilogue`, :mod:`.escapes`), the wide-pass decode (:mod:`.dense`) and the one-row fusions
(:mod:`.norm`, :mod:`.swiglu`)."""

from specpilot.w12.format import W12FormatError, W12Tensor, approx_view, decode, encode

__all__ = ["W12FormatError", "W12Tensor", "approx_view", "decode", "encode"]
