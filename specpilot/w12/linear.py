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
from specpilot.w12.format import W12FormatError, W12Tensor, approx_view, decode, encode
from specpilot.kernels.cpu_linear import PackedLinear, packs
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
    cast leaves them alone; :func:`~specpilot.w12.escapes.escape_table`'s layout), and ``bias`` ``[N]`` or None. Not in
    ``state_dict`` (derived from the buffers above, and rebuilt after ``load_state_dict``): ``esc_view_delta_bits``
    int32 ``[4N + O]``, the deltas of ``escape_table(w12, view=True)`` (the 8-bit view's table: the same rows and
    columns) for :meth:`view_forward`.

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

    :meth:`view_forward`: the Q pass's projection (§4.3), ``x @ approx_view(W)ᵀ + b`` from the 8-bit view.
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
        self.register_buffer("esc_view_delta_bits", escape_table(w12, view=True)[2].view(torch.int32),
                             persistent=False)
        self.use_kernel: bool | None = None
        #: CPU only (see the class docstring): the reference weights once computed, keyed by ``view`` (False: the
        #: decoded weight of :meth:`forward`; True: ``approx_view``'s of :meth:`view_forward`; "packed": the float32
        #: layer that multiplies by the decoded weight, :meth:`_reference`)
        self._kept: dict = {}
        self.register_load_state_dict_post_hook(W12Linear._after_load)

    @classmethod
    def from_w12(cls, w12: W12Tensor, bias: torch.Tensor | None = None) -> "W12Linear":
        """Wrap an encoded weight (e.g. from a packed directory) and an optional bias ``[N]``."""
        return cls(w12, bias)

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> "W12Linear":
        """Encode ``layer``'s weight on its device (losslessly) and keep its bias.

        Raises:
            W12FormatError: the weight is not made of bfloat16 values (W12 is lossless only for bf16; a
                float32 / float16 weight qualifies when every value is bit for bit a bf16 value, e.g. a bf16
                checkpoint loaded in float32, NaN and inf included, which W12 keeps as it keeps a bf16 weight's).
                The message names a NaN that bf16 cannot hold apart from other values.
        """
        w = layer.weight.detach()
        if w.dtype == torch.bfloat16:
            return cls(encode(w, device=w.device), layer.bias)
        if w.dtype == torch.float32:  # a bf16 value is a float32 whose low 16 bits are 0: compare bits, since
            bits = w.view(torch.int32)  # NaN != NaN and torch's cast rewrites a NaN's bits
            bad = (bits & 0xFFFF) != 0
            wb = (bits >> 16).to(torch.int16).view(torch.bfloat16)
        else:
            wb = w.to(torch.bfloat16)
            bad = wb.to(w.dtype) != w
        if bad.any():
            where = [int(i) for i in bad.nonzero()[0]]
            what = (f"{int(bad.sum())} NaN value(s) whose bits are not a bfloat16 NaN (the first at {where}; NaN and "
                    "inf are kept when they are bf16 values, as a bf16 checkpoint's are)" if bool(w[bad].isnan().all())
                    else f"values that are not bfloat16 values (the first at {where}: {w[tuple(where)].item()!r})")
            raise W12FormatError(f"W12 needs bfloat16 weights: this {str(w.dtype).removeprefix('torch.')} weight "
                                 f"{tuple(w.shape)} has {what} (use a bf16 checkpoint)")
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

    def view_escapes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The 8-bit-view kernels' escape table of the held weight, ``escape_table(w12, view=True)``: :meth:`escapes`'
        ``row_ptr`` and ``k`` with the view's deltas ``float32 [4N + O]`` (views of the buffers)."""
        return self.esc_row_ptr, self.esc_k, self.esc_view_delta_bits.view(torch.float32)

    def decoded_weight(self) -> torch.Tensor:
        """The exact bf16 weight ``[N, K]`` (reference decode; checks nothing)."""
        return decode(self.w12(), check=False)

    @staticmethod
    def _after_load(module: "W12Linear", incompatible_keys) -> None:
        """``load_state_dict`` post-hook: rebuild the view deltas from the loaded weight and drop kept weights."""
        module.esc_view_delta_bits = escape_table(module.w12(), view=True)[2].view(torch.int32)
        module._kept.clear()

    def _reference(self, x2: torch.Tensor, view: bool) -> torch.Tensor:
        """The reference path of :meth:`forward` (``view`` False) / :meth:`view_forward` (True): ``x2 [M, K]`` times
        the decoded / ``approx_view`` weight in float32, kept after the first call on the CPU only. On the CPU in
        float32 either product runs as the plain model's own layer does there (a prepacked oneDNN GEMM,
        :class:`~specpilot.kernels.cpu_linear.PackedLinear`, over the decoded / view weight, kept too: 8 more bytes a
        weight each, where :func:`~specpilot.kernels.cpu_linear.packs` says the plain layer is packed), so a W12
        target's logits equal the plain target's bit for bit, and a CPU Q pass costs what an exact pass does at every
        row count (``F.linear``'s MKL path repacks the weight each call: 1.4-2x the packed pass at 3-7 rows on
        SmolLM2's shapes, ``probes/cpu_q_pass.py``)."""
        w = self._kept.get(view)
        if w is None or w.device != self.records.device:
            w = approx_view(self.w12()) if view else self.decoded_weight()
            self._kept.pop(("packed", view), None)
            if w.is_cuda:
                self._kept.pop(view, None)
            else:
                self._kept[view] = w
        if x2.dtype == torch.float32 and not w.is_cuda:
            key = ("packed", view)
            if key not in self._kept:  # None: the plain layer would not be packed either
                wf, b = w.float(), None if self.bias is None else self.bias.float()
                self._kept[key] = PackedLinear.of(wf, b) if packs(wf) else None
            if self._kept[key] is not None:
                return self._kept[key](x2)
        return _linear_f32(x2, w, self.bias)

    def _kernel(self, x2: torch.Tensor, view: bool) -> torch.Tensor:
        """``x2 [M, K]`` through the W12 kernels (the 8-bit view's with ``view``), :data:`MAX_ROWS` rows a launch, with
        the layer's own escape table (trusted: no value check, no sync)."""
        esc, w12 = (self.view_escapes() if view else self.escapes()), self.w12()
        if x2.shape[0] <= MAX_ROWS:
            return _w12_gemm(x2, w12, self.bias, esc, {}, trusted=True, view=view)
        return torch.cat([_w12_gemm(x2[i:i + MAX_ROWS], w12, self.bias, esc, {}, trusted=True, view=view)
                          for i in range(0, x2.shape[0], MAX_ROWS)])

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` as ``[M, K]``. Raises W12GemmError when the last dim is not K."""
        if x.shape[-1] != self.in_features:
            raise W12GemmError(f"W12Linear takes {self.in_features} features, got shape {tuple(x.shape)}")
        return x.reshape(-1, self.in_features)

    def _kernel_ok(self, x: torch.Tensor) -> bool:
        if self.use_kernel is not None:
            return self.use_kernel
        return x.is_cuda and triton is not None and x.dtype in (torch.bfloat16, torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` -> ``[..., N]`` in x's dtype. Raises W12GemmError when the last dim is not K."""
        x2 = self._rows(x)
        if x2.shape[0] == 0 or not self._kernel_ok(x2):
            y = self._reference(x2, view=False)
        elif x2.shape[0] > DENSE_ROWS:  # wide pass (prefill): decode once, then the bf16 model's own GEMM
            w = w12_decode_dense(self.w12())
            y = F.linear(x2, w, self.bias) if x2.dtype == torch.bfloat16 else _linear_f32(x2, w, self.bias)
        else:
            y = self._kernel(x2, view=False)
        return y.reshape(*x.shape[:-1], self.out_features)

    def view_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The Q pass's projection (§4.1, §4.3): ``x [..., K]`` -> ``x @ approx_view(W)ᵀ + b`` ``[..., N]`` in x's
        dtype, the weight set of the 8-bit view (:func:`~specpilot.w12.format.approx_view`).

        Where :meth:`forward` runs the kernel (CUDA and triton, bf16 / float32 activations, or ``use_kernel`` True):
        :func:`~specpilot.w12.view.w12_view_gemm`'s kernels, which read the view bytes of the records only, in
        launches of :data:`MAX_ROWS` rows (no dense path for wide passes), with the layer's view escape table
        (:meth:`view_escapes`); within :mod:`specpilot.w12.view`'s rounding bound of the reference. Elsewhere (or
        ``use_kernel`` False) the reference :func:`~specpilot.w12.view.w12_view_gemm_reference`: ``approx_view``'s
        weight times x in float32 as the plain layer multiplies (``F.linear``, or on the CPU the prepacked GEMM where
        :func:`~specpilot.kernels.cpu_linear.packs` says; :meth:`_reference`), the weight kept after the first call
        on the CPU (2 bytes a weight apart from :meth:`forward`'s decoded weight, 8 more where packed) and recomputed
        every call on CUDA.
        Raises W12GemmError when the last dim is not K."""
        x2 = self._rows(x)
        y = self._kernel(x2, view=True) if x2.shape[0] and self._kernel_ok(x2) else self._reference(x2, view=True)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, escapes={self.esc_idx.numel()}")



__all__ = ["W12Linear", "DENSE_ROWS"]
