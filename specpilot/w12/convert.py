"""The ``w12`` engine mechanism (§4.1): the target's projection layers read W12 lossless 12-bit weights.

Every ``nn.Linear`` of every decoder layer's attention (``qkv_proj`` / ``q,k,v_proj``, ``o_proj``) and MLP
(``gate_up_proj`` / ``gate,up_proj``, ``down_proj``) becomes a :class:`~specpilot.w12.linear.W12Linear`
holding the same bf16 weight, encoded losslessly, and so does an untied LM head (``head=True``, the default;
as ``specpilot w12 pack`` converts it, and as the paper does on the RTX PRO 6000, §4.1: the head is the
largest single projection, 1.24 GB of bf16 in Qwen3-8B). A head tied to the embeddings stays bf16 (the
embedding lookup reads that tensor), as do the embeddings and norms. The decoded weights are bit for bit the originals, so the model computes the same function: on the CPU the
W12 layers run the reference (decode, then the GEMM the plain layer runs there: in float32 the prepacked oneDNN one of
:mod:`specpilot.kernels.cpu_linear`), so in float32 a ``w12`` model gives the same logits as the original bit for
bit; on CUDA the W12 GEMM differs from cuBLAS
only by float32 accumulation order. AR and speculative decoding both run through the same W12 layers, so
speculative output equals AR output with ``w12`` on as with it off.
"""

from __future__ import annotations

import copy

from torch import nn

from specpilot.errors import SpecPilotError
from specpilot.w12.linear import W12Linear


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with its own child table (parameters, buffers and children are shared)."""
    c = copy.copy(module)
    c._modules = dict(module._modules)
    return c


def to_w12(model: nn.Module, inplace: bool = False, head: bool = True) -> nn.Module:
    """``model`` with its decoder layers' projections in W12 (module docstring), encoded on their device.

    Args:
        model: a :class:`~specpilot.model.transformer.Transformer` (fused or not, hybrid included; its weights must
            be bfloat16 values). W12 sits below the model (the model's fused path calls its kernels), so the class is
            imported when called, not at import time.
        inplace: replace the layers in ``model`` itself; otherwise return a new model object that shares
            every other parameter (embeddings, norms, a tied or kept LM head) with ``model``, which stays
            unchanged. Shared means the same tensors: an in-place change of either model's shared parameters,
            ``.to(dtype or device)`` included, changes both (move ``model`` before converting it, or convert
            ``inplace``).
        head: also encode the LM head when it is an ``nn.Linear`` not tied to the embeddings (one more
            W12 weight ``[vocab, hidden]``; :func:`w12_head` says whether it happened).
    Returns: the W12 model (``model`` when ``inplace``).
    Raises:
        SpecPilotError: ``model`` is not a Transformer (e.g. one ``nn.Linear``: use
            :meth:`W12Linear.from_linear <specpilot.w12.linear.W12Linear.from_linear>`).
        W12FormatError: a projection weight is not made of bfloat16 values (W12 is lossless only for bf16;
            a bf16 checkpoint loaded in float32 qualifies, a float32 checkpoint in general does not).
    """
    from specpilot.model.transformer import Transformer

    if not isinstance(model, Transformer):
        raise SpecPilotError(f"to_w12 takes a model (a specpilot Transformer, e.g. from load_model), not "
                             f"{type(model).__name__}" + (": encode one layer with W12Linear.from_linear"
                                                          if isinstance(model, nn.Linear) else ""))
    lm = model.lm_head
    untied = head and isinstance(lm, nn.Linear) and lm.weight is not model.model.embed_tokens.weight
    return map_projections(model, lambda child: W12Linear.from_linear(child) if isinstance(child, nn.Linear) else child,
                           inplace, head=untied)


def map_projections(model: nn.Module, make, inplace: bool = False, head: bool = False) -> nn.Module:
    """``model`` with every child of its decoder layers' ``self_attn`` and ``mlp`` that is an ``nn.Linear`` or a
    :class:`W12Linear` replaced by ``make(child)`` (and the LM head too when ``head``): how :func:`to_w12` and the Q
    pass's view of a target (:func:`specpilot.model.qview.q_view`) swap projections. ``inplace`` as :func:`to_w12`:
    otherwise a new model object sharing everything it does not replace with ``model``. Returns that model."""
    out = model if inplace else _shallow(model)
    if not inplace:
        out.model = _shallow(model.model)
        out.model.layers = _shallow(model.model.layers)
    for i, layer in enumerate(model.model.layers):
        new = layer if inplace else _shallow(layer)
        for part in [p for p in ("self_attn", "mlp") if p in layer._modules]:  # a GDN layer has no self_attn
            sub = getattr(layer, part) if inplace else _shallow(getattr(layer, part))
            for name, child in list(sub.named_children()):
                if isinstance(child, (nn.Linear, W12Linear)):
                    setattr(sub, name, make(child))
            setattr(new, part, sub)
        out.model.layers[i] = new
    if head:
        out.lm_head = make(model.lm_head)
    return out


def w12_head(model: nn.Module) -> bool:
    """Whether ``model``'s LM head is a W12 layer (:func:`to_w12` with ``head=True`` on an untied head)."""
    return isinstance(model.lm_head, W12Linear)


def is_w12(model: nn.Module) -> bool:
    """Whether ``model``'s decoder projections are W12 layers (those of :func:`to_w12`)."""
    return any(isinstance(m, W12Linear) for m in model.model.layers.modules())


__all__ = ["to_w12", "is_w12", "w12_head", "map_projections"]
