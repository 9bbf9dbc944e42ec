"""GPU kernels (Triton) next to their plain-PyTorch references; see each module's docstring."""

from specpilot.kernels.tree_attention import attention, pack_tree_mask, tree_attention, tree_attention_reference

__all__ = ["attention", "pack_tree_mask", "tree_attention", "tree_attention_reference"]
