"""Draft-model drafter: a smaller causal LM run sequentially (§1.1, EAGLE-style sequential drafting).

Each step feeds the committed tokens the drafter has not seen, then drafts ``depth`` tokens greedily (top-1),
recording the top-K candidates and log-probs at every position: a :class:`PositionalLattice`. The drafted
tokens' K/V are dropped afterwards, so the drafter's cache always holds exactly the committed prefix (R11). Each
drafted position is committed to run the next and the cache is rolled back to a checkpoint after the last one: a
hybrid (Gated DeltaNet) draft model's recurrent state cannot be moved back otherwise (its cache's checkpoint copies
that state). Drafting again at a shorter context rewinds the cache; a hybrid draft model's then restarts from the
first token (its state holds only the latest length).

Static mode (the default on CUDA): the catch-up pass runs through row buckets
(:class:`~specpilot.engine.runner.BucketRunner`, one CUDA graph per bucket) and the ``depth`` sequential
one-row passes run as one CUDA graph per depth, the drafted token fed back on the device (top-k,
log-softmax and the next pass inside the graph): one replay and one host read per draft. On the CPU the
same static code runs eagerly (tests compare it with the dynamic path).
"""

from __future__ import annotations

import torch

from specpilot.errors import SpecPilotError
from specpilot.model.hybrid_cache import HybridCache
from specpilot.model.transformer import Transformer
from specpilot.spec.drafter import OneSlotDrafter
from specpilot.spec.lattice import PositionalLattice


class DraftModelDrafter(OneSlotDrafter):
    """Sequential draft model (:class:`~specpilot.spec.drafter.Drafter`, one request slot).

    Args:
        model: the draft :class:`Transformer` (same vocabulary as the target: checked when the engine is built).
        top_k: candidates kept per position.
        max_len: cache slots wanted (committed prefix + drafted tokens); the drafter never goes past its own
            ``max_position_embeddings`` (:attr:`max_context`): near it, it drafts fewer positions, then none.
        static: the bucketed static path (None: on CUDA, unless the model is a hybrid).
    Raises:
        SpecPilotError: ``static=True`` with a hybrid draft model (its drafting loop would need a commit a position).
    """

    kind = "draft_model"

    def __init__(self, model: Transformer, top_k: int = 4, max_len: int = 4096, static: bool | None = None):
        from specpilot.engine.runner import BUCKETS, BucketRunner

        self.model, self.top_k = model, top_k
        self.vocab_size = model.args.vocab_size
        self.max_context = model.args.max_position_embeddings
        self.capacity = min(max_len, self.max_context)  # positions this drafter reads or drafts at
        self.cache = model.new_cache(self.capacity + BUCKETS[-1])
        recurrent = isinstance(self.cache, HybridCache)  # its drafted positions must be committed one by one
        if static and recurrent:
            raise SpecPilotError("a hybrid (Gated DeltaNet) draft model has no static drafting loop: use static=False")
        self.static = model.device.type == "cuda" and not recurrent if static is None else static
        self.n_seen = 0  # committed tokens whose K/V are in the cache
        self.runner = BucketRunner(model, self.cache, BUCKETS, output="logits") if self.static else None
        if self.runner is not None:
            self.runner.capture_all()  # every bucket (a request's first catch-up is its prompt), never in a timed request
        self._loops: dict[int, dict] = {}

    def clear(self) -> None:
        """Start a new request: forget the previous request's cache."""
        self.n_seen = 0
        self.cache.commit(0)

    @torch.inference_mode()
    def draft(self, committed: list[int], depth: int) -> PositionalLattice | None:
        """``min(depth, capacity − n)`` positions drafted after ``committed`` (n ids): a ``[depth, top_k]`` lattice,
        or None when no position fits the drafter's context."""
        m, dev = self.model, self.model.device
        n = len(committed)
        depth = min(depth, self.capacity - n)  # drafted tokens sit at positions n .. n + depth - 1 < capacity
        if depth < 1:
            return None
        if self.n_seen > n or self.n_seen == n:  # rewind so that the last committed token is fed again (a recurrent
            self.n_seen = self.cache.rewind(min(self.n_seen, n - 1))  # draft model's cache restarts from 0 instead)
        if self.static:
            logits = self.runner.run(committed[self.n_seen:], list(range(self.n_seen, n)), self.n_seen, None)
            if logits is not None:  # else: more unseen tokens than the largest bucket, dynamic path below
                toks, lps = self._draft_static(logits[-1], n, depth)
                self.n_seen = n
                self.cache.commit(n)
                return PositionalLattice(toks, lps)
        new = torch.tensor(committed[self.n_seen :], dtype=torch.long, device=dev)
        pos = torch.arange(self.n_seen, n, device=dev)
        hidden = m.forward(new, pos, self.cache, self.n_seen)[-1:]
        self.cache.commit(n)
        mark = self.cache.checkpoint()  # each drafted position is committed to run the next, then dropped
        toks, lps = [], []
        for d in range(depth):
            logp = torch.log_softmax(m.logits(hidden)[0], dim=-1)
            lp, tk = logp.topk(self.top_k)
            toks.append(tk)
            lps.append(lp)
            if d + 1 < depth:
                hidden = m.forward(tk[:1], torch.tensor([n + d], device=dev), self.cache, n + d)
                self.cache.commit(n + d + 1)
        self.n_seen = n
        self.cache.rollback(mark)
        return PositionalLattice(torch.stack(toks).cpu(), torch.stack(lps).float().cpu())

    def _loop(self, depth: int) -> dict:
        """Static buffers of the drafting loop for ``depth`` positions (the graph is captured on first use)."""
        if depth in self._loops:
            return self._loops[depth]
        m, dev = self.model, self.model.device
        st = {"first": torch.zeros(m.args.vocab_size, dtype=torch.float32, device=dev),
              "start": torch.zeros((), dtype=torch.long, device=dev),
              "tok": torch.zeros(1, dtype=torch.long, device=dev),
              "mask": torch.ones(1, 1, dtype=torch.bool, device=dev),
              "toks": torch.zeros(depth, self.top_k, dtype=torch.long, device=dev),
              "lps": torch.zeros(depth, self.top_k, dtype=torch.float32, device=dev), "graph": None}
        self._loops[depth] = st
        return st

    def _loop_body(self, st: dict, depth: int) -> None:
        """``depth`` draft positions from the logits ``st["first"]``; position d's token is fed back on the
        device to a one-row static pass at slot ``start + d``. Writes ``st["toks"], st["lps"] [depth, K]``."""
        m = self.model
        logits = st["first"]
        for d in range(depth):
            lp, tk = torch.log_softmax(logits, dim=-1).topk(self.top_k)
            st["toks"][d].copy_(tk)
            st["lps"][d].copy_(lp)
            if d + 1 < depth:
                st["tok"].copy_(tk[:1])
                slot = st["start"] + d
                hidden = m.forward_static(st["tok"], slot.view(1), self.cache, slot, st["mask"])
                logits = m.logits(hidden)[0]

    def _draft_static(self, first_logits: torch.Tensor, n: int, depth: int):
        """Run the drafting loop after the catch-up pass; ``(toks, lps)`` on the host, one read."""
        st = self._loop(depth)
        st["first"].copy_(first_logits)
        st["start"].fill_(n)
        if self.model.device.type != "cuda":
            self._loop_body(st, depth)
        else:
            if st["graph"] is None:  # capture now that start = n: the warm-up writes only past the prefix
                from specpilot.w12.gemm import reserve_split_locks

                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._loop_body(st, depth)
                torch.cuda.current_stream().wait_stream(side)
                st["graph"] = torch.cuda.CUDAGraph()
                capture = torch.cuda.graph(st["graph"])
                reserve_split_locks(self.model.device, capture.capture_stream)
                with capture:
                    self._loop_body(st, depth)
            st["graph"].replay()
        return st["toks"].cpu(), st["lps"].float().cpu()
