"""The OpenAI-compatible HTTP API (FastAPI) over one :class:`~specpilot.serve.driver.EngineDriver`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` as server-sent events),
``GET /v1/models`` (and ``/v1/models/{id}``), ``GET /health``, ``GET /metrics`` (Prometheus text).

- Auth: with an API key, every ``/v1/...`` request needs ``Authorization: Bearer KEY`` or gets a 401, as vLLM's
  ``--api-key`` does; ``/health`` and ``/metrics`` stay open (vLLM's choice too: probes and scrapers carry no key).
- Every error is OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}``: 400 for a malformed body
  (not JSON, not UTF-8, a lone surrogate, a wrong type, an unknown field), an unsupported sampling field, a prompt or
  ``max_tokens`` beyond the context; 401; 404 for another model name or path; 413 for a body over
  ``max_body_bytes``; 500 when the engine failed on a step holding the request. The server keeps serving.
- A client that disconnects, mid-stream or while waiting, has its request aborted in the engine (slot freed).
- Shutdown (Ctrl-C, :class:`Server`): requests still running near the end of the grace period, or at once on a
  second Ctrl-C, get a 503 (an error event mid-stream) from the driver, rather than being cancelled by uvicorn (a
  bare 500 and a traceback).
- Completion prompts are tokenized without special tokens (as ``specpilot generate`` does); chat messages through
  the chat template (:mod:`specpilot.serve.chat`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from specpilot.errors import PromptError
from specpilot.serve.chat import render_chat
from specpilot.serve.protocol import APIError, ChatRequest, CompletionRequest, check_greedy, parse
from specpilot.serve.responses import chat_object, collect, completion_object, sse_stream
from specpilot.serve.run import Run, ServeContext, make_spec, watch_disconnect
from specpilot.text import check_text


async def read_json(request: Request, limit: int):
    """The request's JSON body, read up to ``limit`` bytes.

    Raises:
        APIError: 413 over ``limit`` bytes; 400 for a body that is not UTF-8 or not JSON (or nested too deeply).
    """
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"the request body is {int(length)} bytes, over the server's limit of {limit} bytes",
                       code="request_too_large")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"the request body is over the server's limit of {limit} bytes",
                               code="request_too_large")
    except ClientDisconnect:  # the client went away mid-body: nobody to answer, nothing was run
        raise APIError(400, "the client disconnected before the request body was complete",
                       code="client_disconnected") from None
    try:
        return json.loads(check_text(bytes(body), "the request body"))
    except PromptError as e:
        raise APIError(400, str(e), code="invalid_value") from None
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the request body is not valid JSON: {str(e).splitlines()[0][:200]}",
                       code="invalid_json") from None


def _text(value: str, what: str) -> str:
    try:
        return check_text(value, what)
    except PromptError as e:
        raise APIError(400, str(e), param=what.split("[")[0], code="invalid_value") from None


def completion_prompt(ctx: ServeContext, prompt) -> list[int]:
    """Token ids of a completion ``prompt`` (text, token ids, or a list of one of those).

    Raises:
        APIError: 400 for several prompts or text that is not valid UTF-8.
    """
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"one prompt per request, got {len(prompt)} (send one request each; they are batched "
                           "on the server)", param="prompt", code="invalid_value")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return ctx.tokenizer(_text(prompt, "prompt"), add_special_tokens=False)["input_ids"]
    return list(prompt)


def create_app(ctx: ServeContext) -> FastAPI:
    """The FastAPI app serving ``ctx``. Its lifespan starts ``ctx.driver`` (unless it runs already) and stops it at
    shutdown (requests still held then get a 503)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not ctx.driver.alive():
            ctx.driver.start()
        yield
        await asyncio.to_thread(ctx.driver.stop)

    app = FastAPI(title="SpecPilot", description="Lossless greedy speculative decoding, OpenAI-compatible API.",
                  lifespan=lifespan)
    app.state.ctx = ctx

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail), code=None).body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return JSONResponse(APIError(400, str(e.errors()[:1])).body(), status_code=400)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}").body(), status_code=500)

    def check_auth(request: Request) -> None:
        if ctx.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), ctx.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the "
                           "key the server was started with (--api-key / SPECPILOT_API_KEY)", code="invalid_api_key")

    def check_model(name: str | None) -> None:
        if name is not None and name != ctx.model_name:
            raise APIError(404, f"the model {name!r} does not exist here; this server serves {ctx.model_name!r}",
                           param="model", code="model_not_found")

    def model_card() -> dict:
        return {"id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "specpilot",
                "root": ctx.model_name, "parent": None, "max_model_len": ctx.max_len,
                "chat_template": ctx.chat_source}

    @app.get("/health")
    async def health():
        ok = ctx.driver.alive()
        return JSONResponse({"status": "ok" if ok else "engine thread stopped"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        body, ctype = ctx.metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        check_auth(request)
        check_model(model_id)
        return model_card()

    async def respond(request: Request, req, spec, chat: bool):
        run = Run(ctx, spec, "chatcmpl" if chat else "cmpl", whole=not req.stream)
        watcher = asyncio.create_task(watch_disconnect(request.receive, run))
        try:
            admitted = await run.start()
        except BaseException:
            watcher.cancel()
            raise
        if not admitted:  # the client went away while its request waited
            watcher.cancel()
            return Response(status_code=499)
        if req.stream:
            return EventSourceResponse(sse_stream(ctx, run, watcher, chat, req.stream_options),
                                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text = await collect(run, watcher)
        if run.finish_reason is None:
            return Response(status_code=499)
        return JSONResponse((chat_object if chat else completion_object)(ctx, run, text))

    async def checked(request: Request, kind):
        """The request body as ``kind`` once the key, the model, the greedy-only fields and the stops are checked
        (raises APIError: 401, 404 or 4xx)."""
        check_auth(request)
        req = parse(kind, await read_json(request, ctx.max_body_bytes))
        check_model(req.model)
        check_greedy(req)
        for i, s in enumerate(req.stop_list()):
            _text(s, f"stop[{i}]")
        return req

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await checked(request, CompletionRequest)
        spec = make_spec(ctx, completion_prompt(ctx, req.prompt), req.max_tokens, req)
        return await respond(request, req, spec, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await checked(request, ChatRequest)
        ids = render_chat(ctx.tokenizer, ctx.chat_template, req.messages, req.add_generation_prompt)
        spec = make_spec(ctx, ids, req.max_new(), req)
        return await respond(request, req, spec, chat=True)

    return app


class Server(uvicorn.Server):
    """uvicorn's server for :func:`create_app`'s app, whose shutdown fails the requests still held near the end of
    its grace period, or at once on a forced quit, with the driver's 503 (``{"error": ...}``; an error event and
    ``[DONE]`` mid-stream).

    Plain uvicorn waits ``timeout_graceful_shutdown`` seconds for running requests and then cancels them: a
    non-streamed one got a bare ``500 Internal Server Error`` and the log a ``CancelledError`` traceback, and the
    app's lifespan, which stops the driver (its 503), ran only after that. Here the driver stops ``margin_s`` before
    the grace period ends (if the engine's current step runs past half the margin, it fails them without waiting for
    it), and uvicorn's own wait is ``drain_s`` longer than the grace period, so every request still held has the
    margin and the drain to write its 503 before uvicorn would cancel it: on a loaded machine the margin alone once
    was not enough (a bare 500). The wait ends as soon as the requests have answered.
    A second Ctrl-C (uvicorn's ``force_exit``) ends the wait at once and skips the lifespan's shutdown; the event
    loop would then cancel the requests still running (the same bare 500 and tracebacks). Here it stops the driver
    at once instead, gives the requests up to ``drain_s`` seconds to send their 503, and ends the lifespan.

    Args:
        app: the FastAPI app of ``ctx`` (:func:`create_app`).
        ctx: its :class:`~specpilot.serve.run.ServeContext` (the driver to stop).
        log_level: uvicorn's log level.
        grace_s: seconds requests may still finish normally after a shutdown begins (> ``margin_s``).
        margin_s: seconds before the end of ``grace_s`` at which held requests are failed.
        drain_s: seconds the failed requests get to send their answers after the grace period (and on a forced
            quit after it).
    """

    def __init__(self, app: FastAPI, ctx: ServeContext, log_level: str = "info", grace_s: float = 5.0,
                 margin_s: float = 1.0, drain_s: float = 2.0):
        super().__init__(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=grace_s + drain_s))
        self.ctx, self.fail_after_s, self.drain_s = ctx, max(grace_s - margin_s, 0.0), drain_s
        self.margin_s = margin_s

    async def shutdown(self, sockets=None) -> None:
        late = asyncio.create_task(self._fail_held())
        try:
            await super().shutdown(sockets)
        finally:
            late.cancel()
        if self.force_exit:
            await self._forced_end()

    async def _fail_held(self) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + self.fail_after_s
        while not self.force_exit and loop.time() < end:  # a forced quit fails them now, not at the end
            await asyncio.sleep(0.05)
        # a step still running half the margin later (a slow or loaded machine) does not hold the 503s back
        await asyncio.to_thread(self.ctx.driver.stop, 10.0, self.margin_s / 2)

    async def _forced_end(self) -> None:
        """After a forced quit: the driver stopped (its 503 delivered to every held request), the requests' tasks
        given ``drain_s`` to answer, and the app's lifespan ended (else its task is cancelled too)."""
        await asyncio.to_thread(self.ctx.driver.stop)
        loop = asyncio.get_running_loop()
        end = loop.time() + self.drain_s
        while self.server_state.tasks and loop.time() < end:
            await asyncio.sleep(0.02)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.lifespan.shutdown(), self.drain_s)
