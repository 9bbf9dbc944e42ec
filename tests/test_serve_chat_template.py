"""A chat template that is not valid Jinja is refused when the server starts (one line, exit 2), not answered per
request with a 400 that blames the client's messages; a template that raises for some message lists still starts."""

from __future__ import annotations

import copy

import pytest

from specpilot.errors import PromptError
from specpilot.model.checkpoint import load_tokenizer
from specpilot.serve.chat import choose_template, render_chat
from specpilot.serve.protocol import APIError, Message
from specpilot.zoo import bundled_target_dir

from .conftest import run_cli

TOK = load_tokenizer(bundled_target_dir())


@pytest.mark.parametrize("text, what", [("{% for m in messages %}{{ m.content", "unexpected end of template"),
                                        ("{{ messages[0].content | nofilter }}", "No filter named 'nofilter'"),
                                        ("hi\n{% endfor %}", "line 2")])
def test_a_template_with_a_syntax_error_is_refused_at_start(tmp_path, text, what):
    f = tmp_path / "t.jinja"
    f.write_text(text)
    with pytest.raises(PromptError, match="is not a valid Jinja template") as e:
        choose_template(TOK, f)
    assert what in str(e.value) and str(f) in str(e.value) and "\n" not in str(e.value)
    own = copy.copy(TOK)
    own.chat_template = text
    with pytest.raises(PromptError, match="the tokenizer's chat template"):
        choose_template(own)


def test_a_template_that_raises_for_some_messages_still_starts(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
                 "{{ messages[0]['content'] }}")
    template, source = choose_template(TOK, f)
    assert source == f"file {f}"
    assert render_chat(TOK, template, [Message(role="user", content="hi")]) == TOK("hi")["input_ids"]
    with pytest.raises(APIError, match="one message only"):
        render_chat(TOK, template, [Message(role="user", content="a"), Message(role="user", content="b")])


def test_serve_with_a_broken_template_exits_with_one_line(monkeypatch, capsys, tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m.content")

    def started(*a, **k):
        raise AssertionError("the server started with a broken chat template")

    monkeypatch.setattr("specpilot.serve.app.Server.run", started)
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--port", "0", "--chat-template", str(f))
    assert code == 2 and "is not a valid Jinja template" in err and len(err.strip().splitlines()) == 1, err


def test_a_message_without_content_is_a_400_but_an_assistant_turn_may_have_none():
    """OpenAI answers 400 for a user or system message without content; the server took it as empty text."""
    template, _ = choose_template(TOK)
    for role in ("user", "system"):
        with pytest.raises(APIError, match=r"messages\[0\] \(" + role + r"\) has no content") as e:
            render_chat(TOK, template, [Message(role=role, content=None)])
        assert e.value.status == 400
    ids = render_chat(TOK, template, [Message(role="user", content="hi"), Message(role="assistant", content=None),
                                      Message(role="user", content="again")])
    assert ids
