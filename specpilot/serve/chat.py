"""Chat messages to prompt token ids: the tokenizer's chat template, or a named fallback.

A chat request is rendered with the chat template of the target's tokenizer (``apply_chat_template`` with
``add_generation_prompt``), or with the template given to ``specpilot serve --chat-template FILE``. A tokenizer
without one (a base model's) gets :data:`FALLBACK_TEMPLATE`, a plain ``role: content`` transcript ending in
``assistant:``; the server says so when it starts and in its ``/v1/models`` entry (``chat_template``), never
silently. The rendered text is tokenized without adding special tokens (the template writes its own).
"""

from __future__ import annotations

from pathlib import Path

import jinja2

from specpilot.errors import PromptError
from specpilot.serve.protocol import APIError
from specpilot.text import check_text

#: the template used when the tokenizer has none and no --chat-template is given
FALLBACK_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant:{% endif %}")
ROLES = ("system", "developer", "user", "assistant")


def choose_template(tokenizer, path: str | Path | None = None) -> tuple[str, str]:
    """The chat template to use and where it comes from: ``(template, "file PATH" | "tokenizer" | "fallback")``.

    A template that is not valid Jinja is refused here, when the server starts: rendered per request, its syntax
    error would reach every chat client as a 400 blaming their messages, from a server that can never serve chat.

    Raises:
        PromptError: ``path`` cannot be read or is not UTF-8; the template has a Jinja syntax error (one line).
    """
    if path is not None:
        from specpilot.text import read_text

        template = read_text(path, f"--chat-template {path}")
        _check_syntax(tokenizer, template, f"--chat-template {path}")
        return template, f"file {path}"
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, str) and own.strip():
        _check_syntax(tokenizer, own, "the tokenizer's chat template (pass --chat-template FILE instead)")
        return own, "tokenizer"
    return FALLBACK_TEMPLATE, "fallback"


def _check_syntax(tokenizer, template: str, where: str) -> None:
    """Render one user message through ``template`` the way :func:`render_chat` does; only a syntax error (an
    unknown tag or filter, an unclosed block) is an error here: anything else, e.g. the template's own
    ``raise_exception`` for a message list it does not take, belongs to the requests that send such lists.

    Raises:
        PromptError: ``template`` is not valid Jinja (``where``, the line and jinja's message; one line).
    """
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template, tokenize=False,
                                      add_generation_prompt=True)
    except jinja2.TemplateSyntaxError as e:
        raise PromptError(f"{where} is not a valid Jinja template: line {e.lineno}: {e.message}") from None
    except Exception:  # noqa: BLE001 - not a syntax error: the requests' concern (render_chat answers a 400)
        pass


def _content(i: int, content) -> str:
    """A message's content as text: a string, or text parts joined by newlines (vLLM's joining)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.get("type") != "text":
            raise APIError(400, f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are "
                           f"supported, got a {part.get('type')!r} part", param="messages", code="invalid_value")
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"messages[{i}].content: a text part needs a string 'text', got "
                           f"{type(part.get('text')).__name__}", param="messages", code="invalid_value")
        texts.append(part["text"])
    return "\n".join(texts)


def render_chat(tokenizer, template: str, messages, add_generation_prompt: bool = True) -> list[int]:
    """Prompt token ids of ``messages`` (the request's :class:`~specpilot.serve.protocol.Message` list).

    Raises:
        APIError: 400 for a role other than system / developer / user / assistant, a message other than an
            assistant's without content, a non-text content part, text that is not valid UTF-8, or a template that
            fails to render (its message named).
    """
    msgs = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise APIError(400, f"messages[{i}].role {m.role!r} is not supported (use {', '.join(ROLES)})",
                           param="messages", code="invalid_value")
        if m.content is None and m.role != "assistant":  # only an assistant turn may come without content
            raise APIError(400, f"messages[{i}] ({m.role}) has no content", param="messages", code="invalid_value")
        try:
            text = check_text(_content(i, m.content), f"messages[{i}].content")
        except PromptError as e:
            raise APIError(400, str(e), param="messages", code="invalid_value") from None
        msgs.append({"role": m.role, "content": text} | ({"name": m.name} if m.name else {}))
    try:
        rendered = tokenizer.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
    except Exception as e:  # a template's own raise_exception(...) or a jinja error: the client's messages
        raise APIError(400, f"the chat template could not render these messages: {str(e).splitlines()[0]}",
                       param="messages", code="invalid_value") from None
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]
