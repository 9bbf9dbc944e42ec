"""Row buckets and CUDA graphs for the exact pass (gpt-fast / vLLM-style graph replay).

A pass of R rows is padded to the next bucket size B ≥ R and run through the model's static path
(``start`` a device tensor, an ``[B, B]`` tree mask): shapes depend only on B, so one CUDA graph per bucket
replays any step. Padding rows attend only to themselves and the prefix, and their K/V land in slots past
the real rows, which nothing reads; their outputs are dropped. Row counts above the largest bucket fall
back to the eager dynamic path (R13). On the CPU the same padded static path runs without graphs, which is
how CI tests that padding never changes the tokens.

A hybrid target's cache (:class:`~specpilot.model.hybrid_cache.HybridCache`) is told of every pass before it runs
(``begin_pass(start, rows, bucket)``): the pass records its rows' GDN inputs into that bucket's static buffers and
the commit replays the accepted path from them. Its passes must start at the committed length, so a
:meth:`BucketRunner.prefill` of more than one chunk fails at its second (the engine prefills a hybrid eagerly) and
:meth:`BucketRunner.ar_tokens` (steps queued ahead of their commits) is refused.
"""

from __future__ import annotations

import numpy as np
import torch

from specpilot.model.cache import KVCache
from specpilot.model.hybrid_cache import HybridCache
from specpilot.model.transformer import Transformer

#: Default row buckets (rows of one exact pass).
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 64, 96, 128, 192, 256)


def bucket_for(rows: int, buckets=BUCKETS) -> int | None:
    """The smallest bucket ≥ ``rows``, or None when ``rows`` exceeds every bucket (eager fallback)."""
    for b in buckets:
        if b >= rows:
            return b
    return None


class BucketRunner:
    """Runs exact passes padded to row buckets, replaying one CUDA graph per bucket on CUDA.

    Args:
        model: the :class:`Transformer`.
        cache: its cache; must hold ``max_len + max(buckets)`` slots (padding rows write past the rows).
        buckets: row buckets (increasing).
        graphs: capture CUDA graphs (CUDA only; ignored on the CPU).
        output: ``argmax`` (``[R] long``, the target's verify step) or ``logits`` (``[R, V] float32``).
            With the certified INT8 head on CUDA graphs (:attr:`head_flags`) the head also flags the rows that
            need the full head (:meth:`needs_full_head`), settled with :meth:`full_head`.
        logits_hook: test-only (adversarial candidates): applied to the float32 logits ``[b, V]`` inside the
            captured pass (it must be capturable: device tensors only after its first, eager call).
        feature_layers: 0-based target layers whose outputs every pass also writes to :attr:`features` (inside the
            graph), for a drafter that reads target features (block drafters, EAGLE-3; §1.1). ``()``: none.

    Attributes:
        features: ``[max(buckets), len(feature_layers) * hidden]`` (model dtype) or None: the last pass's target
            features, rows first; one buffer that every bucket's graph writes, so a drafter's own graph can read
            it at a fixed address.
    """

    def __init__(self, model: Transformer, cache: KVCache, buckets=BUCKETS, graphs: bool = True,
                 output: str = "argmax", logits_hook=None, feature_layers: tuple[int, ...] = ()):
        self.model, self.cache, self.buckets, self.output = model, cache, tuple(buckets), output
        self.logits_hook = logits_hook
        self.feature_layers = tuple(feature_layers)
        self.features = None
        if self.feature_layers:
            width = len(self.feature_layers) * model.args.hidden_size
            self.features = torch.zeros(self.buckets[-1], width, dtype=model.dtype, device=model.device)
        self.dev = model.device
        self.graphs = graphs and self.dev.type == "cuda"
        self._static: dict[int, dict] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None
        #: graphs run the certified INT8 head's ``argmax_flagged`` (§4.1): ids plus per-row ``needs_full_head``
        #: flags (:meth:`needs_full_head`), which :meth:`full_head` settles after the host read
        self.head_flags = (self.graphs and output == "argmax" and logits_hook is None
                           and getattr(model, "int8_head", None) is not None)
        self._flags: tuple | None = None  # the last run()'s host needs_full_head flags and their copy's event
        self._last_bucket: int | None = None

    def _buffers(self, b: int) -> dict:
        """Static inputs of bucket ``b``: views of one device buffer ``io`` (tokens, positions, start, the
        ``[b, b]`` mask as 0/1), filled by one copy from a pinned host twin per step."""
        if b not in self._static:
            n = 2 * b + 1 + b * b
            io = torch.zeros(n, dtype=torch.long, device=self.dev)
            host = torch.zeros(n, dtype=torch.long, pin_memory=self.dev.type == "cuda")
            self._static[b] = {"io": io, "host": host, "host_np": host.numpy(), "tokens": io[:b], "positions": io[b:2 * b],
                               "start": io[2 * b], "mask01": io[2 * b + 1:].view(b, b), "out": None}
        return self._static[b]

    @staticmethod
    def _host(s: dict):
        """The pinned host twin of bucket ``s``'s inputs (numpy view), once the device has read its previous
        upload: back-to-back passes of one bucket without a host read in between (prefill chunks, a redone
        AR step) must not rewrite it while the last copy is still queued."""
        if s.get("copied") is not None:
            s["copied"].synchronize()
            s["copied"] = None
        return s["host_np"]

    def _upload(self, s: dict) -> None:
        """The one host-to-device copy of a pass (asynchronous on CUDA; an event marks when it was read)."""
        s["io"].copy_(s["host"], non_blocking=True)
        if self.dev.type == "cuda":
            if "event" not in s:
                s["event"] = torch.cuda.Event()  # one event a bucket, recorded again every pass
            s["copied"] = s["event"]
            s["copied"].record()

    def _body(self, s: dict) -> torch.Tensor:
        mask = s["mask01"] != 0
        feats: list[torch.Tensor] = []
        hidden = self.model.forward_static(s["tokens"], s["positions"], self.cache, s["start"], mask,
                                           features=feats, feature_layers=self.feature_layers)
        if feats:  # the drafter's context, written where its own graph reads it
            torch.cat(feats, dim=-1, out=self.features[: hidden.shape[0]])
        if self.logits_hook is not None:  # test-only (adversarial candidates): captured with the pass
            logits = self.logits_hook(self.model.logits(hidden))
            return logits.argmax(dim=-1) if self.output == "argmax" else logits
        if self.head_flags:
            s["hidden"] = hidden
            return self.model.int8_head.argmax_flagged(hidden)  # (ids [b], needs_full_head [b]) on the device
        return self.model.greedy(hidden) if self.output == "argmax" else self.model.logits(hidden)

    def full_head(self, r: int) -> list[int]:
        """The full head's argmax (host ints) of the first ``r`` rows of the last pass, from its static
        hidden states over the whole bucket (the same ``[B, H]`` product as without the int8 head): how
        the engine settles rows the certified INT8 head flagged (§4.1). Raises RuntimeError before a pass."""
        if self._last_bucket is None or "hidden" not in self._static[self._last_bucket]:
            raise RuntimeError("no flagged pass to settle")
        with torch.inference_mode():
            return self.model.int8_head.full_argmax(self._static[self._last_bucket]["hidden"])[:r].tolist()

    def needs_full_head(self) -> list[bool]:
        """Per row of the last :meth:`run` (host bools): whether the certified INT8 head left the row to the full
        head (:meth:`full_head`); ``[]`` when that pass did not go through the head's flagged form (eager
        fallback, no INT8 head, logits). Call it after the host read of that pass's ids: the flags were copied to
        host memory before it on the same stream, so this waits for nothing more."""
        if self._flags is None:
            return []
        flags, ready = self._flags
        if ready is not None:
            ready.synchronize()  # already done once the caller has read the ids
        return flags.tolist()

    def _with_flags(self, s: dict, out, r: int) -> torch.Tensor:
        """The ids ``[r]`` of a pass through the certified INT8 head; its ``needs_full_head`` flags are copied to a
        pinned host buffer now (asynchronously, queued before the caller's read of the ids) for
        :meth:`needs_full_head`: one host read a step, as without the head."""
        ids, needs = out
        if "flags" not in s:
            s["flags"] = torch.zeros(needs.numel(), dtype=torch.bool, pin_memory=self.dev.type == "cuda")
        s["flags"][:r].copy_(needs[:r], non_blocking=True)
        ready = None
        if self.dev.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        self._flags = (s["flags"][:r], ready)
        return ids[:r]

    def _capture(self, b: int) -> None:
        from specpilot.w12.gemm import reserve_split_locks

        s = self._buffers(b)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up (Triton autotune / cuBLAS handles) outside the capture
                self._body(s)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        capture = torch.cuda.graph(g, pool=self._pool)
        reserve_split_locks(self.model.device, capture.capture_stream)  # W12's split-K sums stay in the kernel
        with capture:
            s["out"] = self._body(s)
        self._pool = g.pool()
        self._graphs[b] = g

    def drop_graphs(self) -> None:
        """Forget every captured graph and their memory pool (the next pass of each bucket captures again).
        The pool handle must go with the graphs: once they are freed PyTorch releases the pool, and a capture
        into a released pool fails inside the caching allocator (``use_count > 0`` assert)."""
        self._graphs.clear()
        self._pool = None
        for s in self._static.values():
            s["out"] = None

    @torch.inference_mode()
    def capture_all(self, max_rows: int | None = None) -> list[int]:
        """Capture the graphs of every bucket up to the one holding ``max_rows`` rows (None: all) now, each
        at prefix 0 on padding-row inputs (token 0, a diagonal mask), so that no capture, Triton compile or
        cuBLAS warm-up happens later inside a timed request (a bucket first met mid-run cost a capture
        there, which the controller timed as noise). Writes K/V only to slots ``[0, B)``, which a request's
        prefill overwrites. Returns the buckets captured so far (``[]`` on the CPU or without graphs).
        Raises: ValueError when a bucket does not fit the cache."""
        if not self.graphs:
            return []
        last = bucket_for(max_rows, self.buckets) if max_rows is not None else None
        for b in self.buckets:
            if last is not None and b > last:
                break
            if b > self.cache.max_len:
                raise ValueError(f"bucket {b} exceeds the cache of {self.cache.max_len} slots")
            if b in self._graphs:
                continue
            s = self._buffers(b)
            host = self._host(s)
            host[:] = 0
            host[b:2 * b] = np.arange(b)
            np.fill_diagonal(host[2 * b + 1:].reshape(b, b), 1)
            s["io"].copy_(s["host"])
            self._capture(b)
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
        return sorted(self._graphs)

    @torch.inference_mode()
    def run(self, tokens: list[int], positions: list[int], start: int, tree_mask: torch.Tensor | None):
        """One pass of R rows at prefix ``start``; returns ``[R]`` argmax or ``[R, V]`` logits on the
        device, or None when R exceeds the largest bucket (the caller then runs the eager path). With
        :attr:`head_flags` the argmax of rows :meth:`needs_full_head` flags is a guess: settle them with
        :meth:`full_head`.

        Args:
            tokens / positions: R token ids and position ids (host lists: one small copy to the device).
            start: committed slots (the rows' K/V go to ``[start, start + R)``).
            tree_mask: ``[R, R] bool`` (host) among the rows; None = causal (chains, prompt chunks).
        Raises:
            ValueError: when padded rows would not fit the cache.
        """
        r = len(tokens)
        b = bucket_for(r, self.buckets)
        self._flags = None
        if b is None:
            return None
        if start + b > self.cache.max_len:
            raise ValueError(f"bucket {b} at prefix {start} exceeds the cache of {self.cache.max_len} slots")
        if isinstance(self.cache, HybridCache):  # its commit replays this pass's record (module doc)
            self.cache.begin_pass(start, r, b)
        s = self._buffers(b)
        host = self._host(s)  # numpy view of the pinned buffer: far cheaper per op than torch on the host
        host[:r] = tokens
        host[b:2 * b] = positions[0]  # padding rows: any valid position
        host[b:b + r] = positions
        host[2 * b] = start
        mask = host[2 * b + 1:].reshape(b, b)
        mask[:] = 0
        np.fill_diagonal(mask, 1)  # padding rows see themselves
        if tree_mask is None:
            mask[:r, :r] = np.tri(r, dtype=np.int64)
        else:
            mask[:r, :r] = tree_mask.numpy()
        self._upload(s)
        self._last_bucket = b
        if self.graphs:
            if b not in self._graphs:
                self._capture(b)
            self._graphs[b].replay()
            out = s["out"]
        else:
            out = self._body(s)
        if self.head_flags:
            return self._with_flags(s, out, r)
        return out[:r]

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], observe=None) -> int:
        """The prompt's exact pass in chunks of the largest bucket (one graph replay each on CUDA, no eager
        launches: an eager 8B pass costs ~35 ms of launches whatever its rows), K/V to slots ``[0, P)``;
        returns the argmax (host int) of its last row, the first generated token. Chunk ``i`` attends to
        slots ``[0, i·B)`` and causally among its rows, as one causal pass over the prompt does. With the
        certified INT8 head a flagged last row is settled by :meth:`full_head`.

        Args:
            prompt_ids: the prompt's token ids.
            observe: with :attr:`feature_layers`, called as ``observe(features [n, F], start)`` after each chunk
                of ``n`` rows at slots ``[start, start + n)`` (a view of :attr:`features`, valid until the next pass).
        Raises:
            ValueError: an empty prompt, or one whose padded last chunk does not fit the cache.
        """
        if not prompt_ids:
            raise ValueError("empty prompt")
        step = self.buckets[-1]
        for s in range(0, len(prompt_ids), step):
            chunk = prompt_ids[s:s + step]
            out = self.run(chunk, list(range(s, s + len(chunk))), s, None)
            if observe is not None and self.features is not None:
                observe(self.features[: len(chunk)], s)
        tok = int(out[-1])
        if self.head_flags and self.needs_full_head()[-1]:
            tok = self.full_head(len(chunk))[-1]
        return tok

    @torch.inference_mode()
    def ar_tokens(self, token: int, start: int, limit: int):
        """AR greedy decoding, pipelined: yields up to ``limit`` tokens (ints) following ``token``.

        ``token`` is the last committed token and ``start`` its slot (= committed length - 1). Step i+1's
        pass is queued on the device (its input token copied from step i's argmax on the device, position
        and slot advanced on the device) *before* the host reads step i's token, so the GPU never waits
        for the host between steps (no gaps between steps). A queued step past a stop is harmless:
        it writes K/V only at the slot after the last committed token, which the cache never counts. Each
        yielded token is the argmax of an exact one-row pass over exactly the committed prefix, as in
        :meth:`run`. Closing the generator early is the way to stop. With the certified INT8 head
        (:attr:`head_flags`) a step whose row the head flagged feeds its guess to the queued step; the host
        then redoes that step unpipelined, settles it with the full head (:meth:`full_head`), re-seeds the
        device inputs and queues the next step again (the guessed step's K/V slot is rewritten).

        Raises:
            ValueError: when ``start + limit`` rows would not fit the cache, or on a hybrid target's cache.
        """
        if start + limit + 1 > self.cache.max_len:
            raise ValueError(f"{limit} AR steps from slot {start} exceed the cache of {self.cache.max_len} slots")
        if isinstance(self.cache, HybridCache):
            raise ValueError("pipelined AR needs a commit between steps on a hybrid (recurrent) cache: step it instead")
        s = self._buffers(1)
        self._host(s)[:4] = (token, start, start, 1)  # tokens, positions, start, mask of bucket 1
        self._upload(s)
        if self.graphs and 1 not in self._graphs:
            self._capture(1)
        cuda = self.dev.type == "cuda"
        read = torch.zeros(max(limit, 1), dtype=torch.long, pin_memory=cuda)
        flags = torch.zeros(max(limit, 1), dtype=torch.bool, pin_memory=cuda)  # the INT8 head's needs_full_head

        def launch(i):
            if self.graphs:
                self._graphs[1].replay()
                out = s["out"]
            else:
                out = self._body(s)
            ids, needs = out if self.head_flags else (out, None)
            read[i : i + 1].copy_(ids, non_blocking=True)
            if needs is not None:
                flags[i : i + 1].copy_(needs, non_blocking=True)
            done = torch.cuda.Event() if cuda else None
            if done is not None:
                done.record()
            # the next step's input, on the device (a flagged INT8-head row feeds its guess, a valid id; redone below)
            s["tokens"].copy_(ids)
            s["positions"].add_(1)
            s["start"].add_(1)
            return done

        def seed(tok: int, slot: int):  # device inputs of a one-row pass of ``tok`` at ``slot``, from the host
            self._host(s)[:4] = (tok, slot, slot, 1)
            self._upload(s)

        last_in = token
        self._last_bucket = 1
        pending = launch(0) if limit > 0 else None
        for i in range(limit):
            nxt = launch(i + 1) if i + 1 < limit else None
            if pending is not None:
                pending.synchronize()
            tok = int(read[i])
            if flags[i]:  # certified INT8 head flagged step i: redo it unpipelined, settle with the full head
                if nxt is not None:
                    nxt.synchronize()  # step i + 1 ran on a guess: its K/V slot is rewritten below
                seed(last_in, start + i)
                launch(i)
                tok = self.full_head(1)[0]
                if i + 1 < limit:
                    seed(tok, start + i + 1)
                    nxt = launch(i + 1)
            yield tok
            last_in, pending = tok, nxt
