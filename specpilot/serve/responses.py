"""OpenAI's response shapes: completion and chat completion objects, and their server-sent-event streams.

A non-streamed response joins a :class:`~specpilot.serve.run.Run`'s text pieces into one object; a streamed one
sends each piece as a chunk (``text_completion`` / ``chat.completion.chunk``), then a chunk with the
``finish_reason``, then (``stream_options.include_usage``) a chunk with no choices and the usage, then
``data: [DONE]``. Choices carry vLLM's ``stop_reason`` (the stop string or stop token id that ended the output,
None for EOS or length). An engine failure mid-stream is sent as ``data: {"error": {...}}`` before ``[DONE]``
(vLLM's way: the status line has already gone out).
"""

from __future__ import annotations

import json
import time
from typing import AsyncIterator

from fastapi.sse import format_sse_event

from specpilot.serve.protocol import APIError

DONE = format_sse_event(data_str="[DONE]")


def _event(obj: dict) -> bytes:
    return format_sse_event(data_str=json.dumps(obj, ensure_ascii=False))


def completion_object(ctx, run, text: str) -> dict:
    """The ``text_completion`` object of a finished run."""
    return {"id": run.id, "object": "text_completion", "created": int(time.time()), "model": ctx.model_name,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": run.finish_reason,
                         "stop_reason": run.stop_reason}],
            "usage": run.usage()}


def chat_object(ctx, run, text: str) -> dict:
    """The ``chat.completion`` object of a finished run."""
    return {"id": run.id, "object": "chat.completion", "created": int(time.time()), "model": ctx.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": run.finish_reason, "stop_reason": run.stop_reason}],
            "usage": run.usage()}


class _Chunks:
    """Builds the chunks of one stream (completion or chat)."""

    def __init__(self, ctx, run, chat: bool, stream_options):
        self.ctx, self.run, self.chat = ctx, run, chat
        self.usage = bool(stream_options and stream_options.include_usage)
        self.continuous = bool(stream_options and stream_options.continuous_usage_stats)
        self.created = int(time.time())

    def _base(self, choices: list) -> dict:
        obj = {"id": self.run.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.ctx.model_name, "choices": choices}
        if self.usage:
            obj["usage"] = self.run.usage() if self.continuous else None
        return obj

    def piece(self, text: str | None, finish: str | None = None, role: bool = False) -> bytes:
        if self.chat:
            delta = ({"role": "assistant", "content": ""} if role else
                     {} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = self.run.stop_reason
        return _event(self._base([choice]))

    def usage_chunk(self) -> bytes:
        obj = self._base([])
        obj["usage"] = self.run.usage()
        return _event(obj)


async def sse_stream(ctx, run, watcher, chat: bool, stream_options) -> AsyncIterator[bytes]:
    """The event stream of ``run`` (already started); cancels ``watcher`` (its disconnect watch) at the end. A
    client gone ends the stream without [DONE] (nobody reads it) and the run aborts itself in the engine."""
    chunks = _Chunks(ctx, run, chat, stream_options)
    try:
        if chat:
            yield chunks.piece(None, role=True)
        async for text in run.pieces():
            if text:
                yield chunks.piece(text)
        if run.finish_reason is None:
            return
        yield chunks.piece(None, run.finish_reason)
        if chunks.usage:
            yield chunks.usage_chunk()
    except APIError as e:
        yield _event(e.body())
    finally:
        watcher.cancel()
    yield DONE


async def collect(run, watcher) -> str:
    """The whole text of ``run`` (already started); cancels ``watcher`` at the end.

    Raises:
        APIError: the engine failed on a step holding the request (500).
    """
    try:
        return "".join([piece async for piece in run.pieces()])
    finally:
        watcher.cancel()
