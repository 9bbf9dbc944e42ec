"""``--prompts FILE``: a deployment's own requests (OpenAI request bodies, one per line) as the pilot's request set."""

from __future__ import annotations

import json
import random

import pytest

from specpilot.errors import SpecPilotError
from specpilot.pilot.request_file import load_request_file


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from specpilot.zoo import bundled_target_dir

    return AutoTokenizer.from_pretrained(bundled_target_dir())


def _write(path, bodies) -> str:
    path.write_text("\n".join(b if isinstance(b, str) else json.dumps(b) for b in bodies) + "\n", encoding="utf-8")
    return str(path)


def test_chat_and_completion_bodies_become_the_servers_token_ids_grouped_and_budgeted(tmp_path, tok):
    from specpilot.serve.chat import choose_template, render_chat
    from specpilot.serve.protocol import ChatRequest

    chat = {"messages": [{"role": "user", "content": "What is 7 times 8?"}], "max_tokens": 5, "group": "math"}
    f = _write(tmp_path / "traffic.jsonl", [
        chat,
        "",  # blank lines are skipped
        {"prompt": "def add(a, b):", "group": "code"},
        {"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 100, "temperature": 0, "group": "code"},
        {"messages": [{"role": "user", "content": "Hi"}]},  # no group: the file's name
    ])
    reqs = load_request_file(f, tok, vocab_size=tok.vocab_size + 100, max_new_tokens=32)
    assert [(r.benchmark, r.index) for r in reqs] == [("math", 0), ("code", 0), ("code", 1), ("code", 2),
                                                      ("traffic", 0)]
    served = render_chat(tok, choose_template(tok)[0], ChatRequest.model_validate(
        {k: v for k, v in chat.items() if k != "group"}).messages)
    assert list(reqs[0].prompt_ids) == served  # what the server runs for that body
    assert list(reqs[1].prompt_ids) == tok("def add(a, b):", add_special_tokens=False)["input_ids"]
    assert [list(reqs[2].prompt_ids), list(reqs[3].prompt_ids)] == [[5, 6, 7], [8, 9]]
    # a body's own max_tokens, capped by the pilot's budget; a completion's default 16 is not the deployment's
    assert [r.max_new_tokens for r in reqs] == [5, 32, 32, 32, 32]


@pytest.mark.parametrize("line, says", [
    ("{not json", "line 1: not JSON"),
    ("[1, 2]", "line 1: each line must be a JSON object"),
    ('{"prompt": "x", "temperature": 0.7}', "line 1: temperature=0.7 is not supported"),
    ('{"prompt": "x", "bogus": 1}', "line 1: unknown field 'bogus'"),
    ('{"max_tokens": 3}', "line 1: neither \"messages\""),
    ('{"prompt": [1, 99999]}', "line 1: token id 99999 outside the target's vocabulary"),
    ('{"prompt": []}', "line 1: an empty prompt"),
    ('{"prompt": "x", "group": ""}', "line 1: \"group\" must be a non-empty string"),
])
def test_a_body_the_server_would_refuse_is_a_one_line_error_naming_its_line(tmp_path, tok, line, says):
    f = _write(tmp_path / "bad.jsonl", [line])
    with pytest.raises(SpecPilotError) as e:
        load_request_file(f, tok, vocab_size=1000, max_new_tokens=8)
    assert says in str(e.value) and "\n" not in str(e.value) and str(f) in str(e.value), str(e.value)


def test_no_tokenizer_takes_ids_and_byte_text_but_not_chat_and_an_empty_file_is_refused(tmp_path):
    f = _write(tmp_path / "ids.jsonl", [{"prompt": [1, 2, 3]}, {"prompt": "ab"}])
    reqs = load_request_file(f, None, vocab_size=600, max_new_tokens=4)
    assert [list(r.prompt_ids) for r in reqs] == [[1, 2, 3], [256 + ord("a"), 256 + ord("b")]]
    chat = _write(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(SpecPilotError, match="line 1: a chat request needs the target's tokenizer"):
        load_request_file(chat, None, vocab_size=600, max_new_tokens=4)
    with pytest.raises(SpecPilotError, match="no request in it"):
        load_request_file(_write(tmp_path / "empty.jsonl", [""]), None, vocab_size=600, max_new_tokens=4)


def test_cli_refuses_a_missing_prompts_file_in_one_line(monkeypatch, capsys, tmp_path):
    from .conftest import run_cli

    code, _, err = run_cli(monkeypatch, capsys, "pilot", "--batch", "1,2", "--prompts", str(tmp_path / "nope.jsonl"),
                           "--out", str(tmp_path / "r"))
    assert code == 2 and err.startswith("error: --prompts") and "not found" in err and err.count("\n") == 1, err


def test_batched_pilot_tunes_on_the_files_groups_and_a_resume_with_another_file_is_refused(tmp_path, tok):
    """The request set is the file's (its groups are the strata, the report names the file); the journal holds the
    file's hash, so resuming the run's directory with an edited file is refused instead of mixing two workloads."""
    from specpilot.pilot.batch_pilot import run_batch_pilot
    from specpilot.pilot.state import PilotOptions
    from specpilot.zoo import bundled_target_dir

    qs = ["What is 12 plus 30?", "Name three colors.", "Count to five.", "Spell the word cat."]
    f = tmp_path / "mine.jsonl"
    _write(f, [{"messages": [{"role": "user", "content": q}], "group": "chat" if i % 2 else "math"}
               for i, q in enumerate(qs)])
    out = tmp_path / "r"
    opts = PilotOptions(target=bundled_target_dir(), out=out, quick=True, prompts=f,
                        overrides={"per_benchmark": 2, "max_new_tokens": 8})
    rep = run_batch_pilot(opts, (1, 2), rounds=2, rng=random.Random(3))
    assert rep["benchmarks"] == {"math": 2, "chat": 2}
    assert str(f) in rep["deployment"]["requests"] and "--prompts" in (out / "batch_report.md").read_text()
    assert rep["outputs_equal_ar"]["sealed"] is True
    f.write_text(f.read_text().replace("cat", "dog"))
    with pytest.raises(SpecPilotError, match="another"):
        run_batch_pilot(opts, (1, 2), rounds=2, rng=random.Random(3))
