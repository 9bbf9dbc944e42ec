"""Prepacked float32 projections on the CPU: oneDNN's matmul over a weight reordered once at load.

Why. ``F.linear`` on the CPU is MKL's sgemm, which repacks the weight into its blocked layout on every call. At the
row counts of decoding (1 row for AR, a few to ~100 for verification and batches) that repacking costs about as much
as the multiply itself: on SmolLM2-135M's shapes, one thread of an AVX-512 EPYC, a layer's four projections at 8
rows take 0.95 ms through ``F.linear`` and 0.65 ms from a prepacked oneDNN weight, the 49152 x 576 LM head 33.2 ms
vs 11.2 (``probes/cpu_linear_ab.py``, ``results/cpu_linear_ab_cpu_2026-12-04_3c6b1d3/run.json``; at one row MKL's
GEMV wins on the layers' projections, 0.58-0.94x, and loses on the head). The prepacked weight is the same values in
oneDNN's blocked layout, so outputs agree with ``F.linear`` to float32 rounding (the sums run in another order).

A side effect worth having: oneDNN's sums run in an order that does not depend on the number of rows for most
shapes (MKL's sgemm changes it between 1, 2–3 and 4+ rows), so a verification row rounds like an AR row more often.

- :class:`PackedLinear`: an ``nn.Linear`` whose forward reads the packed copy; the plain ``F.linear`` of its own
  ``weight`` is the reference (:meth:`PackedLinear.reference`). The packed copy follows the weight: it is rebuilt
  after an in-place write (tensor version), a ``.to()`` / dtype change, and never used under autograd or off the CPU.
- :func:`pack_linears`: swap every float32 CPU ``nn.Linear`` of a model (but the smallest, :data:`MIN_PACK_WEIGHTS`)
  for a :class:`PackedLinear` sharing its parameters (tied weights stay tied). Memory: the packed copy doubles the
  projections' weight bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


#: Layers with fewer weights stay ``nn.Linear``: a oneDNN call costs ~12 µs more than MKL's before any work (a 16 x 16
#: weight: 14 vs 2 µs), so on the bundled 6M target's 256-wide layers packing loses (o_proj 256 x 256 at 8 rows 0.031
#: vs 0.020 ms) while its 1536 x 256 gate_up and SmolLM2's smallest projection (576 x 576) win from 2 rows up.
MIN_PACK_WEIGHTS = 1 << 18


def packs(weight: torch.Tensor) -> bool:
    """Whether :func:`pack_linears` packs a layer of ``weight [N, K]`` (float32, on the CPU, at least
    :data:`MIN_PACK_WEIGHTS` weights, and this build can pack): the rule another format's CPU reference follows to
    multiply as the plain layer does."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.numel() >= MIN_PACK_WEIGHTS
            and packing_available())


def pack_by_default(device, dtype: str) -> bool:
    """Whether a model loaded on ``device`` in ``dtype`` (a name: ``float32`` ...) is packed unless told otherwise:
    on the CPU in float32."""
    return torch.device(device).type == "cpu" and dtype == "float32"


def packing_available() -> bool:
    """Whether this PyTorch build can prepack weights for oneDNN (``torch.ops.mkldnn``, x86 and aarch64 builds)."""
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Linear):
    """``y = x @ weight.T + bias`` from a oneDNN-prepacked copy of ``weight`` (float32, CPU).

    ``x [..., in_features]`` float32 on the CPU -> ``[..., out_features]`` float32. Off the CPU, in another dtype,
    or when autograd runs through it (a gradient to ``x`` or the weight), the forward is ``F.linear``
    (:meth:`reference`). Build it with :meth:`from_linear` (or :func:`pack_linears`); it shares the Linear's
    parameters.
    """

    def _drop_pack(self) -> None:
        self._pack, self._pack_key = None, None

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> "PackedLinear":
        """A PackedLinear over ``lin``'s own ``weight`` and ``bias`` Parameters (no copy of them; the pack is built
        by :meth:`packed`, on the first forward at the latest). Raises TypeError if ``lin`` is not an ``nn.Linear``."""
        if not isinstance(lin, nn.Linear):
            raise TypeError(f"PackedLinear.from_linear takes an nn.Linear, got {type(lin).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = lin.in_features, lin.out_features
        new.weight, new.bias = lin.weight, lin.bias
        new._drop_pack()
        return new

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "PackedLinear":
        """A PackedLinear over ``weight [N, K]`` (and ``bias [N]``), frozen (``requires_grad`` False): how a layer
        in another format (a W12 layer's decoded weight) multiplies exactly as the plain model's layer does."""
        lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        lin.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias, requires_grad=False)
        return cls.from_linear(lin)

    def _key(self) -> tuple:
        w = self.weight  # an inference tensor has no version counter (and no in-place writes outside inference mode)
        return (w.data_ptr(), -1 if w.is_inference() else w._version, w.dtype, tuple(w.shape))

    def packed(self) -> torch.Tensor:
        """The oneDNN-packed weight (an opaque ``torch._mkldnn`` tensor), rebuilt when the weight changed."""
        key = self._key()
        if self._pack_key != key:
            self._pack = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
            self._pack_key = key
        return self._pack

    def uses_pack(self, x: torch.Tensor) -> bool:
        """Whether :meth:`forward` over ``x`` reads the packed copy: CPU, float32, and no autograd through it (oneDNN's
        packed call has no backward, so a gradient to ``x`` or to the weight takes :meth:`reference`)."""
        w = self.weight
        return (x.device.type == "cpu" and w.device.type == "cpu" and x.dtype == w.dtype == torch.float32
                and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, weight, bias)``: the plain PyTorch oracle of :meth:`forward`."""
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.uses_pack(x):
            return self.reference(x)
        b = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed(), b, "none", [], "")

    def __getstate__(self):
        state = dict(self.__dict__, _pack=None, _pack_key=None)  # deepcopy / pickle: rebuilt on the next forward
        return state

    def _apply(self, fn, recurse=True):
        self._drop_pack()  # .to(), .cuda(), .half(): the pack is rebuilt from the new weight when it applies
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", packed=oneDNN"


def pack_linears(model: nn.Module, min_weights: int = MIN_PACK_WEIGHTS) -> int:
    """Replace every plain float32 CPU ``nn.Linear`` in ``model`` with at least ``min_weights`` weights (in place) by a
    :class:`PackedLinear` over the same parameters. Returns how many were replaced (0 when :func:`packing_available`
    is False). Subclasses of ``nn.Linear`` (already packed, or another format) are left alone."""
    if not packing_available():
        return 0
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            w = child.weight if type(child) is nn.Linear else None
            if w is not None and w.device.type == "cpu" and w.dtype == torch.float32 and w.numel() >= min_weights:
                packed = PackedLinear.from_linear(child)
                packed.packed()  # now: its memory shows at load, and no first request pays for it
                setattr(parent, name, packed)
                n += 1
    return n
