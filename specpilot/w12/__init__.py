"""W12 lossless 12-bit weights (§4.1): the format (:mod:`.format`), the directory pack/verify/load tools
(:mod:`.pack`) and their ``specpilot w12`` commands (:mod:`.cli`)."""

from specpilot.w12.format import W12FormatError, W12Tensor, approx_view, decode, encode

__all__ = ["W12FormatError", "W12Tensor", "approx_view", "decode", "encode"]
