"""TLV, two-level verification (§4.3): a cycle of two drafts and two passes whose one exact pass verifies more.

One cycle, for one request:

1. draft ① from the committed tokens; the configured builder makes a tree of N nodes;
2. the **Q pass** (:class:`QPass`) runs [root] + that tree through the Q view of the target
   (:func:`specpilot.model.qview.q_view`: the 8-bit view of the W12 records, or an INT8 / INT6 copy). It reads the
   committed K/V and changes no engine state: the eager pass writes nothing, the static pass writes its rows to
   the scratch slots past the committed length, which the exact pass overwrites before anything is committed;
3. the **commit chain** C = the path the Q pass's argmax accepts through the tree, plus its bonus: nothing is
   accepted yet;
4. draft ② from the committed tokens followed by C; a drafter that reads target features is handed the Q pass's
   features of C's rows first (they are overwritten by the exact pass's once that accepts them); its tree of
   N − |C| nodes is hung under C's last token (:func:`graft`);
5. the engine's one exact pass verifies C + that subtree as any tree and accepts the longest path it confirms plus
   its bonus. Only this pass commits, so the output is the exact pass's greedy output (lossless) whatever the Q
   pass said; τ counts tokens per exact pass.

A cycle costs two drafts and a Q pass on top of the exact pass; the cost model prices the whole cycle, which
breaks the ceiling's one-draft-per-pass assumption (§3.2, §4.3). In batching the Q pass's share of the step is
larger and TLV lost 13% in the paper (§6), so the batched engine refuses it.
"""

from __future__ import annotations

from typing import Callable

import torch

from specpilot.engine.runner import BUCKETS, BucketRunner, bucket_for
from specpilot.model.cache import KVCache, PassKind
from specpilot.model.layers import region
from specpilot.spec.trees import Tree


def graft(chain: list[int], sub: Tree) -> Tree:
    """The tree an exact pass of a TLV cycle verifies: ``chain`` (C) as a path from the root, then every node of
    ``sub`` (drafted after C) under C's last node, its depths shifted by ``len(chain)``. A chain of ``c`` tokens
    and a subtree of ``s`` nodes give ``c + s`` nodes in topological order."""
    t = Tree()
    last = -1
    for tok in chain:
        last = t.add(tok, last, 0.0)
    off = len(chain)
    for tok, parent, score in zip(sub.tokens, sub.parents, sub.scores):
        t.add(tok, last if parent < 0 else parent + off, score)
    return t


def two_level_tree(committed: list[int], remaining: int, nodes: int,
                   draft: Callable[[list[int], int, int], Tree],
                   q_pass: Callable[[Tree], list[int]],
                   observe: Callable[[list[int]], None] | None = None) -> tuple[Tree, int]:
    """The tree of one TLV cycle (module docstring, steps 1–4).

    Args:
        committed: the committed token ids (prompt + output so far).
        remaining: tokens the request may still emit (≥ 1); the tree's depth stays below it.
        nodes: N, the exact pass's node budget (and draft ①'s).
        draft: ``draft(context, remaining, nodes) -> Tree``: the engine's drafting with the configured builder.
        q_pass: ``q_pass(tree) -> argmax [R]`` of the Q pass over [root] + ``tree``.
        observe: ``observe(path_rows)``: hand a feature-reading drafter the Q pass's features of those rows (the
            root and C's accepted nodes, for the committed slots C extends); None for drafters that read none.
    Returns:
        ``(tree, c)``: the tree the exact pass verifies and |C| (0 when draft ① proposed nothing: then the tree is
        empty and no Q pass ran).
    """
    first = draft(committed, remaining, nodes)
    if not len(first):
        return first, 0
    path, chain = first.accept(q_pass(first))
    chain = chain[: min(nodes, remaining - 1)]
    if observe is not None:
        observe(path[: len(chain)])
    sub = Tree()
    if nodes > len(chain) and remaining - len(chain) > 1:
        sub = draft(committed + chain, remaining - len(chain), nodes - len(chain))
    return graft(chain, sub), len(chain)


class QPass:
    """The Q pass of TLV (§4.3): the argmax of [root] + tree rows under the Q view, inspecting the request's cache.

    Args:
        q_target: the Q view (:func:`specpilot.model.qview.q_view`) of the engine's target.
        cache: the engine's target cache (the Q view reads its committed K/V).
        feature_layers: target layers whose Q-pass outputs a drafter reads (``()``: none).
        buckets: run padded to row buckets through the static path (CUDA graphs on CUDA), as the engine's exact pass
            does; rows above the largest captured bucket, or ``buckets=False``, run the eager ``INSPECT`` pass.
        max_rows: the most rows a Q pass runs (N + 1): only buckets up to it are captured.

    Attributes:
        features: the last pass's features ``[R, len(feature_layers) * hidden]`` or None.
    """

    def __init__(self, q_target, cache: KVCache, feature_layers: tuple[int, ...], buckets: bool, max_rows: int):
        self.q, self.cache, self.feature_layers = q_target, cache, tuple(feature_layers)
        self.runner = None
        if buckets:
            top = bucket_for(max_rows) or BUCKETS[-1]
            self.runner = BucketRunner(q_target, cache, [b for b in BUCKETS if b <= top], graphs=True,
                                       output="argmax", feature_layers=self.feature_layers)
            self.runner.capture_all()
        self.features: torch.Tensor | None = None

    def run(self, tok_list: list[int], pos_list: list[int], start: int, tree: Tree, prof=None,
            committed: list[int] | None = None) -> list[int]:
        """The Q pass over rows ``tok_list`` at positions ``pos_list`` after ``start`` committed slots, ``tree``
        giving their ancestor mask; returns the argmax per row (one host read). Commits nothing. ``committed``: the
        committed tokens, unused here; a simulated Q pass (:class:`~specpilot.spec.calibrated_q.SimulatedQPass`,
        same interface) reads them to find the known greedy path."""
        with region(prof, "q_pass"):
            out = None
            if self.runner is not None:
                out = self.runner.run(tok_list, pos_list, start, tree.ancestor_mask() if len(tree) else None)
                if out is not None and self.feature_layers:
                    self.features = self.runner.features[: len(tok_list)]
            if out is None:
                dev, r = self.q.device, len(tok_list)
                mask = torch.ones(r, start + r, dtype=torch.bool, device=dev)
                mask[:, start:] = tree.ancestor_mask(dev)
                feats: list[torch.Tensor] = []
                hidden = self.q.forward(torch.tensor(tok_list, device=dev), torch.tensor(pos_list, device=dev),
                                        self.cache, start, mask, kind=PassKind.INSPECT, features=feats,
                                        feature_layers=self.feature_layers)
                self.features = torch.cat(feats, dim=-1) if feats else None
                out = self.q.greedy(hidden)
            return out.tolist()


__all__ = ["QPass", "two_level_tree", "graft"]
