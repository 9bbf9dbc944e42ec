"""GPU kernels (Triton) next to their plain-PyTorch references; see each module's docstring."""

from specpilot.kernels.interp import apply_if_interpreting

apply_if_interpreting()  # TRITON_INTERPRET=1 with numpy >= 2.4 (see .interp); nothing on a GPU run

from specpilot.kernels.tree_attention import attention, pack_tree_mask, tree_attention, tree_attention_reference

__all__ = ["attention", "pack_tree_mask", "tree_attention", "tree_attention_reference"]
