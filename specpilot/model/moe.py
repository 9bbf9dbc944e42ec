"""A mixture-of-experts MLP (qwen3_next's sparse MoE block) in plain PyTorch: the eager reference of a hybrid
target's MLP (§4.2's targets; the paper itself has no MoE).

Per row ``x`` (a normed hidden state): a router ``gate`` gives ``E`` logits; their softmax (float32) picks the top
``k`` experts, whose probabilities are renormalised to sum 1 when the config says ``norm_topk_prob``; each picked
expert is a SwiGLU MLP of width ``moe_intermediate_size``, and the row's output is the probability-weighted sum of
its experts' outputs plus a shared SwiGLU expert scaled by ``sigmoid(shared_expert_gate(x))``:

    y = Σ_{e ∈ topk} p_e · expert_e(x) + sigmoid(w_sᵀ x) · shared(x)

Rows never mix: each row's output depends on that row alone, so a verification pass over a tree gives every row
what a chain of its root path would (up to GEMM blocking). The reference loops over the experts that some row
picked and runs each on the rows routed to it — how many distinct experts a pass touches grows with its rows,
which is why an MoE target's cost per pass ``c(N)`` (§3.2) is not flat in N (docs/hybrid.md). Parameter names are
Hugging Face's (``mlp.gate``, ``mlp.experts.{e}.*_proj``, ``mlp.shared_expert.*``, ``mlp.shared_expert_gate``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specpilot.model.args import ModelArgs
from specpilot.model.layers import MLP, region


class SparseMoE(nn.Module):
    """Routed experts plus a gated shared expert, as transformers' ``Qwen3NextSparseMoeBlock`` computes them.

    Args:
        args: a :class:`ModelArgs` with ``num_experts > 0`` (``num_experts_per_tok``, ``moe_intermediate_size``,
            ``shared_expert_intermediate_size``, ``norm_topk_prob``).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        h = args.hidden_size
        self.top_k, self.norm_topk_prob = args.num_experts_per_tok, args.norm_topk_prob
        self.gate = nn.Linear(h, args.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(MLP(args, args.moe_intermediate_size) for _ in range(args.num_experts))
        self.shared_expert = MLP(args, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's experts: ``x [R, hidden]`` -> ``(weights [R, k]`` in ``x``'s dtype, ``experts [R, k] long)``,
        the top-k of the router's float32 softmax (largest first), renormalised when ``norm_topk_prob``."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), idx

    def forward(self, x: torch.Tensor, prof=None) -> torch.Tensor:
        """``x [R, hidden]`` -> ``[R, hidden]`` (same dtype): each routed expert runs once, on the rows that picked
        it (experts in increasing index, each one's weighted output added into its rows)."""
        with region(prof, "projections"):
            weights, idx = self.route(x)
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():  # sorted: the experts some row picked
            rows, slot = (idx == e).nonzero(as_tuple=True)
            y = self.experts[e](x[rows], prof) * weights[rows, slot, None]
            out.index_add_(0, rows, y)
        shared = self.shared_expert(x, prof)
        with region(prof, "projections"):
            return out + torch.sigmoid(self.shared_expert_gate(x)) * shared

    def experts_touched(self, x: torch.Tensor) -> int:
        """How many distinct routed experts the rows ``x [R, hidden]`` pick together (the weights a pass reads)."""
        return int(self.route(x)[1].unique().numel())
