"""Padded batched passes and their CUDA graphs: one graph per (requests, rows) bucket (§2.2).

A decode step of B requests and R rows (each request's ``[root] + tree``) is padded to a bucket: b ≥ B requests
from :data:`REQUEST_BUCKETS` and r ≥ R rows from :data:`~specpilot.engine.runner.BUCKETS`, with at most
``max_rows`` rows per request. Every input of the pass (tokens, positions, each row's pool slot and position, each
request's slot, start, count and first row, each request's mask among its rows) sits in one int64 device buffer
filled by one copy from a pinned host twin, and the Triton batched tree attention
(:mod:`specpilot.kernels.batch_attention`) reads them on the device: the shapes depend only on the bucket, so one
CUDA graph replays any step of it (gpt-fast / vLLM-style replay, per bucket pair as vLLM's batch-size graphs).

A step in which every request verifies one row (an AR step, as a load plan runs at the loads where AR was
sealed) replays graphs laid out for one row a request, and without the drafter's target features when the step does
not feed it: the same kernels, grids and inputs as an AR engine's step, whatever trees the plan's other systems
verify (a layout for the largest tree cost a six-size plan 2-4% against AR at its AR loads).

Padding never changes a token: padding rows write their K/V to the pool's scratch slot, which no request owns, and
belong to no request (the kernel gives them zeros; their outputs are dropped); padding requests have no rows. On
the CPU the same padded path runs without graphs (in the Triton interpreter), which is how CI tests it.
"""

from __future__ import annotations

import numpy as np
import torch

from specpilot.engine.runner import BUCKETS, bucket_for
from specpilot.errors import SpecPilotError
from specpilot.model.batch import Prepared
from specpilot.model.cache import KVPool
from specpilot.model.transformer import Transformer

#: Default request buckets (requests of one batched pass).
REQUEST_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: Default row buckets of a batched pass: the single-request buckets, then up to 32 requests of 16 rows.
ROW_BUCKETS = BUCKETS + (320, 384, 448, 512)


def runs_padded(model: Transformer, pool) -> bool:
    """Whether a batched engine on ``model`` with ``pool`` pads its decode passes by default: on CUDA with Triton,
    without the certified INT8 head (which settles flagged rows on the host), on a pool with padded passes (a hybrid
    target's has none). Triton is imported only for a CUDA target (a CPU run may set its interpreter later)."""
    if model.device.type != "cuda" or model.int8_head is not None or not pool.padded_passes:
        return False
    from specpilot.kernels.tree_attention import triton

    return triton is not None


class BatchRunner:
    """Runs batched decode passes padded to (requests, rows) buckets, replaying one CUDA graph per bucket on CUDA.

    Args:
        model: the target :class:`Transformer`.
        pool: its :class:`KVPool`; ``scratch`` is a slot of it that no request ever owns (padding rows write there).
        max_rows: most rows of one request in a pass (``1 + nodes`` of the tree budget; with a shared budget,
            1 + the largest budget, which one request may take whole).
        feature_layers: target layers whose outputs a drafter reads (their concatenation is returned per row, in the
            steps that ask for it).
        step_extra_rows: most rows a step adds on top of one per request (a shared budget's largest), which bounds
            the row buckets :meth:`capture_all` captures; None: ``max_rows`` per request.
        graphs: capture CUDA graphs (CUDA only; the CPU runs the padded pass eagerly).
        plain_steps: steps that do not feed the feature-reading drafter run too (a load plan with other systems):
            :meth:`capture_all` captures their graphs without the features as well.
        row_buckets / request_buckets: the buckets (increasing).
    Raises:
        ValueError: ``scratch`` outside the pool, ``max_rows < 1``, or a model with the certified INT8 head (its
            fallback reads the host; batched passes with it run eagerly).
        SpecPilotError: a pool without padded passes (``pool.padded_passes`` False: a hybrid target's).
    """

    def __init__(self, model: Transformer, pool: KVPool, scratch: int, max_rows: int,
                 feature_layers: tuple[int, ...] = (), graphs: bool = True, row_buckets=ROW_BUCKETS,
                 request_buckets=REQUEST_BUCKETS, step_extra_rows: int | None = None, plain_steps: bool = False):
        if not 0 <= scratch < pool.num_slots or max_rows < 1:
            raise ValueError(f"scratch slot {scratch} of {pool.num_slots}, max_rows {max_rows}")
        if model.int8_head is not None:
            raise ValueError("the certified INT8 head settles flagged rows on the host: no padded batched pass")
        if not pool.padded_passes:
            raise SpecPilotError("this target's batch (a hybrid target's recurrent states) has no padded batched "
                                 "pass: run BatchEngine(padded=False)")
        self.model, self.pool, self.scratch, self.max_rows = model, pool, scratch, max_rows
        self.step_extra_rows, self.plain_steps = step_extra_rows, plain_steps
        self.feature_layers = tuple(feature_layers)
        self.row_buckets, self.request_buckets = tuple(row_buckets), tuple(request_buckets)
        self.dev = model.device
        self.graphs = graphs and self.dev.type == "cuda"
        # keyed by (requests b, rows r, layout m: rows a request, features f)
        self._static: dict[tuple[int, int, int, bool], dict] = {}
        self._graphs: dict[tuple[int, int, int, bool], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.passes = self.replays = 0  # padded passes run, and those of them replayed from a graph
        self.layouts: dict[tuple[int, bool], int] = {}  # passes run per (rows a request m, features f)

    def bucket(self, counts: list[int], features: bool = True) -> tuple[int, int, int, bool] | None:
        """The graph key ``(b, r, m, f)`` of a step whose requests have ``counts`` rows: b ≥ requests and r ≥ rows
        from the buckets, the layout m (1 when every request has one row, else ``max_rows``) and f (the features,
        when asked for and there are feature layers); None when it fits none (a request over ``max_rows`` rows, or
        more requests or rows than the largest bucket: the eager path)."""
        if not counts or max(counts) > self.max_rows:
            return None
        b, r = bucket_for(len(counts), self.request_buckets), bucket_for(sum(counts), self.row_buckets)
        m = 1 if max(counts) == 1 else self.max_rows
        return None if b is None or r is None else (b, r, m, bool(features and self.feature_layers))

    def _buffers(self, key: tuple[int, int, int, bool]) -> dict:
        """Static inputs of graph ``key = (b, r, m, f)``, views of one int64 device buffer and its pinned host twin."""
        if key not in self._static:
            b, r, m, _ = key
            n = 4 * r + 4 * b + b * m * m
            io = torch.zeros(n, dtype=torch.long, device=self.dev)
            host = torch.zeros(n, dtype=torch.long, pin_memory=self.dev.type == "cuda")
            self._static[key] = {"io": io, "host": host, "np": host.numpy(), "out": None, "copied": None}
        return self._static[key]

    def _body(self, key: tuple[int, int, int, bool], io: torch.Tensor):
        from specpilot.kernels.batch_attention import pack_batch_masks  # here: importing it imports Triton

        b, r, m, f = key
        tokens, positions, row_slot, row_pos = io[:4 * r].view(4, r)
        slots, starts, counts, row_off = io[4 * r:4 * r + 4 * b].view(4, b)
        words = pack_batch_masks(io[4 * r + 4 * b:].view(b, m, m) != 0)
        i32 = torch.int32
        p = Prepared(None, None, row_slot, row_pos, slots, 0, m, None, starts.to(i32), counts.to(i32),
                     row_off.to(i32), words)
        feats: list = []
        layers = self.feature_layers if f else ()
        hidden = self.model.forward_prepared(tokens, positions, self.pool, p, True, None, feats, layers)
        return self.model.batch_greedy(hidden, True), (torch.cat(feats, dim=-1) if feats else None)

    def _capture(self, key: tuple[int, int, int, bool]) -> None:
        from specpilot.w12.gemm import reserve_split_locks

        s = self._buffers(key)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up (Triton compiles, cuBLAS handles) outside the capture
                self._body(key, s["io"])
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        capture = torch.cuda.graph(g, pool=self._pool)
        reserve_split_locks(self.dev, capture.capture_stream)  # W12's split-K sums stay in the kernel
        with capture:
            s["out"] = self._body(key, s["io"])
        self._pool = g.pool()
        self._graphs[key] = g

    def _fill(self, key, slots, starts, tokens, positions, masks) -> None:
        """Write one step's inputs to bucket ``key``'s pinned host buffer (numpy: cheap per request)."""
        b, r, m, _ = key
        s = self._static[key]
        if s["copied"] is not None:  # the device has not read the last upload yet
            s["copied"].synchronize()
            s["copied"] = None
        h = s["np"]
        h[:] = 0
        row_tok, row_pos_, row_slot, row_at = (h[i * r:(i + 1) * r] for i in range(4))
        req = h[4 * r:4 * r + 4 * b].reshape(4, b)
        mask = h[4 * r + 4 * b:].reshape(b, m, m)
        row_slot[:] = self.scratch  # padding rows: the scratch slot, position 0
        req[0, :] = self.scratch  # padding requests: no rows
        at = 0
        for i, (slot, start, tok, pos, mk) in enumerate(zip(slots, starts, tokens, positions, masks)):
            c = len(tok)
            row_tok[at:at + c] = tok
            row_pos_[at:at + c] = pos
            row_slot[at:at + c] = slot
            row_at[at:at + c] = np.arange(start, start + c)
            req[:, i] = (slot, start, c, at)
            mask[i, :c, :c] = np.tri(c, dtype=np.int64) if mk is None else mk.numpy()
            at += c
        req[3, len(slots):] = at

    @torch.inference_mode()
    def capture_all(self, max_requests: int) -> list[tuple[int, int, int, bool]]:
        """Capture now every graph a step of at most ``max_requests`` requests can meet (b requests, r rows with
        b/2 < B ≤ b and B ≤ R ≤ B · max_rows, or R ≤ b + ``step_extra_rows``; R = B in the one-row layout; with and,
        where ``plain_steps``, without the features), so no capture or Triton compile happens inside a timed or
        served step. Captured on all-padding inputs: K/V go to the scratch slot only. Returns the graph keys
        captured so far (``[]`` without graphs)."""
        if not self.graphs:
            return []
        top = bucket_for(max_requests, self.request_buckets) or self.request_buckets[-1]
        feats = [bool(self.feature_layers)] + ([False] if self.feature_layers and self.plain_steps else [])
        for b in self.request_buckets:
            if b > top:
                break
            lo = bucket_for(b // 2 + 1, self.row_buckets)
            most = b * self.max_rows if self.step_extra_rows is None else min(b * self.max_rows, b + self.step_extra_rows)
            layouts = {self.max_rows: bucket_for(most, self.row_buckets) or self.row_buckets[-1],
                       1: bucket_for(b, self.row_buckets) or self.row_buckets[-1]}
            for m, hi in layouts.items():
                for r in self.row_buckets:
                    for f in feats:
                        key = (b, r, m, f)
                        if lo is not None and lo <= r <= hi and key not in self._graphs:
                            self._buffers(key)
                            self._fill(key, [], [], [], [], [])
                            self._static[key]["io"].copy_(self._static[key]["host"])
                            self._capture(key)
        torch.cuda.synchronize(self.dev)
        return sorted(self._graphs)

    @torch.inference_mode()
    def run(self, slots: list[int], starts: list[int], tokens: list[list[int]], positions: list[list[int]],
            masks: list, features: bool = True) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """One batched decode pass, request ``i`` with rows ``tokens[i]`` at ``positions[i]``, K/V written to
        ``[starts[i], starts[i] + len(tokens[i]))`` of slot ``slots[i]``, its mask among its rows ``masks[i]``
        (``[c, c]`` bool host tensor, or None for causal rows); ``features``: return the drafter's features.

        Returns:
            the argmax ``[R] long`` of every real row (on the device) and the drafter's features ``[R, k·hidden]``
            (None without feature layers or when not asked for), or None when the step fits no bucket (the caller
            runs the eager pass).
        """
        key = self.bucket([len(t) for t in tokens], features)
        if key is None:
            return None
        s = self._buffers(key)
        self._fill(key, slots, starts, tokens, positions, masks)
        s["io"].copy_(s["host"], non_blocking=True)
        if self.dev.type == "cuda":
            s.setdefault("event", torch.cuda.Event())
            s["event"].record()
            s["copied"] = s["event"]
        self.passes += 1
        self.layouts[key[2:]] = self.layouts.get(key[2:], 0) + 1
        if self.graphs:
            if key not in self._graphs:
                self._capture(key)
            self._graphs[key].replay()
            self.replays += 1
            ids, feats = s["out"]
        else:
            ids, feats = self._body(key, s["io"])
        n = sum(len(t) for t in tokens)
        return ids[:n], (feats[:n] if feats is not None else None)
