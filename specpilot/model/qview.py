"""The Q pass's view of a target (§4.3, §5.4): the same model with approximate projection weights.

TLV's Q pass inspects a draft tree with a cheap pass whose argmax pre-selects the chain the one exact pass then
confirms; nothing it computes is ever committed, so its weights only need to agree with the exact ones most of
the time. Three weight sets, each a :class:`QLinear` in place of every projection the ``w12`` mechanism converts
(attention and MLP projections of every decoder layer, and an untied LM head):

* ``view8``: the 8-bit view nested in each W12 record (sign | exponent offset | top 3 mantissa bits, the 4
  dropped bits at their midpoint; :func:`specpilot.w12.format.approx_view`). On a ``w12`` target it is read from
  the target's own records (no extra bytes: a GEMM reads the first 8 KB of each 12 KB record); on any other
  target the bf16 rounding of each weight is encoded once (12 bits a weight held).
* ``int8`` / ``int6``: a copy with one float32 scale per output row, symmetric, ``round(w / s)`` clamped to
  ±127 / ±31 (int6 packed four codes to three bytes): for targets without W12 (the paper adds such copies on
  the RTX PRO 6000 and DSpark deployments, §5.4).

Everything else (embeddings, norms, a tied head, the rotary tables) is the target's own tensors, shared. The Q
view reads the target's committed K/V and, on the eager path, writes nothing (``PassKind.INSPECT``); on the
static path it writes its rows to the scratch slots past the committed length, as any exact pass does before its
acceptance, and commits nothing (:mod:`specpilot.engine.tlv`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specpilot.config import QWeights
from specpilot.errors import SpecPilotError
from specpilot.kernels.cpu_linear import PackedLinear, packs
from specpilot.w12.convert import map_projections
from specpilot.w12.format import approx_view, encode
from specpilot.w12.linear import W12Linear

_LEVELS = {"int8": 127, "int6": 31}


def quantize_rows(w: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization: ``w [N, K]`` (any float dtype) -> ``(codes int8 [N, K] in [-levels, levels],
    scale float32 [N])`` with ``w ≈ codes * scale[:, None]`` (a zero row gets scale 1)."""
    w = w.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / levels, torch.ones_like(amax))
    return torch.round(w / scale[:, None]).clamp_(-levels, levels).to(torch.int8), scale


def pack_int6(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in ``[-31, 31]``, ``[N, K]`` -> uint8 ``[N, 3 * ceil(K / 4)]``: four 6-bit fields
    (code + 32) to three bytes, little-endian."""
    n, k = codes.shape
    u = F.pad(codes.to(torch.int32) + 32, (0, -k % 4), value=32).view(n, -1, 4)
    word = u[..., 0] | (u[..., 1] << 6) | (u[..., 2] << 12) | (u[..., 3] << 18)
    return torch.stack([word & 255, (word >> 8) & 255, (word >> 16) & 255], dim=-1).view(n, -1).to(torch.uint8)


def unpack_int6(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of :func:`pack_int6`: uint8 ``[N, 3 * ceil(K / 4)]`` -> int8 codes ``[N, K]``."""
    b = packed.to(torch.int32).view(packed.shape[0], -1, 3)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    u = torch.stack([(word >> s) & 63 for s in (0, 6, 12, 18)], dim=-1).view(packed.shape[0], -1)
    return (u[:, :k] - 32).to(torch.int8)


class QLinear(nn.Module):
    """One projection of the Q view: ``x [..., K] -> [..., N]`` in x's dtype with approximate weights (module doc).

    Args:
        source: the target's projection, an ``nn.Linear`` or a :class:`W12Linear` (its bias is shared).
        weights: ``view8``, ``int8`` or ``int6``.
    Forward: ``view8`` through the W12 layer's 8-bit-view GEMM (:meth:`W12Linear.view_forward`: on CUDA a kernel that
    loads only the view bytes of each record; on the CPU its reference); ``int8`` / ``int6``: the approximate weight
    decoded once and kept (no kernel exists for them yet; :meth:`extra_bytes` counts the copy, and on the CPU its
    prepacked twin), then multiplied as the plain layer would (``F.linear``; on the CPU in float32 the prepacked GEMM
    where :func:`~specpilot.kernels.cpu_linear.packs` says) in float32 for float32 activations, in x's dtype otherwise.
    Raises:
        SpecPilotError: an unknown ``weights`` or a source that is neither layer type.
    """

    def __init__(self, source: nn.Module, weights: QWeights):
        super().__init__()
        if weights not in ("view8", "int8", "int6"):
            raise SpecPilotError(f"unknown Q-pass weights {weights!r}: view8, int8 or int6")
        if not isinstance(source, (nn.Linear, W12Linear)):
            raise SpecPilotError(f"a Q-view projection replaces an nn.Linear or a W12Linear, not {type(source).__name__}")
        self.weights, self.in_features, self.out_features = weights, source.in_features, source.out_features
        self.bias = source.bias
        w = source.decoded_weight() if isinstance(source, W12Linear) else source.weight.detach()
        self.w12: W12Linear | None = None
        self.shared = weights == "view8" and isinstance(source, W12Linear)
        if weights == "view8":
            self.w12 = source if self.shared else W12Linear(encode(w.to(torch.bfloat16), device=w.device), source.bias)
        else:
            codes, scale = quantize_rows(w, _LEVELS[weights])
            self.register_buffer("codes", pack_int6(codes) if weights == "int6" else codes)
            self.register_buffer("scale", scale)
        self._dense: torch.Tensor | None = None
        self._packed: dict = {}  # "gemm": the CPU prepacked GEMM over _dense where packs() says (no submodule)

    def approx_weight(self) -> torch.Tensor:
        """The weight the Q pass computes with, float32 ``[N, K]`` (exactly representable in bf16 for ``view8``)."""
        if self.w12 is not None:
            return approx_view(self.w12.w12()).float()
        codes = unpack_int6(self.codes, self.in_features) if self.weights == "int6" else self.codes
        return codes.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w12 is not None:
            return self.w12.view_forward(x)
        if self._dense is None or self._dense.device != x.device:
            self._dense = self.approx_weight().to(x.device)
            b = None if self.bias is None else self.bias.detach().float()
            self._packed = {"gemm": PackedLinear.of(self._dense, b)} if packs(self._dense) else {}
        if x.dtype == torch.float32:  # on the CPU as the plain layer multiplies (prepacked: W12Linear._reference)
            if self._packed:
                return self._packed["gemm"](x)
            return F.linear(x, self._dense, None if self.bias is None else self.bias.float())
        w = self._dense.to(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def extra_bytes(self) -> int:
        """Bytes this layer holds beyond the target's own weights: the encoded copy (records, bases, escapes) of a
        non-W12 source, the int8 / int6 codes and scales, and a decoded dense weight once one is kept."""
        n = 0
        if self.w12 is not None and not self.shared:
            n += sum(b.numel() * b.element_size() for b in self.w12.buffers())
        if self.w12 is None:
            n += self.codes.numel() + self.scale.numel() * 4
        if self._dense is not None:
            n += self._dense.numel() * self._dense.element_size() * (2 if self._packed else 1)
        return n

    def extra_repr(self) -> str:
        return f"{self.weights}, in_features={self.in_features}, out_features={self.out_features}, shared={self.shared}"


def q_view(target: nn.Module, weights: QWeights = "view8") -> nn.Module:
    """The target seen through ``weights`` (module docstring): a model object of the target's class whose decoder
    projections and untied LM head are :class:`QLinear` layers; everything else is the target's, shared. Its
    certified INT8 head, if any, is not carried over (the Q view's own head is already approximate).

    Args:
        target: a :class:`~specpilot.model.transformer.Transformer` (dense; W12 or not; fused or not).
        weights: ``view8`` | ``int8`` | ``int6``.
    Returns: the Q view (an eval-mode module sharing the target's device and dtype).
    Raises:
        SpecPilotError: an unknown ``weights``; a hybrid (Gated DeltaNet) target, whose Q pass would need its
            recurrent state left alone (not built yet).
    """
    if any("linear_attn" in layer._modules for layer in target.model.layers):
        raise SpecPilotError("TLV's Q pass is not built for hybrid (Gated DeltaNet) targets yet")
    head = target.lm_head
    untied = isinstance(head, W12Linear) or (isinstance(head, nn.Linear)
                                             and head.weight is not target.model.embed_tokens.weight)
    q = map_projections(target, lambda layer: QLinear(layer, weights), inplace=False, head=untied)
    q.int8_head = None
    return q


def q_extra_bytes(q: nn.Module) -> int:
    """Bytes the Q view ``q`` holds beyond its target's weights (:meth:`QLinear.extra_bytes` summed)."""
    return sum(m.extra_bytes() for m in q.modules() if isinstance(m, QLinear))


__all__ = ["QWeights", "QLinear", "q_view", "q_extra_bytes", "quantize_rows", "pack_int6", "unpack_int6"]
