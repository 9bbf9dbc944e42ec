"""A block drafter's step for one request as one static pass: CUDA-graph capturable (§1.1, §2.2).

Eagerly, a block drafter's step is a few dozen small launches (the context K/V of the newly committed
positions, then the block rows' layers, the LM head and the top-k), which on a GPU cost more than the
network's own work: on an 8B-shaped target an eager block-drafter step ran at 30 tokens/s against 204 for
graphed AR. :class:`StaticBlockStep` runs the same computation with shapes fixed by the drafter alone, so
one CUDA graph replays every step:

- the pending observation: the target features of the last step's accepted rows, padded to ``P = B + 1``
  rows (the most one step can commit), written to the context slots ``start + arange(P)``. Padding rows land
  past the context's end (``length``), which nothing reads and the next observation overwrites;
- the draft: the block rows attend to the first ``W`` positions of the context buffer with a mask
  ``arange(W) < length`` (padding rows never seen), ``W`` the context's power-of-two width bucket (at least
  256; one graph per bucket, so a short context does not pay attention over the whole buffer), then the
  drafter's head over its draft vocabulary, top-16 (and the Markov head's parent-conditioned scores for every
  block position).

With ``compile=True`` (CUDA) the pass's body goes through ``torch.compile`` before capture: Inductor fuses the
norms, RoPE, masks and copies that are most of the step's launches into a few Triton kernels, and the CUDA graph
then replays those. Compiling costs seconds per context width bucket when the drafter is built.

The inputs are one small device buffer (anchor token, ``start``, ``length``) filled from a pinned host twin,
and the features, copied by :meth:`stage` from the target's pass (on CUDA the exact pass's graph writes them
to a fixed buffer). Outputs are copied to pinned host memory in the same graph; :meth:`run` waits on one
event. On the CPU the same static body runs eagerly (how CI checks that padding and the full-width mask
never change a lattice).
"""

from __future__ import annotations

import torch

MIN_WIDTH = 256  # the narrowest context width bucket (positions)


class StaticBlockStep:
    """Observation + draft of slot 0 of a :class:`~specpilot.spec.block.BlockDrafter` as one static pass.

    Args:
        drafter: the block drafter (its ``slot_k`` / ``slot_v`` buffers are read and written in place).
        graphs: capture a CUDA graph (CUDA only; the body runs eagerly on the CPU).
        compile: compile the body with ``torch.compile`` before capturing it (CUDA graphs only; ignored otherwise).
    Attributes:
        pad_rows: P = block size + 1, the most rows one :meth:`stage` takes.
        pending: ``(start, k)`` of the staged observation not yet written (None: nothing staged).
    """

    def __init__(self, drafter, graphs: bool = True, compile: bool = False):
        d = drafter
        self.d, self.b = d, d.cfg.block_size
        self.pad_rows = self.b + 1
        dev, width = d.slot_k.device, len(d.target_layers) * d.cfg.target_hidden
        self.graphs = graphs and dev.type == "cuda"
        cuda = dev.type == "cuda"
        self.feats = torch.zeros(self.pad_rows, width, dtype=d.slot_k.dtype, device=dev)
        self.io = torch.zeros(3, dtype=torch.long, device=dev)  # anchor token, start, length
        self.host_io = torch.zeros(3, dtype=torch.long, pin_memory=cuda)
        self.markov = d.cfg.markov_rank > 0
        self.out_host = {"toks": torch.zeros(self.b, 16, dtype=torch.long, pin_memory=cuda),
                         "marg": torch.zeros(self.b, 16, dtype=torch.float32, pin_memory=cuda)}
        if self.markov:
            self.out_host["cond"] = torch.zeros(self.b, 16, 16, dtype=torch.float32, pin_memory=cuda)
        self.pending: tuple[int, int] | None = None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}  # per context width bucket
        self._graph_buf = None  # the slot_k buffer the graphs were captured on (the context buffers may grow)
        self._done = torch.cuda.Event() if self.graphs else None
        self._compute = self._draft
        if compile and self.graphs:  # per width a static shape: one specialised compile per bucket
            self._compute = torch.compile(self._draft, dynamic=False)

    def stage(self, features: torch.Tensor, start: int) -> bool:
        """Stage the features ``[k, F]`` of context positions ``[start, start + k)`` for the next :meth:`run`
        (a device copy). Returns False, staging nothing, when ``k > pad_rows`` or another observation is
        staged (the caller then writes it eagerly)."""
        k = features.shape[0]
        if k > self.pad_rows or self.pending is not None:
            return False
        self.feats[:k].copy_(features)
        self.pending = (start, k)
        return True

    def flush(self) -> tuple[torch.Tensor, int] | None:
        """Take back the staged observation without running it: ``(features [k, F] view, start)`` or None."""
        if self.pending is None:
            return None
        (start, k), self.pending = self.pending, None
        return self.feats[:k], start

    def width(self, length: int) -> int:
        """The context width bucket of a draft at ``length`` context positions: the smallest power of two ≥
        ``length`` and ≥ 256, at most the buffer's size."""
        return min(self.d.slot_k.shape[2], max(MIN_WIDTH, 1 << max(length - 1, 0).bit_length()))

    def _body(self, s: int) -> dict[str, torch.Tensor]:
        out = self._compute(s)
        for name, t in out.items():
            self.out_host[name].copy_(t, non_blocking=True)
        return out

    def _draft(self, s: int) -> dict[str, torch.Tensor]:
        """The observation's context K/V written, then the block drafted at context width ``s``: device tensors
        ``toks [B, 16] long``, ``marg [B, 16] float32`` (and ``cond [B, 16, 16] float32`` with a Markov head)."""
        d, net, b = self.d, self.d.net, self.b
        start, length = self.io[1], self.io[2]
        dev = self.io.device
        pos = start + torch.arange(self.pad_rows, device=dev)
        for i, (ck, cv) in enumerate(net.context_kv(self.feats, pos)):
            d.slot_k[0, i].index_copy_(0, pos, ck)
            d.slot_v[0, i].index_copy_(0, pos, cv)
        x = net.block_input(self.io[0:1], d.target.model.embed_tokens, b)  # [1, B, hidden]
        bpos = (length + torch.arange(b, device=dev))[None]  # [1, B]
        mask = torch.cat(((torch.arange(s, device=dev) < length).expand(b, s),
                          torch.ones(b, b, dtype=torch.bool, device=dev).tril()), dim=1)[None]  # [1, B, S + B]
        ctx = [(d.slot_k[0:1, i, :s], d.slot_v[0:1, i, :s]) for i in range(d.cfg.layers)]
        logits = d.draft_logits(net.run(x, bpos, ctx, mask)[0])  # [B, Vd] float32
        toks, marg, idx = d.candidates(logits)
        out = {"toks": toks, "marg": marg}
        if self.markov:  # every position's parent-conditioned scores, row 0's parent the anchor
            parents = torch.cat((self.io[0:1].expand(1, 16), toks[:-1]), 0)  # [B, 16]
            out["cond"] = d.markov_cond(logits, parents, idx)  # [B, parent, child]
        return out

    def _capture(self, w: int) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the capture (cuBLAS handles, SDPA backend choice)
                self._body(w)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self._body(w)
        self._graphs[w] = g

    @torch.inference_mode()
    def capture_all(self) -> list[int]:
        """Capture every context width bucket's graph now (CUDA; nothing on the CPU), so that no capture happens
        inside a timed request. Writes garbage to the context slots ``[0, pad_rows)`` of slot 0 (the next request
        overwrites them). Returns the widths captured."""
        if not self.graphs:
            return []
        self._graph_buf = self.d.slot_k
        size, w = self.d.slot_k.shape[2], MIN_WIDTH
        while True:
            if min(w, size) not in self._graphs:
                self._capture(min(w, size))
            if w >= size:
                break
            w *= 2
        torch.cuda.synchronize(self.io.device)
        return sorted(self._graphs)

    @torch.inference_mode()
    def run(self, anchor: int, length: int) -> dict[str, torch.Tensor]:
        """Write the staged observation (if any), then draft the block after ``anchor`` at context ``length``
        (the slot's committed positions but the last); returns host tensors ``toks [B, 16] long``, ``marg
        [B, 16] float32`` and with a Markov head ``cond [B, parent 16, child 16] float32``, valid until the
        next run. The caller reserves ``start + pad_rows`` context positions first (padding rows write there)."""
        start = self.pending[0] if self.pending is not None else length
        self.pending = None
        if start + self.pad_rows > self.d.slot_k.shape[2]:
            raise RuntimeError(f"block drafter context of {self.d.slot_k.shape[2]} positions cannot take "
                               f"{self.pad_rows} rows at {start}")
        self.host_io[0], self.host_io[1], self.host_io[2] = anchor, start, length
        self.io.copy_(self.host_io, non_blocking=True)
        w = self.width(length)
        if not self.graphs:
            self._body(w)
            return self.out_host
        if self._graph_buf is not self.d.slot_k:  # the context buffers grew: every graph read the old ones
            self._graphs.clear()
            self._graph_buf = self.d.slot_k
        if w not in self._graphs:
            self._capture(w)
        self._graphs[w].replay()
        self._done.record()
        self._done.synchronize()
        return self.out_host
