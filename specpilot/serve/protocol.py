"""The OpenAI request bodies the server takes, and what a greedy engine must refuse.

Pydantic models of ``POST /v1/completions`` and ``POST /v1/chat/completions`` (OpenAI's fields plus vLLM's
``stop_token_ids``, ``top_k``, ``min_p``, ``repetition_penalty``, ``include_stop_str_in_output``,
``skip_special_tokens``, ``ignore_eos``, ``min_tokens``). Unknown fields are refused (a field the server ignored
could be a sampling option silently dropped). SpecPilot decodes greedily (lossless speculative decoding
reproduces the target's argmax): an omitted ``temperature`` means greedy; a field asking for anything else
(``temperature`` > 0, ``top_p`` < 1, ``n`` > 1, penalties, ``logit_bias``) is a 400 naming the field, never a silent
change, and so is a feature the server lacks (``echo``, ``suffix``, ``logprobs``, ``tools``, ...), each message
saying only what is wrong with its field (:func:`check_greedy`). ``seed``, ``user``, ``metadata``, ``store``,
``service_tier``, ``prompt_cache_key`` and ``safety_identifier`` are accepted and change nothing (a greedy output
does not depend on a seed). Every refusal is an :class:`APIError`, rendered as OpenAI's error JSON.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

#: most stop strings a request may give, and the longest one (characters)
MAX_STOPS, MAX_STOP_CHARS = 16, 1024


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``.

    Args:
        status: HTTP status (400, 401, 404, 413, 500, 503).
        message: one line saying what is wrong and what to do.
        param: the request field at fault (None: the whole request).
        code: a short machine-readable code (OpenAI's, e.g. ``unsupported_parameter``, ``context_length_exceeded``).
        type: OpenAI's error type (default: ``invalid_request_error`` below 500, else ``server_error``).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        """The JSON body: ``{"error": {...}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` (a last chunk with usage), vLLM's ``continuous_usage_stats`` (usage in
    every chunk); OpenAI's ``include_obfuscation`` is accepted and changes nothing here."""

    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None
    include_obfuscation: bool | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    n: StrictInt | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = None
    min_tokens: StrictInt | None = None
    seed: StrictInt | None = None
    user: str | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)

    def stop_list(self) -> list[str]:
        """The stop strings as a list."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Common):
    """``POST /v1/completions``: one prompt (text or token ids); ``max_tokens`` defaults to 16 (OpenAI's, vLLM's)."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(default=16, ge=1)
    best_of: StrictInt | None = None
    logprobs: StrictInt | None = None
    echo: bool | None = None
    suffix: str | None = None


class Message(BaseModel):
    """One chat message; ``content`` is text or a list of ``{"type": "text", "text": ...}`` parts."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatRequest(_Common):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` (or the older ``max_tokens``) defaults to what the
    context leaves after the prompt (vLLM's default)."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def max_new(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens`` (None: not given)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _unsupported_rules(req) -> list[tuple[str, bool, str]]:
    """``(field, refused, why)`` for every field the server cannot honour; ``why`` says only what that field
    asks for: sampling fields that a greedy engine cannot honour, other fields (``echo``, ``suffix``, ``logprobs``,
    ``tools``, ...) that the server does not implement."""
    g = getattr
    greedy = "SpecPilot serves greedy decoding only (the target's argmax)"
    return [
        ("temperature", req.temperature not in (None, 0), f"{greedy}, without sampling (send 0 or omit it)"),
        ("top_p", req.top_p not in (None, 1), f"{greedy}, without top-p sampling (send 1 or omit it)"),
        ("top_k", req.top_k not in (None, -1, 0, 1), f"{greedy}, without top-k sampling (send -1 / 0 or omit it)"),
        ("min_p", req.min_p not in (None, 0), f"{greedy}, without min-p sampling (send 0 or omit it)"),
        ("n", req.n not in (None, 1), f"{greedy}: its output is one text (send 1 or omit it)"),
        ("best_of", g(req, "best_of", None) not in (None, 1), f"{greedy}: it has one best (send 1 or omit it)"),
        ("presence_penalty", req.presence_penalty not in (None, 0), f"{greedy}, without penalties"),
        ("frequency_penalty", req.frequency_penalty not in (None, 0), f"{greedy}, without penalties"),
        ("repetition_penalty", req.repetition_penalty not in (None, 1), f"{greedy}, without penalties"),
        ("logit_bias", bool(req.logit_bias), f"{greedy}, without a logit bias"),
        ("logprobs", g(req, "logprobs", None) not in (None, False), "the server returns no log-probabilities"),
        ("top_logprobs", g(req, "top_logprobs", None) not in (None, 0), "the server returns no log-probabilities"),
        ("echo", bool(g(req, "echo", None)), "the server does not echo the prompt (send false or omit it)"),
        ("suffix", g(req, "suffix", None) is not None, "the server does not insert text (omit suffix)"),
        ("ignore_eos", bool(req.ignore_eos), "the engine always ends an output at EOS"),
        ("min_tokens", req.min_tokens not in (None, 0), "the engine cannot hold EOS back for a minimum length"),
        ("tools", bool(g(req, "tools", None)), "the server has no tools / function calling"),
        ("tool_choice", g(req, "tool_choice", None) not in (None, "none", "auto"),
         "the server has no tools / function calling"),
        ("response_format", (g(req, "response_format", None) or {"type": "text"}) != {"type": "text"},
         "the server has no structured outputs (only text)"),
    ]


def check_greedy(req) -> None:
    """Raise a 400 :class:`APIError` naming the first field of ``req`` the server cannot honour (a sampling option,
    or a feature it lacks such as ``echo``).

    Raises:
        APIError: 400, ``code="unsupported_parameter"``, ``param`` the field.
    """
    for field, refused, why in _unsupported_rules(req):
        if refused:
            raise APIError(400, f"{field}={getattr(req, field)!r} is not supported: {why}; the request was not run",
                           param=field, code="unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options",
                       code="invalid_value")
    stops = req.stop_list()
    if len(stops) > MAX_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise APIError(400, f"stop: at most {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters",
                       param="stop", code="invalid_value")


def validation_error(e: ValidationError) -> APIError:
    """A pydantic :class:`ValidationError` as one 400 :class:`APIError` naming the first field at fault."""
    errs = e.errors(include_url=False)
    first = errs[0] if errs else {"loc": (), "msg": str(e), "type": ""}
    loc = [str(x) for x in first["loc"] if not (isinstance(x, str) and ("[" in x or x in ("str", "int", "bool")))]
    field = ".".join(loc) or None
    if first["type"] == "extra_forbidden":
        msg = (f"unknown field {field!r}: not supported by this server, and refused rather than ignored (a field "
               "dropped silently could change what you asked for)")
    elif field == "prompt" or (field or "").startswith("prompt."):
        msg = "prompt: must be a string, a list of token ids (ints), or a list of one of those"
    else:
        msg = f"{field or 'body'}: {first['msg']}"
    return APIError(400, msg, param=(loc[0] if loc else None), code="invalid_value")


def parse(model: type[BaseModel], obj) -> Any:
    """``model`` validated from the decoded JSON ``obj``.

    Raises:
        APIError: 400 when ``obj`` is not a JSON object or does not fit ``model``.
    """
    if not isinstance(obj, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(obj).__name__}", code="invalid_json")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e) from None
