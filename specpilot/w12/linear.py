"""The W12 linear layer (§4.1): ``y = x Wᵀ + b`` with the bf16 weight held in W12 records, ~12 bits a weight.

:class:`W12Linear` picks, per call, the way that is fastest for the pass and equal to the bf16 layer: the W12
kernels (:func:`~specpilot.w12.gemm.w12_gemm`) for decode-sized passes on CUDA, one dense decode then cuBLAS for
wide passes (:func:`~specpilot.w12.dense.w12_decode_dense`, above :data:`DENSE_ROWS` rows), and the plain PyTorch
reference (:func:`~specpilot.w12.gemm.w12_gemm_reference`) elsewhere. :mod:`specpilot.w12.convert` puts it into a
model (the ``w12`` mechanism).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specpilot.w12.dense import w12_decode_dense
from specpilot.w12.escapes import W12GemmError, escape_table
from specpilot.w12.format import W12FormatError, W12Tensor, decode, encode
from specpilot.w12.gemm import _linear_f32, _w12_gemm
from specpilot.w12.launch import MAX_ROWS

try:
    import triton
except ImportError:  # CPU installs without triton: the reference still works
    triton = None

#: W12Linear decodes to bf16 and calls cuBLAS for passes of more than this many rows
#: (:mod:`specpilot.w12.dense`; the tensor-core W12 kernel up to it). H200, Qwen3-8B projections
#: (``results/w12_dense_probe_h200_2026-11-30.json``):
#: at 128 rows the record-word kernel is faster on o / gate_up / down (29.9 / 151.9 / 74.0 µs vs 37.2 /
#: 159.7 / 88.8), from 192 rows decode + cuBLAS is faster on all four (gate_up 163.0 vs 225.5 µs)
DENSE_ROWS = 128


class W12Linear(nn.Module):
    """A linear layer ``y = x Wᵀ + b`` whose bf16 weight is held in W12 (§4.1): ~12 bits a weight.

    Buffers (move with ``.to(device)``; ``.to(dtype)`` casts only the bias): ``records`` uint8
    ``[ceil(N/128), ceil(K/64), 12288]``, ``base`` uint8 ``[N]``, ``esc_idx`` int32/int64 ``[E]``, ``esc_val``
    int16 ``[E]`` (the :class:`~specpilot.w12.format.W12Tensor`), the kernel's escape table ``esc_row_ptr``
    int32 ``[N + 1]``, ``esc_k`` int32 ``[4N + O]``, ``esc_delta_bits`` int32 ``[4N + O]`` (float32 bits, so a dtype
    cast leaves them alone; :func:`~specpilot.w12.escapes.escape_table`'s layout), and ``bias`` ``[N]`` or None.

    Forward: :func:`~specpilot.w12.gemm.w12_gemm` on CUDA for bf16 / float32 activations up to
    :data:`DENSE_ROWS` rows; wider passes (prefill) decode the weight once with
    :func:`~specpilot.w12.dense.w12_decode_dense` and call ``F.linear`` (bf16: bit for bit the bf16
    layer's output); elsewhere the reference, :func:`~specpilot.w12.gemm.w12_gemm_reference` (in float32 bitwise
    ``nn.Linear`` with the decoded weight). On CUDA (float16 activations) the reference decodes on every call and
    caches nothing; on the CPU, where the path exists for correctness tests and a full decode per pass would
    dominate, the decoded bf16 weight is
    kept after the first call (2 more bytes a weight, not a buffer: ``state_dict`` holds the records only).
    ``use_kernel``: None = as above; True forces the kernel (the Triton interpreter on the CPU in tests);
    False forces the reference.
    """

    def __init__(self, w12: W12Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        w12.validate()
        self.out_features, self.in_features = w12.shape
        self.sha256 = w12.sha256
        for name in ("records", "base", "esc_idx", "esc_val"):
            self.register_buffer(name, getattr(w12, name))
        row_ptr, esc_k, delta = escape_table(w12)
        self.register_buffer("esc_row_ptr", row_ptr)
        self.register_buffer("esc_k", esc_k)
        self.register_buffer("esc_delta_bits", delta.view(torch.int32))
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise W12GemmError(f"bias must be [{self.out_features}], got {tuple(bias.shape)}")
        self.register_buffer("bias", None if bias is None else bias.detach().to(w12.records.device))
        self.use_kernel: bool | None = None
        self._dense: torch.Tensor | None = None  # CPU only: the decoded weight, see the class docstring

    @classmethod
    def from_w12(cls, w12: W12Tensor, bias: torch.Tensor | None = None) -> "W12Linear":
        """Wrap an encoded weight (e.g. from a packed directory) and an optional bias ``[N]``."""
        return cls(w12, bias)

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> "W12Linear":
        """Encode ``layer``'s weight on its device (losslessly) and keep its bias.

        Raises:
            W12FormatError: the weight is not made of bfloat16 values (W12 is lossless only for bf16; a
                float32 / float16 weight qualifies when every value is exactly a bf16 value, e.g. a bf16
                checkpoint loaded in float32).
        """
        w = layer.weight.detach()
        wb = w.to(torch.bfloat16)
        if w.dtype != torch.bfloat16 and not torch.equal(wb.to(w.dtype), w):
            raise W12FormatError(f"W12 needs bfloat16 weights: this {str(w.dtype).removeprefix('torch.')} weight "
                                 f"{tuple(w.shape)} has values that are not bfloat16 values (use a bf16 checkpoint)")
        return cls(encode(wb, device=w.device), layer.bias)

    def w12(self) -> W12Tensor:
        """The held weight as a :class:`~specpilot.w12.format.W12Tensor` (views of the buffers)."""
        return W12Tensor(self.records, self.base, self.esc_idx, self.esc_val, (self.out_features, self.in_features),
                         self.sha256)

    def escapes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kernel's escape table of the held weight: ``(row_ptr int32 [N + 1], k int32 [4N + O], delta float32
        [4N + O])`` (views of the buffers; :func:`~specpilot.w12.escapes.escape_table`'s layout, O the escapes past a
        channel's 4 slots)."""
        return self.esc_row_ptr, self.esc_k, self.esc_delta_bits.view(torch.float32)

    def decoded_weight(self) -> torch.Tensor:
        """The exact bf16 weight ``[N, K]`` (reference decode; checks nothing)."""
        return decode(self.w12(), check=False)

    def _kernel_ok(self, x: torch.Tensor) -> bool:
        if self.use_kernel is not None:
            return self.use_kernel
        return x.is_cuda and triton is not None and x.dtype in (torch.bfloat16, torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` -> ``[..., N]`` in x's dtype. Raises W12GemmError when the last dim is not K."""
        if x.shape[-1] != self.in_features:
            raise W12GemmError(f"W12Linear takes {self.in_features} features, got shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0 or not self._kernel_ok(x2):
            w = self._dense if self._dense is not None and self._dense.device == self.records.device else None
            if w is None:
                w = self.decoded_weight()
                self._dense = None if w.is_cuda else w
            y = _linear_f32(x2, w, self.bias)
        elif x2.shape[0] > DENSE_ROWS:  # wide pass (prefill): decode once, then the bf16 model's own GEMM
            w = w12_decode_dense(self.w12())
            y = F.linear(x2, w, self.bias) if x2.dtype == torch.bfloat16 else _linear_f32(x2, w, self.bias)
        else:
            esc = self.escapes()
            w12 = self.w12()  # its own escape_table: trusted, no value check and no sync
            y = torch.cat([_w12_gemm(x2[i:i + MAX_ROWS], w12, self.bias, esc, {}, trusted=True)
                           for i in range(0, x2.shape[0], MAX_ROWS)]) if x2.shape[0] > MAX_ROWS else \
                _w12_gemm(x2, w12, self.bias, esc, {}, trusted=True)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, escapes={self.esc_idx.numel()}")



__all__ = ["W12Linear", "DENSE_ROWS"]
