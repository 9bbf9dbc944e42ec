"""One request through the engine thread: its limits, its text as it is committed, its end and its metrics.

:func:`make_spec` checks a tokenized prompt and ``max_tokens`` against the engine's context (400s, never an
out-of-memory); :class:`Run` submits it to the :class:`~specpilot.serve.driver.EngineDriver`, turns its step
outputs into text pieces through :class:`~specpilot.serve.detok.TextStream`, aborts it in the engine when a stop
string ends it early, when its client disconnects or when its consumer stops, and records its metrics. Streamed
and non-streamed responses read the same pieces, so their texts are equal.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from specpilot.engine.batch import Request
from specpilot.serve.detok import TextStream
from specpilot.serve.driver import ADMITTED, Coalesced, Failure, LoopSink
from specpilot.serve.protocol import APIError

DISCONNECTED = "disconnected"


@dataclass
class ServeContext:
    """What every request handler needs. ``max_len``: the engine's context in tokens (prompt + output);
    ``eos_ids``: the engine's own stop ids (their text is left out of outputs)."""

    driver: object
    tokenizer: object
    model_name: str
    max_len: int
    vocab_size: int
    eos_ids: frozenset[int]
    metrics: object
    chat_template: str = ""
    chat_source: str = "tokenizer"
    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class Spec:
    """A checked request: prompt ids, ``max_tokens`` (≥ 1, fits the context), stop strings and stop ids."""

    prompt_ids: list[int]
    max_tokens: int
    stops: list[str]
    stop_ids: frozenset[int]
    include_stop: bool = False
    skip_special_tokens: bool = True


def make_spec(ctx: ServeContext, prompt_ids: list[int], max_tokens: int | None, req) -> Spec:
    """A :class:`Spec` for ``prompt_ids`` and ``max_tokens`` (None: what the context leaves, vLLM's default).

    Raises:
        APIError: 400 for an empty prompt, ids outside the vocabulary, a prompt that leaves no room in the context,
            ``max_tokens`` beyond what the context leaves (``code="context_length_exceeded"``, as vLLM refuses it
            rather than clamping), or stop token ids outside the vocabulary.
    """
    n = len(prompt_ids)
    if n == 0:
        raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
    if min(prompt_ids) < 0 or max(prompt_ids) >= ctx.vocab_size:
        raise APIError(400, f"prompt token ids must lie in [0, {ctx.vocab_size})", param="prompt", code="invalid_value")
    if n >= ctx.max_len or (max_tokens is not None and n + max_tokens > ctx.max_len):
        asked = "" if max_tokens is None else f" + {max_tokens} in the completion = {n + max_tokens}"
        room = ctx.max_len - (1 if max_tokens is None else max_tokens)  # the longest prompt this request allows
        fix = (f"shorten the prompt or lower max_tokens (at most {ctx.max_len - n} here)" if n < ctx.max_len
               else f"shorten the prompt to at most {room} tokens" if room >= 1 and max_tokens is None
               else f"shorten the prompt to at most {room} tokens or lower max_tokens" if room >= 1
               else "shorten the prompt and lower max_tokens")
        raise APIError(400, f"this model's maximum context length is {ctx.max_len} tokens; the request has {n} "
                       f"prompt tokens{asked}: {fix}", param="max_tokens" if n < ctx.max_len else "prompt",
                       code="context_length_exceeded")
    stop_ids = list(req.stop_token_ids or [])
    if any(not 0 <= t < ctx.vocab_size for t in stop_ids):
        raise APIError(400, f"stop_token_ids must lie in [0, {ctx.vocab_size})", param="stop_token_ids",
                       code="invalid_value")
    return Spec(list(prompt_ids), max_tokens if max_tokens is not None else ctx.max_len - n, req.stop_list(),
                frozenset(stop_ids), req.include_stop_str_in_output, req.skip_special_tokens)


class Run:
    """One request in flight. Use :meth:`start`, then iterate :meth:`pieces`; read the result fields after.

    ``whole``: the response is read whole, not streamed; without stop strings its step outputs then come from the
    engine thread in one piece at its end (:class:`~specpilot.serve.driver.LoopSink`'s ``coalesce``): the same
    tokens through the same :class:`~specpilot.serve.detok.TextStream`, so the same text and usage.

    Attributes:
        id: the response id (``cmpl-...`` / ``chatcmpl-...``), also the engine's request id.
        finish_reason: ``stop`` | ``length`` | ``abort`` once the output ended (None while running, or when the
            client went away / the engine failed).
        stop_reason: the stop string or stop token id that ended it (None for EOS and length).
        completion_tokens: tokens counted in usage (up to the one that completed a stop string or was a stop id).
    """

    def __init__(self, ctx: ServeContext, spec: Spec, prefix: str = "cmpl", whole: bool = False):
        self.ctx, self.spec = ctx, spec
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.queue: asyncio.Queue = asyncio.Queue()
        # a response read whole (not streamed) without stop strings: its steps come over at its end (LoopSink)
        self._deliver = LoopSink(asyncio.get_running_loop(), self.queue.put_nowait, whole and not spec.stops)
        self.request = Request(request_id=self.id, prompt_ids=spec.prompt_ids, max_new_tokens=spec.max_tokens,
                               stop_ids=spec.stop_ids)
        self.text = TextStream(ctx.tokenizer, spec.prompt_ids, spec.stops, ctx.eos_ids | spec.stop_ids,
                               spec.include_stop, spec.skip_special_tokens)
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.t0 = time.perf_counter()
        self._last: float | None = None
        self._ended = False

    @property
    def completion_tokens(self) -> int:
        return self.text.tokens

    def usage(self) -> dict:
        """OpenAI's usage object."""
        p, c = len(self.spec.prompt_ids), self.completion_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def disconnected(self) -> None:
        """The client went away: abort the request in the engine (its slot is freed) and end :meth:`pieces`
        (also when nothing iterates it any more)."""
        if not self._ended:
            self.ctx.driver.abort(self.id)
            self._end("abort", final=False)
        self.queue.put_nowait(DISCONNECTED)

    async def start(self) -> bool:
        """Submit to the engine thread and wait until the engine took the request; False when the client went
        away meanwhile (the request is then aborted).

        Raises:
            APIError: the engine refused it (400) or failed (500 / 503).
        """
        self.ctx.driver.submit(self.request, self._deliver)
        item = await self.queue.get()
        if isinstance(item, Failure):
            self._end("error" if item.status >= 500 else None)
            raise APIError(item.status, item.message)
        return item == ADMITTED

    async def pieces(self) -> AsyncIterator[str]:
        """Text pieces as the engine commits tokens (one per step that gave text; the last may be ''). On return
        :attr:`finish_reason` is set; a client gone ends it early with ``finish_reason`` None.

        Raises:
            APIError: 500 when the engine failed on a step holding this request.
        """
        try:
            while True:
                item = await self.queue.get()
                if item == DISCONNECTED:
                    return
                if isinstance(item, Failure):
                    self._end("error")
                    raise APIError(item.status, item.message)
                stamps = None
                if isinstance(item, Coalesced):  # every step after the first, at the end
                    item, stamps = item.output, item.stamps
                self._timing(item, stamps)
                piece = self.text.feed(item.new_tokens)
                text, done = piece.text, piece.stopped
                if piece.stopped:
                    self.stop_reason = None if piece.stop in self.ctx.eos_ids else piece.stop
                    if not item.finished:  # a stop string cut it: free its slot now
                        self.ctx.driver.abort(self.id)
                elif item.finished:
                    tail = self.text.finish()
                    text, done = text + tail.text, True
                    if tail.stopped:
                        self.stop_reason = tail.stop
                if done or item.finished:
                    reason = "stop" if piece.stopped or self.stop_reason is not None else item.finish_reason
                    self._end(reason if reason in ("stop", "length", "abort") else "stop")
                    yield text
                    return
                if text:
                    yield text
        finally:
            if self.finish_reason is None and not self._ended:  # client gone, consumer closed, or cancelled
                self.ctx.driver.abort(self.id)
                self._end("abort", final=False)

    def _timing(self, out, stamps: list[float] | None = None) -> None:
        """Time to first token and inter-token latencies: at ``out``'s arrival, or at each of ``stamps`` (when the
        held steps of a coalesced output ended)."""
        if stamps is None:
            if not out.new_tokens:
                return
            stamps = [time.perf_counter()]
        m = self.ctx.metrics
        for now in stamps:
            if self._last is None:
                m.ttft.labels(m.model).observe(now - self.t0)
            else:
                m.itl.labels(m.model).observe(now - self._last)
            self._last = now

    def _end(self, reason: str | None, final: bool = True) -> None:
        if self._ended:
            return
        self._ended = True
        if final and reason in ("stop", "length", "abort"):
            self.finish_reason = reason
        if reason is not None:
            m = self.ctx.metrics
            m.finished.labels(m.model, reason).inc()
            m.e2e.labels(m.model).observe(time.perf_counter() - self.t0)


async def watch_disconnect(receive, run: Run) -> None:
    """Wait for the client's ``http.disconnect`` on the ASGI ``receive`` channel, then tell ``run``. Cancel this
    task when the response is complete."""
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            run.disconnected()
            return
