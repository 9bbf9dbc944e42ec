"""A block drafter's step for a batch of requests as one static pass: a CUDA graph per (requests, width) bucket
(§1.1, §2.2, §4.4).

Eagerly, a batched block drafter's step is one context write per request (the features of its newly committed
rows through the context projections) and then the block rows' pass, the head and the top-k: a few dozen small
launches per request plus the pass's own. On a Qwen3-8B-shaped target on an H100 a calibrated block system ran
0.37x AR at 16 requests with its drafter eager (`results/batch_sealed_h100_2026-12-05_c94d5cb/`).
:class:`BatchBlockStep` runs the same computation with shapes fixed by (requests bucket n, context width W):

- each slot's pending observation (:meth:`stage`: the features of the last step's accepted rows, padded to
  ``P = B + 1`` rows, in a per-slot staging buffer) is gathered for the step's n slots and written to the context
  slots ``start + arange(P)`` of each; padding rows land past a context's end (nothing reads them; the next
  observation overwrites them);
- the block rows of every request attend to the first W positions of their own slot's context (gathered,
  ``[n, W, kv_heads, head_dim]`` per layer) under the mask ``arange(W) < length``, then the head over the draft
  vocabulary and the top-16.

A bucket's unused requests run on the drafter's scratch slot (``max_slots``, one slot more than the drafter holds)
at length 0. Inputs are one small device tensor (slot, anchor, start, length per request) filled from a pinned host
twin; outputs are copied to pinned host memory inside the graph and read after one event. On the CPU the same body
runs eagerly (how CI checks it against the eager batched drafter). Markov heads are not covered (their drafters stay
eager in batches).
"""

from __future__ import annotations

import torch

from specpilot.spec.block_step import MIN_WIDTH

TOPK = 16  # the block drafter's candidates a position (spec.block.TOP_K)


def request_buckets(max_slots: int) -> list[int]:
    """The requests buckets of a drafter of ``max_slots`` slots: powers of two below it, then ``max_slots``."""
    out, n = [], 1
    while n < max_slots:
        out.append(n)
        n *= 2
    return out + [max_slots]


class BatchBlockStep:
    """Observation + draft of several slots of a :class:`~specpilot.spec.block.BlockDrafter` as one static pass.

    Args:
        drafter: the block drafter (no Markov head; its ``slot_k`` / ``slot_v`` hold ``max_slots + 1`` slots, the
            last one scratch), read and written in place.
        graphs: capture CUDA graphs (CUDA only; the body runs eagerly on the CPU).
    Raises:
        ValueError: a drafter with a Markov head, or without the scratch slot.
    Attributes:
        pad_rows: P = block size + 1, the most rows one :meth:`stage` takes.
        pending: slot -> ``(start, k)`` of its staged observation not yet written.
    """

    def __init__(self, drafter, graphs: bool = True):
        d = drafter
        if d.cfg.markov_rank > 0:
            raise ValueError("the batched static block step has no Markov head")
        if d.slot_k.shape[0] != d.max_slots + 1:
            raise ValueError("the batched static block step needs the drafter's scratch slot (max_slots + 1 slots)")
        self.d, self.b, self.pad_rows = d, d.cfg.block_size, d.cfg.block_size + 1
        dev = d.slot_k.device
        cuda = dev.type == "cuda"
        self.graphs = graphs and cuda
        self.scratch = d.max_slots
        self.buckets = request_buckets(d.max_slots)
        n = self.buckets[-1]
        self.staged = torch.zeros(d.max_slots + 1, self.pad_rows, len(d.target_layers) * d.cfg.target_hidden,
                                  dtype=d.slot_k.dtype, device=dev)  # [slots + 1, P, F]
        self.io = torch.zeros(n, 4, dtype=torch.long, device=dev)  # per request: slot, anchor, start, length
        self.host_io = torch.zeros(n, 4, dtype=torch.long, pin_memory=cuda)
        self.out_host = {"toks": torch.zeros(n, self.b, TOPK, dtype=torch.long, pin_memory=cuda),
                         "marg": torch.zeros(n, self.b, TOPK, dtype=torch.float32, pin_memory=cuda)}
        self.pending: dict[int, tuple[int, int]] = {}
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._graph_buf = None  # the slot_k buffer the graphs were captured on (the context buffers may grow)
        self._done = torch.cuda.Event() if self.graphs else None

    def stage(self, slot: int, features: torch.Tensor, start: int) -> bool:
        """Stage ``slot``'s features ``[k, F]`` of context positions ``[start, start + k)`` for its next draft (a
        device copy). Returns False, staging nothing, when ``k > pad_rows`` or the slot has an observation staged
        already (the caller then writes eagerly)."""
        k = features.shape[0]
        if k > self.pad_rows or slot in self.pending:
            return False
        self.staged[slot, :k].copy_(features)
        self.pending[slot] = (start, k)
        return True

    def take(self, slot: int) -> tuple[torch.Tensor, int] | None:
        """Take back ``slot``'s staged observation without running it: ``(features [k, F] view, start)`` or None."""
        if slot not in self.pending:
            return None
        start, k = self.pending.pop(slot)
        return self.staged[slot, :k], start

    def width(self, length: int) -> int:
        """The context width bucket of a draft at ``length`` positions: the smallest power of two ≥ ``length`` and
        ≥ 256, at most the buffer's size."""
        return min(self.d.slot_k.shape[2], max(MIN_WIDTH, 1 << max(length - 1, 0).bit_length()))

    def bucket(self, n: int) -> int:
        """The requests bucket of a step of ``n`` requests (``n`` at most ``max_slots``)."""
        return next(b for b in self.buckets if b >= n)

    def _draft(self, n: int, w: int) -> None:
        """Every request's staged observation written, then its block drafted at context width ``w``; the top-16
        ``toks [n, B, 16] long`` and ``marg [n, B, 16] float32`` copied to the host buffers."""
        d, net, b = self.d, self.d.net, self.b
        io = self.io[:n]
        slots, anchors, starts, lengths = io[:, 0], io[:, 1], io[:, 2], io[:, 3]
        dev = io.device
        pos = starts[:, None] + torch.arange(self.pad_rows, device=dev)  # [n, P]
        for i, (ck, cv) in enumerate(net.context_kv(self.staged[slots], pos)):  # [n, P, KVH, D] each
            d.slot_k[slots[:, None], i, pos] = ck
            d.slot_v[slots[:, None], i, pos] = cv
        x = net.block_input(anchors, d.target.model.embed_tokens, b)  # [n, B, hidden]
        bpos = lengths[:, None] + torch.arange(b, device=dev)  # [n, B]
        seen = (torch.arange(w, device=dev) < lengths[:, None])[:, None, :].expand(n, b, w)
        mask = torch.cat((seen, torch.ones(b, b, dtype=torch.bool, device=dev).tril().expand(n, b, b)), dim=2)
        ctx = [(d.slot_k[slots, i, :w], d.slot_v[slots, i, :w]) for i in range(d.cfg.layers)]
        h = net.run(x, bpos, ctx, mask)  # [n, B, hidden]
        toks, marg, _ = d.candidates(d.draft_logits(h.reshape(-1, h.shape[-1])).view(n, b, -1))
        self.out_host["toks"][:n].copy_(toks, non_blocking=True)
        self.out_host["marg"][:n].copy_(marg, non_blocking=True)

    def _capture(self, n: int, w: int) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the capture (cuBLAS handles, SDPA backend choice)
                self._draft(n, w)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self._draft(n, w)
        self._graphs[(n, w)] = g

    @torch.inference_mode()
    def capture_all(self) -> list[tuple[int, int]]:
        """Capture every (requests, width) bucket's graph now (CUDA; nothing on the CPU), so that no capture
        happens inside a timed step. The captures write garbage to the scratch slot only. Returns the buckets."""
        if not self.graphs:
            return []
        self._graph_buf = self.d.slot_k
        self.host_io.zero_()
        self.host_io[:, 0] = self.scratch
        self.io.copy_(self.host_io)
        size = self.d.slot_k.shape[2]
        widths = sorted({min(MIN_WIDTH << i, size) for i in range(max(size // MIN_WIDTH, 1).bit_length() + 1)})
        for n in self.buckets:
            for w in widths:
                if (n, w) not in self._graphs:
                    self._capture(n, w)
        torch.cuda.synchronize(self.io.device)
        return sorted(self._graphs)

    @torch.inference_mode()
    def run(self, reqs: list[tuple[int, int, int]]) -> dict[str, torch.Tensor]:
        """Write the staged observations of the requests' slots, then draft each block: ``reqs`` = ``(slot,
        anchor token, length)`` per request (distinct slots; ``length``: the slot's committed positions but the
        last). Returns host tensors ``toks [n, B, 16] long`` and ``marg [n, B, 16] float32`` (row i: request i),
        valid until the next run. The caller reserves ``start + pad_rows`` context positions of every slot first.

        Raises:
            RuntimeError: a slot's context buffer cannot take its padded rows.
        """
        n, size = self.bucket(len(reqs)), self.d.slot_k.shape[2]
        rows = []
        for slot, anchor, length in reqs:
            start = self.pending.pop(slot)[0] if slot in self.pending else length
            if start + self.pad_rows > size:
                raise RuntimeError(f"block drafter context of {size} positions cannot take {self.pad_rows} rows at "
                                   f"{start}")
            rows.append((slot, anchor, start, length))
        rows += [(self.scratch, 0, 0, 0)] * (n - len(reqs))  # a bucket's unused requests: the scratch slot
        self.host_io[:n].copy_(torch.tensor(rows, dtype=torch.long))
        self.io[:n].copy_(self.host_io[:n], non_blocking=True)
        w = self.width(max(length for _, _, length in reqs))
        if not self.graphs:
            self._draft(n, w)
            return {k: v[: len(reqs)] for k, v in self.out_host.items()}
        if self._graph_buf is not self.d.slot_k:  # the context buffers grew: every graph read the old ones
            self._graphs.clear()
            self._graph_buf = self.d.slot_k
        if (n, w) not in self._graphs:
            self._capture(n, w)
        self._graphs[(n, w)].replay()
        self._done.record()
        self._done.synchronize()
        return {k: v[: len(reqs)] for k, v in self.out_host.items()}
